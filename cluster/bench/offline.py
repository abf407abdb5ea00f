"""The offline harness: `LLM.generate` timed in this process, no server, no HTTP.

`time_generate` is the one measurement every offline figure comes from: `pagedserve bench-offline` (ours against
HF generate, `run_offline_benchmark`), `benchmarks/offline_throughput.py` (stream counts on any device) and
`benchmarks/run_matrix.py` (the offline side of its HTTP / offline ratios).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from cluster.bench.workload import synthetic_prompts

if TYPE_CHECKING:
    from configs.sampling_params import SamplingParams
    from executor.llm import LLM

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OfflineRun:
    """One timed `LLM.generate` pass."""

    elapsed_s: float
    prompt_tokens: int
    output_tokens: int

    @property
    def output_tok_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    def as_dict(self) -> dict[str, float]:
        return {
            "elapsed_s": self.elapsed_s,
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "output_tok_per_s": self.output_tok_per_s,
        }


def time_generate(
    llm: LLM,
    prompts: Sequence[str | list[int]],
    params: SamplingParams,
    *,
    one_at_a_time: bool = False,
    repeats: int = 1,
    use_tqdm: bool = False,
) -> OfflineRun:
    """Time `llm.generate` over `prompts` (strings or token-id lists): all in one call (the engine batches them),
    or one prompt per call (a single stream). With `repeats` > 1, the run of median output rate. The caller warms
    the engine up first; CUDA work is synchronized at both ends of the timed span."""
    if not prompts or repeats < 1:
        raise ValueError(f"need prompts and repeats >= 1, got {len(prompts)} prompts and {repeats} repeats")
    runs = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        if one_at_a_time:
            outputs = [output for prompt in prompts for output in llm.generate([prompt], params, use_tqdm=False)]
        else:
            outputs = llm.generate(list(prompts), params, use_tqdm=use_tqdm)
        synchronize()
        elapsed = time.perf_counter() - start
        output_tokens = sum(len(completion.token_ids) for output in outputs for completion in output.outputs)
        prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
        runs.append(OfflineRun(elapsed, prompt_tokens, output_tokens))
    median_rate = statistics.median_low(run.output_tok_per_s for run in runs)
    return next(run for run in runs if run.output_tok_per_s == median_rate)


def synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def pagedserve_run(args: argparse.Namespace, prompts: list[str]) -> tuple[OfflineRun, str]:
    """Our `LLM` on the prompts, prefix caching off (the prompts share no prefix worth caching); returns the run and
    the dtype the engine ran in."""
    from configs.sampling_params import SamplingParams
    from executor.llm import LLM

    llm = LLM(
        model=args.model,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
    )
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    return time_generate(llm, prompts, params, use_tqdm=True), llm.engine.model_info.dtype_name


def run_offline_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """`pagedserve bench-offline`: our `LLM.generate` against HF `generate` at each static batch size, same
    prompts, same greedy `max_tokens`, HF in the dtype our engine ran in; prints the comparison and returns (and
    optionally writes) the report."""
    from cluster.bench.baselines import hf_generate_throughput
    from cluster.bench.config import parse_batch_sizes
    from model_executor.model_fetch import resolve_model

    batch_sizes = parse_batch_sizes(args.hf_batch_sizes)
    prompts = synthetic_prompts(args.num_prompts, args.prompt_words, args.seed)
    ours, dtype = pagedserve_run(args, prompts)
    logger.info("pagedserve LLM.generate (%s): %.1f output tok/s", dtype, ours.output_tok_per_s)
    report: dict[str, Any] = {
        "machine": machine_description(),
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "dtype": dtype,
        "pagedserve": ours.as_dict(),
    }
    lines = [
        f"machine: {report['machine']}",
        f"workload: {args.num_prompts} prompts of ~{args.prompt_words} words, {args.max_tokens} new tokens each",
        f"dtype: {dtype}",
        f"pagedserve LLM.generate: {ours.output_tok_per_s:8.1f} output tok/s",
    ]
    if not args.skip_hf:
        hf_runs = hf_generate_throughput(resolve_model(args.model), prompts, args.max_tokens, batch_sizes, dtype=dtype)
        best = max(hf_runs, key=lambda run: run["output_tok_per_s"])
        report["hf"] = hf_runs
        report["hf_best"] = best
        report["ratio_vs_hf_best"] = ours.output_tok_per_s / best["output_tok_per_s"]
        for run in hf_runs:
            lines.append(f"HF generate batch {run['batch_size']:>3}: {run['output_tok_per_s']:8.1f} output tok/s")
        lines.append(f"ratio vs HF best static batch: {report['ratio_vs_hf_best']:.2f}x")
    print("\n".join(lines))  # the comparison is the command's output
    if args.output_json:
        with open(args.output_json, "w") as output_file:
            json.dump(report, output_file, indent=2)
    return report
