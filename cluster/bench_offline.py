"""Offline throughput: pagedserve's `LLM.generate` against HF transformers `generate`, same prompts, one run."""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import time

import torch

logger = logging.getLogger(__name__)

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "an",
    "were",
    "are",
    "which",
    "this",
    "be",
    "or",
    "had",
    "not",
    "but",
    "one",
    "all",
    "their",
    "they",
    "have",
    "has",
    "been",
    "who",
    "its",
    "when",
    "more",
    "there",
    "will",
    "would",
    "can",
    "about",
    "into",
    "out",
    "other",
    "than",
    "river",
    "city",
    "market",
    "garden",
    "winter",
    "engine",
    "letter",
    "music",
    "forest",
    "window",
    "story",
    "doctor",
    "summer",
    "bridge",
    "island",
]


def synthetic_prompts(num_prompts: int, words_per_prompt: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        "Continue this text: " + " ".join(rng.choice(WORDS) for _ in range(words_per_prompt))
        for _ in range(num_prompts)
    ]


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def bench_pagedserve(args: argparse.Namespace, prompts: list[str]) -> dict[str, float]:
    from configs.sampling_params import SamplingParams
    from executor.llm import LLM

    llm = LLM(
        model=args.model,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(completion.token_ids) for output in outputs for completion in output.outputs)
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return {
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens,
        "output_tok_per_s": output_tokens / elapsed,
    }


def bench_hf(args: argparse.Namespace, prompts: list[str], batch_size: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from model_executor.model_fetch import resolve_model

    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    output_tokens = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(prompts), batch_size):
            batch = tokenizer(prompts[first : first + batch_size], return_tensors="pt", padding=True)
            generated = model.generate(
                **batch,
                do_sample=False,
                max_new_tokens=args.max_tokens,
                min_new_tokens=args.max_tokens,
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            )
            output_tokens += (generated.shape[1] - batch["input_ids"].shape[1]) * generated.shape[0]
    elapsed = time.perf_counter() - start
    return {"batch_size": batch_size, "elapsed_s": elapsed, "output_tok_per_s": output_tokens / elapsed}


def run_offline_benchmark(args: argparse.Namespace) -> dict[str, object]:
    prompts = synthetic_prompts(args.num_prompts, args.prompt_words, args.seed)
    report: dict[str, object] = {
        "machine": machine_description(),
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "pagedserve": bench_pagedserve(args, prompts),
    }
    ours = report["pagedserve"]["output_tok_per_s"]
    logger.info("pagedserve LLM.generate: %.1f output tok/s", ours)
    if not args.skip_hf:
        hf_runs = []
        for batch_size in (int(size) for size in args.hf_batch_sizes.split(",")):
            run = bench_hf(args, prompts, batch_size)
            logger.info("HF generate batch %d: %.1f output tok/s", batch_size, run["output_tok_per_s"])
            hf_runs.append(run)
        best = max(hf_runs, key=lambda run: run["output_tok_per_s"])
        report["hf"] = hf_runs
        report["hf_best"] = best
        report["ratio_vs_hf_best"] = ours / best["output_tok_per_s"]
    lines = [
        f"machine: {report['machine']}",
        f"workload: {args.num_prompts} prompts of ~{args.prompt_words} words, {args.max_tokens} new tokens each",
        f"pagedserve LLM.generate: {ours:8.1f} output tok/s",
    ]
    if "hf_best" in report:
        for run in report["hf"]:
            lines.append(f"HF generate batch {run['batch_size']:>3}: {run['output_tok_per_s']:8.1f} output tok/s")
        lines.append(f"ratio vs HF best static batch: {report['ratio_vs_hf_best']:.2f}x")
    print("\n".join(lines))
    if args.output_json:
        with open(args.output_json, "w") as output_file:
            json.dump(report, output_file, indent=2)
    return report
