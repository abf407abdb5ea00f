"""Paged attention on CUDA: the Triton kernels against the torch backend, per step of one layer.

    python -m benchmarks.bench_attention [--dtype bfloat16] [--num-heads 32] [--num-kv-heads 8] [--head-dim 128]

For each scenario it prints the torch backend and Triton backend times (KV-cache write + attention, ms), the
speedup, the two Triton kernels alone, the attention kernel's KV read bandwidth (decode-only steps), and the
largest output difference between the backends, after the time the Triton backend takes to build a 256-request
decode step's metadata (2k contexts; host work and its copy to the GPU). Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Scenario:
    name: str
    query_lens: list[int]
    seq_lens: list[int]


SCENARIOS = [
    Scenario("decode 64 x ctx 1024", [1] * 64, [1024] * 64),
    Scenario("decode 256 x ctx 512", [1] * 256, [512] * 256),
    Scenario("decode 8 x ctx 8192", [1] * 8, [8192] * 8),
    Scenario("prefill 1 x 2048", [2048], [2048]),
    Scenario("prefill chunks 4 x 512 (+1536 cached)", [512] * 4, [2048] * 4),
    Scenario("mixed 63 decodes ctx 1024 + chunk 512", [1] * 63 + [512], [1024] * 63 + [512]),
]


def build_step(scenario: Scenario, args: argparse.Namespace, device: torch.device):
    """Random inputs for one layer's step over shuffled cache blocks."""
    from cuda_ext.attention.base import AttentionBatch

    block_size = args.block_size
    blocks_needed = [-(-seq_len // block_size) for seq_len in scenario.seq_lens]
    num_blocks = sum(blocks_needed) + 1
    permutation = (torch.randperm(num_blocks - 1) + 1).tolist()
    block_tables, slot_mapping = [], []
    for query_len, seq_len, needed in zip(scenario.query_lens, scenario.seq_lens, blocks_needed, strict=True):
        table, permutation = permutation[:needed], permutation[needed:]
        block_tables.append(table)
        slot_mapping += [
            table[p // block_size] * block_size + p % block_size for p in range(seq_len - query_len, seq_len)
        ]
    num_decodes = sum(1 for query_len in scenario.query_lens if query_len == 1)
    batch = AttentionBatch(list(scenario.query_lens), list(scenario.seq_lens), block_tables, slot_mapping, num_decodes)
    dtype = DTYPES[args.dtype]
    num_tokens = sum(scenario.query_lens)
    query = torch.randn(num_tokens, args.num_heads, args.head_dim, device=device, dtype=dtype)
    key = torch.randn(num_tokens, args.num_kv_heads, args.head_dim, device=device, dtype=dtype)
    value = torch.randn_like(key)
    kv_cache = torch.randn(2, num_blocks, block_size, args.num_kv_heads, args.head_dim, device=device, dtype=dtype)
    return batch, query, key, value, kv_cache


def bench(fn: Callable[[], object], args: argparse.Namespace) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms)


def run_scenario(scenario: Scenario, args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    from cuda_ext.attention.torch_backend import TorchAttentionBackend
    from cuda_ext.attention.triton_backend import TritonAttentionBackend
    from cuda_ext.kernels.reshape_and_cache import reshape_and_cache
    from cuda_ext.kernels.unified_attention import unified_attention

    batch, query, key, value, kv_cache = build_step(scenario, args, device)
    torch_backend = TorchAttentionBackend(args.num_heads, args.num_kv_heads, args.head_dim, args.sliding_window)
    triton_backend = TritonAttentionBackend(args.num_heads, args.num_kv_heads, args.head_dim, args.sliding_window)
    torch_metadata = torch_backend.build_metadata(batch, args.block_size, device)
    triton_metadata = triton_backend.build_metadata(batch, args.block_size, device)
    torch_cache, triton_cache = kv_cache.clone(), kv_cache.clone()
    expected = torch_backend.forward(query, key, value, torch_cache, torch_metadata)
    actual = triton_backend.forward(query, key, value, triton_cache, triton_metadata)
    output = torch.empty_like(query)

    def attention_only() -> None:
        unified_attention(
            query,
            triton_cache[0],
            triton_cache[1],
            output,
            triton_metadata.query_start_loc,
            triton_metadata.seq_lens,
            triton_metadata.block_tables,
            triton_metadata.tile_request,
            triton_metadata.tile_q_start,
            triton_metadata.num_small_tiles,
            triton_backend.tile_config,
            triton_backend.scale,
            args.sliding_window,
        )

    results = {
        "torch": bench(lambda: torch_backend.forward(query, key, value, torch_cache, torch_metadata), args),
        "triton": bench(lambda: triton_backend.forward(query, key, value, triton_cache, triton_metadata), args),
        "attention": bench(attention_only, args),
        "cache_write": bench(
            lambda: reshape_and_cache(key, value, triton_cache[0], triton_cache[1], triton_metadata.slot_mapping), args
        ),
        "max_diff": (actual.float() - expected.float()).abs().max().item(),
    }
    # Decode-only steps read each request's whole context once per KV head (keys and values): a bandwidth.
    if all(query_len == 1 for query_len in scenario.query_lens):
        kv_bytes = 2 * sum(scenario.seq_lens) * args.num_kv_heads * args.head_dim * kv_cache.element_size()
        results["kv_gb_per_s"] = kv_bytes / (results["attention"] * 1e-3) / 1e9
    return results


def large_decode_batch():
    """256 decodes of 2,048 keys each (128 blocks of 16 apiece, each request its own): the metadata build timed
    below, and checked in tests/test_triton_attention.py."""
    from cuda_ext.attention.base import AttentionBatch

    tables = [list(range(request * 128, (request + 1) * 128)) for request in range(256)]
    return AttentionBatch([1] * 256, [2048] * 256, tables, list(range(256)), num_decodes=256)


def metadata_build_ms(args: argparse.Namespace, device: torch.device, repeats: int = 5) -> float:
    """Median time of the Triton backend's metadata for large_decode_batch(), on `device`."""
    import statistics
    import time

    from cuda_ext.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend(args.num_heads, args.num_kv_heads, args.head_dim, args.sliding_window)
    batch = large_decode_batch()
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        backend.build_metadata(batch, args.block_size, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timings.append((time.perf_counter() - start) * 1e3)
    return statistics.median(timings)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--sliding-window", type=int, default=None)
    parser.add_argument("--warmup-ms", type=int, default=25)
    parser.add_argument("--rep-ms", type=int, default=100)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("CUDA not available: nothing to benchmark")
        return 0
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1 is set: unset it to benchmark compiled kernels", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    print(
        f"{torch.cuda.get_device_name(device)}, {args.dtype}, heads {args.num_heads}/{args.num_kv_heads}, "
        f"head_dim {args.head_dim}, block {args.block_size}, window {args.sliding_window}"
    )
    header = (
        f"{'scenario':<40} {'torch ms':>9} {'triton ms':>9} {'speedup':>8} {'attn ms':>8} {'write ms':>8} "
        f"{'KV GB/s':>8} {'max|diff|':>10}"
    )
    print(f"metadata build, 256 decodes x 2048 keys: {metadata_build_ms(args, device):.2f} ms")
    print(header)
    print("-" * len(header))
    for scenario in SCENARIOS:
        result = run_scenario(scenario, args, device)
        bandwidth = f"{result['kv_gb_per_s']:.0f}" if "kv_gb_per_s" in result else "-"
        print(
            f"{scenario.name:<40} {result['torch']:>9.3f} {result['triton']:>9.3f} "
            f"{result['torch'] / result['triton']:>7.2f}x {result['attention']:>8.3f} {result['cache_write']:>8.3f} "
            f"{bandwidth:>8} {result['max_diff']:>10.2e}"
        )
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
