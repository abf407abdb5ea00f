"""Serving metrics from `RequestRecord`s (named as `vllm bench serve --save-result` names them) and the printed
report blocks. Pure functions: no I/O, no clock."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cluster.bench.client import RequestRecord
    from cluster.bench.config import BenchConfig

STAT_NAMES = ("ttft", "tpot", "itl", "e2el")
STAT_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks, as numpy.percentile's default."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean / median / std / p99 in milliseconds; all None when there are no values."""
    if not values_s:
        return {"mean": None, "median": None, "std": None, "p99": None}
    values_ms = [value * 1000.0 for value in values_s]
    return {
        "mean": statistics.fmean(values_ms),
        "median": percentile(values_ms, 50),
        "std": statistics.pstdev(values_ms),
        "p99": percentile(values_ms, 99),
    }


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """The largest number of requests in flight at one instant (ends sort before starts at equal times)."""
    events = sorted(
        [(record.start_s, 1) for record in records] + [(record.start_s + record.latency_s, -1) for record in records]
    )
    peak = current = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


def summarize(records: Sequence[RequestRecord], duration_s: float | None = None) -> dict[str, Any]:
    """Aggregate metrics, named like `vllm bench serve --save-result` (latencies in ms, throughputs per second).

    Failed requests are counted in `failed` and left out of every token count and latency statistic.
    `duration_s` defaults to first request start -> last request end. TPOT is per request
    (e2e - ttft) / (output_tokens - 1), over requests with more than one output token.
    """
    if duration_s is None:
        duration_s = (
            max(record.start_s + record.latency_s for record in records) - min(record.start_s for record in records)
            if records
            else 0.0
        )
    succeeded = [record for record in records if record.success]
    total_output = sum(record.output_tokens for record in succeeded)
    total_input = sum(record.prompt_tokens or 0 for record in succeeded)
    ttfts = [record.ttft_s for record in succeeded if record.ttft_s is not None]
    tpots = [
        (record.latency_s - record.ttft_s) / (record.output_tokens - 1)
        for record in succeeded
        if record.ttft_s is not None and record.output_tokens > 1
    ]
    itls = [gap for record in succeeded for gap in record.itl_s]
    e2els = [record.latency_s for record in succeeded]

    def per_second(amount: float) -> float:
        return amount / duration_s if duration_s > 0 else 0.0

    summary: dict[str, Any] = {
        "completed": len(succeeded),
        "failed": len(records) - len(succeeded),
        "duration": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        # Input tokens come from the server's usage; without it they are unknown and left out of the total rate.
        "input_tokens_known": all(record.prompt_tokens is not None for record in succeeded),
        "request_throughput": per_second(len(succeeded)),
        "output_throughput": per_second(total_output),
        "total_token_throughput": per_second(total_input + total_output),
        "max_concurrent_requests": peak_concurrency(records),
    }
    for name, values in zip(STAT_NAMES, (ttfts, tpots, itls, e2els)):
        for stat, value in distribution_ms(values).items():
            summary[f"{stat}_{name}_ms"] = value
    return summary


def format_report(summary: dict[str, Any], config: BenchConfig | None = None) -> str:
    """The printed result block, laid out like vllm's."""

    def number(value: Any, decimals: int = 2) -> str:
        if value is None:
            return "n/a"
        if isinstance(value, float):
            return f"{value:.{decimals}f}"
        return str(value)

    def row(label: str, value: Any) -> str:
        return f"{label:<40} {number(value):<10}".rstrip()

    lines = ["{:=^50}".format(" Serving Benchmark Result ")]
    lines.append(row("Successful requests:", summary["completed"]))
    lines.append(row("Failed requests:", summary["failed"]))
    if config is not None:
        lines.append(row("Maximum request concurrency:", config.max_concurrency or "unlimited"))
        lines.append(
            row("Request rate configured (RPS):", "inf" if math.isinf(config.request_rate) else config.request_rate)
        )
    lines.append(row("Benchmark duration (s):", summary["duration"]))
    input_label = "Total input tokens:" if summary.get("input_tokens_known", True) else "Total input tokens (partial):"
    lines.append(row(input_label, summary["total_input_tokens"]))
    lines.append(row("Total generated tokens:", summary["total_output_tokens"]))
    lines.append(row("Request throughput (req/s):", summary["request_throughput"]))
    lines.append(row("Output token throughput (tok/s):", summary["output_throughput"]))
    lines.append(row("Peak concurrent requests:", summary["max_concurrent_requests"]))
    lines.append(row("Total token throughput (tok/s):", summary["total_token_throughput"]))
    for name in STAT_NAMES:
        title, short = STAT_TITLES[name]
        lines.append(f"{title:-^50}")
        lines.append(row(f"Mean {short} (ms):", summary[f"mean_{name}_ms"]))
        lines.append(row(f"Median {short} (ms):", summary[f"median_{name}_ms"]))
        lines.append(row(f"P99 {short} (ms):", summary[f"p99_{name}_ms"]))
    lines.append("=" * 50)
    return "\n".join(lines)


def format_baselines(baselines: dict[str, Any]) -> str:
    """The printed "Baselines" block: our throughput, HF generate per batch size, the matmul roofline, ratios."""

    def row(label: str, value: Any) -> str:
        return f"{label:<40} {value}".rstrip()

    best = baselines["hf_best"]
    batch = baselines["roofline_batch_size"]
    lines = ["{:=^50}".format(" Baselines ")]
    lines.append(row("Model directory:", baselines["model_dir"]))
    lines.append(row("Torch threads (HF and roofline):", baselines["torch_threads"]))
    lines.append(row("Dtype, HF / roofline:", f"{baselines['hf_dtype']} / {baselines['roofline_dtype']}"))
    lines.append(row("Ours: output token throughput (tok/s):", f"{baselines['ours_output_tok_per_s']:.2f}"))
    for run in baselines["hf"]:
        lines.append(row(f"HF generate, batch {run['batch_size']} (tok/s):", f"{run['output_tok_per_s']:.2f}"))
    lines.append(row("HF generate best (tok/s):", f"{best['output_tok_per_s']:.2f}"))
    lines.append(row("HF generate best batch size:", best["batch_size"]))
    for key in ("roofline", "roofline_batch1"):
        roofline = baselines[key]
        lines.append(row(f"Matmul roofline, batch {roofline['batch_size']} (tok/s):", f"{roofline['tok_per_s']:.2f}"))
        lines.append(
            row(f"  linears-only step, batch {roofline['batch_size']} (ms):", f"{roofline['step_time_s'] * 1e3:.2f}")
        )
        lines.append(row("  LM head:", roofline.get("lm_head")))
    ceiling = baselines["ceiling"]
    lines.append(row("Workload ceiling, linears only (tok/s):", f"{ceiling['output_tok_per_s']:.2f}"))
    lines.append(
        row(
            "  prefill / decode linears (s):", f"{ceiling['prefill_linears_s']:.2f} / {ceiling['decode_linears_s']:.2f}"
        )
    )
    lines.append(row("  TTFT p50 floor (ms):", f"{baselines['ttft_p50_floor_ms']:.1f}"))
    lines.append(row("Ours / HF best:", f"{baselines['ratio_ours_vs_hf_best']:.3f}"))
    lines.append(row(f"Ours / roofline (batch {batch}):", f"{baselines['ratio_ours_vs_roofline']:.3f}"))
    lines.append(row("Ours / workload ceiling:", f"{baselines['ratio_ours_vs_ceiling']:.3f}"))
    lines.append("=" * 50)
    return "\n".join(lines)
