"""`pagedserve bench`: an online serving benchmark in the style of `vllm bench serve`.

Sends streaming requests over real HTTP to any OpenAI-compatible endpoint (ours or another server) and reports
request and token throughput with TTFT, TPOT, ITL and end-to-end latency statistics. With `baselines` on, the same
prompts then go through HF transformers `generate` and our model's linear layers alone (`cluster.bench.baselines`),
in the precision the server serves (`dtype`), and the report adds our throughput as ratios of theirs.

Callers that want the numbers rather than the printed report use `run_benchmark` (async, returns a dict) and the
pure `cluster.bench.stats.summarize` on `RequestRecord`s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp

from cluster.bench.client import RequestRecord, client_session, endpoint_url, first_model_id, send_request
from cluster.bench.config import BenchConfig
from cluster.bench.stats import format_baselines, format_report, summarize
from cluster.bench.workload import arrival_gaps, output_length_bounds, output_lengths, synthetic_prompts

logger = logging.getLogger(__name__)


def baseline_model_dir(model_dir: str | None, served_model: str) -> Path:
    """`model_dir` when given, else the served id resolved as a known alias (fetched if missing); ValueError
    for any other served id, which needs --model-dir."""
    from model_executor.model_fetch import MODEL_ALIASES, resolve_model
    from model_executor.tiny_model import TINY_ALIAS

    if model_dir:
        return resolve_model(model_dir)
    if served_model in MODEL_ALIASES or served_model == TINY_ALIAS:
        return resolve_model(served_model)
    raise ValueError(
        f"--baselines needs the weights of the served model {served_model!r}, which is no known alias "
        f"({', '.join(sorted([*MODEL_ALIASES, TINY_ALIAS]))}): pass --model-dir"
    )


def run_baselines(
    config: BenchConfig, model_dir: Path, prompts: Sequence[str], summary: dict[str, Any]
) -> dict[str, Any]:
    """HF generate and the matmul roofline on the HTTP run's prompts and output length, with ratios to `summary`.

    The roofline batch is the HTTP run's peak number of concurrent requests (its effective decode batch, at most
    max_concurrency), and batch 1 besides. All of them run in `config.dtype`, the precision the server serves
    ("auto": as the engine resolves it, HF generate on the CPU, the rooflines on this machine's device).
    """
    import torch

    from cluster.bench.baselines import hf_generate_throughput, matmul_roofline, workload_ceiling

    show_progress = not config.disable_tqdm
    logger.info(
        "baselines on %d prompts, %d tokens out, model %s, dtype %s",
        len(prompts),
        config.output_len,
        model_dir,
        config.dtype,
    )
    if config.random_range_ratio or config.temperature:
        logger.warning(
            "the baselines decode greedily, output_len (%d) tokens for every prompt, whatever the HTTP run's "
            "temperature and per-request lengths",
            config.output_len,
        )
    batch = max(1, summary["max_concurrent_requests"])
    # The rooflines before HF: after minutes of HF generate in this process the same matmuls time slower.
    roofline = matmul_roofline(
        model_dir, batch, config.roofline_iterations, dtype=config.dtype, show_progress=show_progress
    )
    roofline_batch1 = (
        roofline
        if batch == 1
        else matmul_roofline(model_dir, 1, config.roofline_iterations, dtype=config.dtype, show_progress=show_progress)
    )
    hf_runs = hf_generate_throughput(
        model_dir,
        prompts,
        config.output_len,
        config.hf_batch_sizes,
        chat=config.endpoint == "chat",
        dtype=config.dtype,
        show_progress=show_progress,
    )
    best = max(hf_runs, key=lambda run: run["output_tok_per_s"])
    ceiling = workload_ceiling(
        model_dir,
        best["prompt_token_counts"],
        config.output_len,
        iterations=config.roofline_iterations,
        dtype=config.dtype,
        show_progress=show_progress,
    )
    ours = summary["output_throughput"]
    # The HTTP run's input tokens (server usage, successful requests) should equal HF's unpadded prompt tokens.
    http_prompt_tokens = summary["total_input_tokens"] if summary.get("input_tokens_known") else None
    if summary["failed"] == 0 and http_prompt_tokens is not None and http_prompt_tokens != best["prompt_tokens"]:
        logger.warning(
            "HF tokenized the prompts to %d tokens, the server to %d", best["prompt_tokens"], http_prompt_tokens
        )
    return {
        "model_dir": str(model_dir),
        "num_prompts": len(prompts),
        "output_len": config.output_len,
        "torch_threads": torch.get_num_threads(),
        "dtype": config.dtype,
        "hf_dtype": best["dtype"],
        "roofline_dtype": roofline["dtype"],
        "ours_output_tok_per_s": ours,
        "http_prompt_tokens": http_prompt_tokens,
        "hf": hf_runs,
        "hf_best": best,
        "hf_best_batch_size": best["batch_size"],
        "hf_best_output_tok_per_s": best["output_tok_per_s"],
        "roofline_batch_size": batch,
        "roofline": roofline,
        "roofline_tok_per_s": roofline["tok_per_s"],
        "roofline_batch1": roofline_batch1,
        "roofline_batch1_tok_per_s": roofline_batch1["tok_per_s"],
        "ratio_ours_vs_hf_best": ours / best["output_tok_per_s"],
        "ratio_ours_vs_roofline": ours / roofline["tok_per_s"],
        "ceiling": ceiling,
        "ceiling_tok_per_s": ceiling["output_tok_per_s"],
        "ratio_ours_vs_ceiling": ours / ceiling["output_tok_per_s"],
        "ttft_p50_floor_ms": ceiling["ttft_p50_floor_s"] * 1000,
    }


async def send_all(
    session: aiohttp.ClientSession,
    config: BenchConfig,
    model: str,
    prompts: Sequence[str],
    max_tokens: Sequence[int],
) -> tuple[list[RequestRecord], float]:
    """Every prompt (with its max_tokens) on the configured arrival schedule and concurrency limit; returns the
    records and the wall time from the first send to the last answer."""
    from tqdm import tqdm

    gaps = arrival_gaps(len(prompts), config.request_rate, config.seed)
    semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    progress = tqdm(total=len(prompts), disable=config.disable_tqdm, desc="requests")

    async def limited(prompt: str, request_max_tokens: int, origin: float) -> RequestRecord:
        async with semaphore if semaphore is not None else contextlib.nullcontext():
            record = await send_request(session, config, model, prompt, request_max_tokens, origin)
        progress.update(1)
        return record

    origin = time.perf_counter()
    tasks = []
    for prompt, request_max_tokens, gap in zip(prompts, max_tokens, gaps):
        if gap > 0:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(limited(prompt, request_max_tokens, origin)))
    records = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - origin
    progress.close()
    return records, duration


def warn_about(records: Sequence[RequestRecord], max_tokens: Sequence[int]) -> None:
    """Log failed requests, a server without usage, and requests that generated other than their max_tokens."""
    for record in records:
        if not record.success:
            logger.warning("request failed: %s", record.error)
    succeeded = [(record, expected) for record, expected in zip(records, max_tokens) if record.success]
    if succeeded and not any(record.usage_reported for record, _ in succeeded):
        logger.warning("the server sent no usage; output tokens are counted as text chunks")
    short = [(record.output_tokens, expected) for record, expected in succeeded if record.output_tokens != expected]
    if short:
        logger.warning(
            "%d requests generated other than their max_tokens (ignore_eos unsupported?), (generated, asked): %s",
            len(short),
            short[:10],
        )


async def run_benchmark(args: BenchConfig | argparse.Namespace | dict[str, Any]) -> dict[str, Any]:
    """Run the whole benchmark and return {"config", "model", "summary", per-request lists}; prints the report.

    Raises ValueError on bad settings and RuntimeError when the warm-up request fails (the endpoint is wrong or
    down). Writes the result to `output_json` when set.
    """
    config = BenchConfig.from_any(args)
    config.validate()
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    prompts = synthetic_prompts(config.num_prompts, config.input_len, config.seed, config.shared_prefix_words)
    max_tokens = output_lengths(config.num_prompts, config.output_len, config.random_range_ratio, config.seed)
    lowest, highest = output_length_bounds(config.output_len, config.random_range_ratio)
    async with client_session(config.max_concurrency, headers) as session:
        model = config.model or await first_model_id(session, config.base_url)
        # Before any request: a missing model directory must not cost a whole benchmark run first.
        model_dir = baseline_model_dir(config.model_dir, model) if config.baselines else None
        logger.info(
            "benchmarking %s at %s: %d prompts, %d+%d words in, %s tokens out, temperature %s, rate %s req/s, "
            "concurrency %s",
            model,
            endpoint_url(config),
            config.num_prompts,
            config.shared_prefix_words,
            config.input_len,
            lowest if lowest == highest else f"{lowest}-{highest}",
            config.temperature,
            config.request_rate,
            config.max_concurrency or "unlimited",
        )
        if config.warmup:
            # Its own seed so the warm-up doesn't put a measured prompt in the server's prefix cache.
            warmup_prompt = synthetic_prompts(1, config.input_len, config.seed + 1_000_003)[0]
            warm = await send_request(
                session, config, model, warmup_prompt, min(config.output_len, 4), time.perf_counter()
            )
            if not warm.success:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
            logger.info("warm-up request ok (%.0f ms); starting the benchmark", warm.latency_s * 1000)
        records, duration = await send_all(session, config, model, prompts, max_tokens)

    summary = summarize(records, duration)
    warn_about(records, max_tokens)
    print(format_report(summary, config))  # the report is the command's output
    baselines = None
    if model_dir is not None:
        if summary["completed"]:
            baselines = run_baselines(config, model_dir, prompts, summary)
            print(format_baselines(baselines))
        else:
            logger.warning("no request succeeded: no baselines to compare with")

    result: dict[str, Any] = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "model": model,
        "config": dataclasses.asdict(config),
        "summary": summary,
        "input_lens": [record.prompt_tokens for record in records],
        "output_lens": [record.output_tokens for record in records],
        "ttfts": [record.ttft_s for record in records],
        "itls": [record.itl_s for record in records],
        "e2els": [record.latency_s for record in records],
        "start_times": [record.start_s for record in records],
        "generated_texts": [record.generated_text for record in records],
        "errors": [record.error for record in records],
    }
    if baselines is not None:
        result["baselines"] = baselines
    # API keys stay out of result files; inf is no JSON number.
    result["config"]["api_key"] = "***" if config.api_key else None
    if math.isinf(config.request_rate):
        result["config"]["request_rate"] = "inf"
    if config.output_json:
        path = Path(config.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        logger.info("wrote %s", path)
    return result
