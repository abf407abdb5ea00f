"""`pagedserve bench`: an online serving benchmark in the style of `vllm bench serve`.

Sends streaming requests over real HTTP to any OpenAI-compatible endpoint (ours or another server) and reports
request and token throughput with TTFT, TPOT, ITL and end-to-end latency statistics. With `baselines` on, the same
prompts then go through HF transformers `generate` and our model's linear layers alone (see `cluster.baselines`),
and the report adds our throughput as ratios of theirs.

Callers that want the numbers rather than the printed report use `run_benchmark` (async, returns a dict) and the
pure `summarize` on `RequestRecord`s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import random
import statistics
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, TypeVar

import aiohttp

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Common English words, so prompts tokenize to ordinary tokens in every tokenizer (no dataset download).
COMMON_WORDS = (
    "the of and to in is was for on that with as by at from his her an were are which this be or had not but one "
    "all their they have has been who its when more there will would can about into out other than time people "
    "year way day man thing woman life child world school state family student group country problem hand part "
    "place case week company system program question work government number night point home water room mother "
    "area money story fact month lot right study book eye job word business issue side kind head house service "
    "friend father power hour game line end member law car city community name president team minute idea kid "
    "body information back parent face others level office door health person art war history party result "
    "change morning reason research girl guy moment air teacher force education river market garden winter "
    "engine letter music forest window doctor summer bridge island mountain village ocean station library"
)
WORDS = COMMON_WORDS.split()

STAT_NAMES = ("ttft", "tpot", "itl", "e2el")
STAT_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


@dataclass
class BenchConfig:
    """Benchmark settings; the CLI flags of `pagedserve bench` map one to one onto these fields."""

    base_url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None  # None: the first id from GET {base_url}/models
    endpoint: Literal["completions", "chat"] = "completions"
    num_prompts: int = 64
    input_len: int = 48  # random words per prompt, after the shared prefix if any
    output_len: int = 64  # max_tokens, sent with ignore_eos so every request generates exactly this many
    request_rate: float = math.inf  # inf: all requests at once; else Poisson arrivals at this rate (req/s)
    max_concurrency: int | None = None  # None: unlimited in-flight requests
    shared_prefix_words: int = 0  # every prompt starts with the same N-word prefix (prefix-cache measurements)
    seed: int = 0
    output_json: str | None = None
    api_key: str | None = None
    timeout: float = 600.0  # seconds a single request may take in total before it counts as failed
    warmup: bool = True  # one untimed request first; the benchmark aborts if it fails
    disable_tqdm: bool = False
    # After the HTTP run: HF generate and the matmul roofline on the same prompts, in this process.
    baselines: bool = False
    model_dir: str | None = None  # the served model's HF directory; None: resolve the served id if it is an alias
    hf_batch_sizes: tuple[int, ...] = (8, 16, 32)  # static batch sizes tried for HF generate (a "8,16" string works)
    roofline_iterations: int = 20  # timed linear-only decode steps per batch size (median taken)

    def __post_init__(self) -> None:
        self.hf_batch_sizes = parse_batch_sizes(self.hf_batch_sizes)

    @classmethod
    def from_any(cls, args: BenchConfig | argparse.Namespace | dict[str, Any]) -> BenchConfig:
        """Accepts a BenchConfig, an argparse Namespace or a dict; unknown attributes are ignored."""
        if isinstance(args, BenchConfig):
            return args
        values = args if isinstance(args, dict) else vars(args)
        names = {config_field.name for config_field in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in values.items() if name in names})


def parse_batch_sizes(value: str | Sequence[int]) -> tuple[int, ...]:
    """ "8,16,32" (or a sequence of ints) -> (8, 16, 32); raises ValueError unless every size is an int >= 1."""
    parts = [part for part in value.split(",") if part.strip()] if isinstance(value, str) else list(value)
    try:
        sizes = tuple(int(part) for part in parts)
    except (TypeError, ValueError):
        raise ValueError(f"batch sizes must be comma-separated integers, got {value!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"batch sizes must be one or more integers >= 1, got {value!r}")
    return sizes


@dataclass
class RequestRecord:
    """What one request measured. Times are seconds; `start_s` is relative to the benchmark start."""

    success: bool = False
    start_s: float = 0.0
    latency_s: float = 0.0  # end-to-end: request sent -> stream finished
    ttft_s: float | None = None  # request sent -> first non-empty text chunk
    itl_s: list[float] = field(default_factory=list)  # gaps between successive non-empty text chunks
    output_tokens: int = 0  # usage.completion_tokens when the server sends it, else the number of text chunks
    prompt_tokens: int | None = None  # usage.prompt_tokens; None when the server sends no usage
    usage_reported: bool = False
    generated_text: str = ""
    error: str = ""


# ---------------------------------------------------------------------------------------------------------------
# Pure metric computation


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


# ---------------------------------------------------------------------------------------------------------------
# Dataset and request schedule


def synthetic_prompts(num_prompts: int, input_len: int, seed: int, shared_prefix_words: int = 0) -> list[str]:
    """Deterministic prompts of random common words: the same shared prefix (if any), then `input_len` words."""
    rng = random.Random(seed)
    prefix = [rng.choice(WORDS) for _ in range(shared_prefix_words)]
    return [" ".join(prefix + [rng.choice(WORDS) for _ in range(input_len)]) for _ in range(num_prompts)]


def arrival_gaps(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait before sending each request: zeros at rate inf, else the first at once and exponential gaps
    (Poisson arrivals) after it, as vllm schedules them."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if request_rate <= 0:
        raise ValueError(f"request rate must be positive or inf, got {request_rate}")
    # A generator of its own, so the schedule doesn't depend on how many words the prompts drew.
    rng = random.Random(seed + 1)
    return [0.0] + [rng.expovariate(request_rate) for _ in range(num_requests - 1)] if num_requests else []


# ---------------------------------------------------------------------------------------------------------------
# HTTP


def request_body(config: BenchConfig, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        body["max_completion_tokens"] = max_tokens
    else:
        body["prompt"] = prompt
        body["max_tokens"] = max_tokens
    return body


def endpoint_url(config: BenchConfig) -> str:
    path = "chat/completions" if config.endpoint == "chat" else "completions"
    return f"{config.base_url.rstrip('/')}/{path}"


def chunk_text(chunk: dict[str, Any]) -> str:
    """The generated text a streamed chunk carries, for completions and chat chunks alike."""
    text = ""
    for choice in chunk.get("choices") or []:
        if "text" in choice:
            text += choice.get("text") or ""
        delta = choice.get("delta") or {}
        # Reasoning servers stream thinking as reasoning_content; it is generated output all the same.
        text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return text


async def sse_payloads(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The payload of every `data:` line of a server-sent event stream, stopping at `data: [DONE]`."""
    async for line in response.content:
        if not line.startswith(b"data:"):
            continue  # blank separators, `:` keep-alive comments, event/id fields
        payload = line[len(b"data:") :].strip()
        if payload == b"[DONE]":
            return
        if payload:
            yield payload


def run_client(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a benchmark client on uvloop where it is installed (it comes with Ray Serve's uvicorn): the client
    shares the machine with the server under test, and uvloop's event loop takes less of it (64 streams of 64
    chunks from a local server: 0.14 CPU-s against 0.20-0.21 on asyncio's own loop)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def client_session(max_connections: int | None, headers: dict[str, str] | None = None) -> aiohttp.ClientSession:
    """The benchmark's HTTP client: aiohttp, as `vllm bench serve` uses, because the client shares the machine with
    the server under test (64 streams of 64 chunks from a local server: 0.16 CPU-s against 0.39-0.55 with httpx).
    Enough pooled connections for every in-flight request (waiting on the pool would count as TTFT); each request
    keeps its own deadline, so the session has none."""
    return aiohttp.ClientSession(
        headers=headers,
        connector=aiohttp.TCPConnector(limit=max_connections or 0),
        timeout=aiohttp.ClientTimeout(total=None),
        read_bufsize=2**20,  # SSE lines longer than aiohttp's 64 KiB default (big chunks with logprobs)
    )


async def send_request(
    session: aiohttp.ClientSession, config: BenchConfig, model: str, prompt: str, max_tokens: int, origin: float
) -> RequestRecord:
    """One streaming request; never raises for request failures, they land in the record."""
    record = RequestRecord()
    started = time.perf_counter()
    record.start_s = started - origin
    chunks_with_text = 0
    try:
        async with asyncio.timeout(config.timeout):
            async with session.post(
                endpoint_url(config), json=request_body(config, model, prompt, max_tokens)
            ) as response:
                if response.status != 200:
                    body = (await response.read()).decode(errors="replace")
                    record.error = f"HTTP {response.status}: {body[:500]}"
                else:
                    last = started
                    text_parts: list[str] = []
                    async for payload in sse_payloads(response):
                        chunk = json.loads(payload)
                        if "error" in chunk:
                            record.error = f"error chunk: {json.dumps(chunk['error'])[:500]}"
                            break
                        if chunk.get("usage"):
                            record.prompt_tokens = chunk["usage"].get("prompt_tokens")
                            record.output_tokens = chunk["usage"].get("completion_tokens") or 0
                            record.usage_reported = True
                        text = chunk_text(chunk)
                        if not text:
                            continue
                        now = time.perf_counter()
                        if record.ttft_s is None:
                            record.ttft_s = now - started
                        else:
                            record.itl_s.append(now - last)
                        last = now
                        chunks_with_text += 1
                        text_parts.append(text)
                    record.generated_text = "".join(text_parts)
                    if not record.error and record.ttft_s is None:
                        record.error = "the stream ended without any generated text"
    except TimeoutError:
        record.error = f"timed out after {config.timeout} s"
    except Exception as error:
        # Any failure (connection, protocol, a malformed chunk) is one failed request: the run goes on.
        record.error = f"{type(error).__name__}: {error}"
    record.latency_s = time.perf_counter() - started
    if not record.usage_reported:
        record.output_tokens = chunks_with_text
    record.success = not record.error
    return record


async def first_model_id(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(f"{base_url.rstrip('/')}/models", timeout=aiohttp.ClientTimeout(total=60)) as response:
        response.raise_for_status()
        models = (await response.json()).get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/models lists no model; pass --model")
    return models[0]["id"]


# ---------------------------------------------------------------------------------------------------------------
# Baselines


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
    max_concurrency), and batch 1 besides.
    """
    import torch

    from cluster.baselines import hf_generate_throughput, matmul_roofline, workload_ceiling

    show_progress = not config.disable_tqdm
    logger.info("baselines on %d prompts, %d tokens out, model %s", len(prompts), config.output_len, model_dir)
    batch = max(1, summary["max_concurrent_requests"])
    # The rooflines before HF: timed after minutes of HF generate in this process, the batch-1 step ran 24 ms
    # against 17.5 ms in a fresh process (run Y in the README), a bound below our own offline engine.
    roofline = matmul_roofline(model_dir, batch, config.roofline_iterations, show_progress=show_progress)
    roofline_batch1 = (
        roofline
        if batch == 1
        else matmul_roofline(model_dir, 1, config.roofline_iterations, show_progress=show_progress)
    )
    hf_runs = hf_generate_throughput(
        model_dir,
        prompts,
        config.output_len,
        config.hf_batch_sizes,
        chat=config.endpoint == "chat",
        show_progress=show_progress,
    )
    best = max(hf_runs, key=lambda run: run["output_tok_per_s"])
    ceiling = workload_ceiling(
        model_dir,
        best["prompt_token_counts"],
        config.output_len,
        iterations=config.roofline_iterations,
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


# ---------------------------------------------------------------------------------------------------------------
# The benchmark


async def run_benchmark(args: BenchConfig | argparse.Namespace | dict[str, Any]) -> dict[str, Any]:
    """Run the whole benchmark and return {"config", "model", "summary", per-request lists}; prints the report.

    Raises ValueError on bad settings and RuntimeError when the warm-up request fails (the endpoint is wrong or
    down). Writes the result to `output_json` when set.
    """
    from tqdm import tqdm

    config = BenchConfig.from_any(args)
    if config.endpoint not in ("completions", "chat"):
        raise ValueError(f"endpoint must be 'completions' or 'chat', got {config.endpoint!r}")
    if config.num_prompts < 1 or config.output_len < 1 or config.input_len < 0 or config.shared_prefix_words < 0:
        raise ValueError("num_prompts and output_len must be >= 1; input_len and shared_prefix_words >= 0")
    if config.max_concurrency is not None and config.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 or None, got {config.max_concurrency}")
    if config.baselines and config.roofline_iterations < 1:
        raise ValueError(f"roofline_iterations must be >= 1, got {config.roofline_iterations}")
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    prompts = synthetic_prompts(config.num_prompts, config.input_len, config.seed, config.shared_prefix_words)
    gaps = arrival_gaps(config.num_prompts, config.request_rate, config.seed)
    async with client_session(config.max_concurrency, headers) as session:
        model = config.model or await first_model_id(session, config.base_url)
        # Before any request: a missing model directory must not cost a whole benchmark run first.
        model_dir = baseline_model_dir(config.model_dir, model) if config.baselines else None
        logger.info(
            "benchmarking %s at %s: %d prompts, %d+%d words in, %d tokens out, rate %s req/s, concurrency %s",
            model,
            endpoint_url(config),
            config.num_prompts,
            config.shared_prefix_words,
            config.input_len,
            config.output_len,
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

        semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        progress = tqdm(total=config.num_prompts, disable=config.disable_tqdm, desc="requests")

        async def limited(prompt: str, origin: float) -> RequestRecord:
            async with semaphore if semaphore is not None else contextlib.nullcontext():
                record = await send_request(session, config, model, prompt, config.output_len, origin)
            progress.update(1)
            return record

        origin = time.perf_counter()
        tasks = []
        for prompt, gap in zip(prompts, gaps):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(prompt, origin)))
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - origin
        progress.close()

    summary = summarize(records, duration)
    for record in records:
        if not record.success:
            logger.warning("request failed: %s", record.error)
    if summary["completed"] and not any(record.usage_reported for record in records if record.success):
        logger.warning("the server sent no usage; output tokens are counted as text chunks")
    short = [record.output_tokens for record in records if record.success and record.output_tokens != config.output_len]
    if short:
        logger.warning(
            "%d requests generated other than %d tokens (ignore_eos unsupported?): %s",
            len(short),
            config.output_len,
            short[:10],
        )
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
