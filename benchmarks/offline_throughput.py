"""Offline `LLM` throughput at several stream counts, on any device.

    python -m benchmarks.offline_throughput [--model smollm2-135m-instruct | DIR | --random-weights]
        [--device cuda] [--dtype bfloat16] [--streams 1,64,256] [--input-len 48] [--output-len 128]
        [--kv-cache-memory-gib 1.0] [--roofline]

Each count runs every stream's prompt of random tokens at once through `LLM.generate` (greedy, ignore_eos) after a
warm-up, and logs output tokens/s; one stream is the median of three runs. `--random-weights` builds a model of
SmolLM2-135M's shapes with random weights and the default model's tokenizer (for machines the weights cannot be
copied to): the same work per token, not the same tokens. `--compare-torch-elementwise` also times the torch
compositions in place of our Triton elementwise kernels (CUDA only), alternated twice in this process.
`--roofline` also measures the device's memory read bandwidth right before and after the runs and prints one
stream's rate against the weight-bandwidth roofline: bandwidth / the bytes of weights a decode step reads.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from cluster.bench.offline import synchronize, time_generate
from cluster.bench.workload import random_token_prompts

# Not __name__: run with `python -m`, that is "__main__".
logger = logging.getLogger("offline_throughput")

SMOLLM2_SHAPE = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
    "max_position_embeddings": 8192,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
}


def random_smollm2_shaped(directory: Path) -> Path:
    """SmolLM2-135M's config with seed-0 random weights and the default model's tokenizer files."""
    from configs.engine_config import DEFAULT_MODEL
    from model_executor.model_fetch import fetch_model
    from model_executor.tiny_model import write_tiny_llama

    return write_tiny_llama(directory, fetch_model(DEFAULT_MODEL), **SMOLLM2_SHAPE)


def measure(llm: Any, prompts: dict[int, list[list[int]]], output_len: int) -> dict[int, float]:
    """stream count -> output tok/s of its prompts all at once; one stream is the median of three runs."""
    from configs.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(next(iter(prompts.values()))[:4], params, use_tqdm=False)  # warm-up
    return {
        streams: time_generate(llm, stream_prompts, params, repeats=3 if streams == 1 else 1).output_tok_per_s
        for streams, stream_prompts in prompts.items()
    }


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter once (a tied LM head is the embedding), less the
    input embedding where the LM head is its own matrix (a step reads one embedding row per token)."""
    parameters = {param.data_ptr(): param for param in model.parameters()}
    total = sum(param.numel() * param.element_size() for param in parameters.values())
    embedding = getattr(model, "embed_tokens", None)  # our families' input embedding (absent on later PP stages)
    lm_head = getattr(model, "lm_head", None)
    if embedding is not None and getattr(lm_head, "weight", None) is not embedding.weight:
        total -= embedding.weight.numel() * embedding.weight.element_size()
    return total


def read_bandwidth_gb_per_s(device: torch.device, gib: float = 1.0, repeats: int = 5) -> float:
    """The best of a few full reads (a sum) of a `gib` GiB tensor on `device`, with the engine's thread count."""
    data = torch.ones(int(gib * 2**30) // 4, device=device)
    rates = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        data.sum()
        synchronize()
        rates.append(data.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return max(rates)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="alias or model directory")
    parser.add_argument("--random-weights", action="store_true", help="SmolLM2-135M shapes, random weights")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--streams", default="1,64,256", help="comma-separated stream counts")
    parser.add_argument("--input-len", type=int, default=48, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per stream")
    parser.add_argument("--kv-cache-memory-gib", type=float, default=1.0, help="the engine's KV-cache budget")
    parser.add_argument("--compare-torch-elementwise", action="store_true")
    parser.add_argument("--roofline", action="store_true", help="one stream against weight bytes / read bandwidth")
    args = parser.parse_args(argv)
    if args.compare_torch_elementwise and (args.device == "cpu" or not torch.cuda.is_available()):
        parser.error("--compare-torch-elementwise needs CUDA: the Triton elementwise kernels run on CUDA tensors only")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from cuda_ext import fused_ops
    from executor import LLM

    model = args.model
    if args.random_weights:
        model = str(random_smollm2_shaped(Path(tempfile.mkdtemp(prefix="smollm2-shaped-"))))
    counts = [int(count) for count in args.streams.split(",")]
    prompts = random_token_prompts(counts, args.input_len)
    triton_elementwise = fused_ops._triton_ops
    variants = ["ours", "torch elementwise"] * 2 if args.compare_torch_elementwise else ["ours"]
    for variant in variants:
        # Set before the engine captures its decode graphs, which record whichever kernels run.
        fused_ops._triton_ops = triton_elementwise if variant == "ours" else (lambda tensor: None)
        llm = LLM(
            model=model,
            device=args.device,
            dtype=args.dtype,
            show_progress=False,
            max_num_seqs=max(counts),
            max_num_batched_tokens=max(512, args.input_len * max(counts)),
            kv_cache_memory_gib=args.kv_cache_memory_gib,
        )
        runner = llm.engine.core.executor.worker.runner
        bandwidth_before = read_bandwidth_gb_per_s(runner.device) if args.roofline else None
        figures = measure(llm, prompts, args.output_len)
        logger.info(
            "%s on %s (%s): %s",
            variant,
            runner.device.type,
            str(runner.model_info.dtype).removeprefix("torch."),
            ", ".join(f"{count} streams {rate:.1f} tok/s" for count, rate in figures.items()),
        )
        if bandwidth_before is not None:
            bandwidth = (bandwidth_before + read_bandwidth_gb_per_s(runner.device)) / 2
            weight_bytes = decode_weight_bytes(runner.model)
            roofline = bandwidth * 1e9 / weight_bytes
            logger.info(
                "weight-bandwidth roofline: %.1f MB of weights per step at %.1f GB/s (read before %.1f, after: mean)"
                " = %.1f tok/s; one stream %s",
                weight_bytes / 1e6,
                bandwidth,
                bandwidth_before,
                roofline,
                f"{figures[1] / roofline:.2f}x of it" if 1 in figures else "not run (--streams without 1)",
            )
        del llm, runner
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    fused_ops._triton_ops = triton_elementwise
    return 0


if __name__ == "__main__":
    sys.exit(main())
