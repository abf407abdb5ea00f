"""Our C++ CPU kernels against the pure-torch path they replace, at SmolLM2-135M's shapes, per layer of one step.

    python -m benchmarks.bench_cpu_kernels [--threads N] [--iterations 50] [--linear-rows 1,8,16,32,64,128,512]

Prints, per scenario, the torch path and the C++ path in microseconds and the speedup. Attention rows time the
whole backend call (KV write + attention) on decode batches and prefill chunks over shuffled cache blocks (the
prefill rows force our kernel past `PREFILL_KERNEL_MAX_KEYS`, to show where SDPA wins). The bf16 rows run the same
scenarios on a bf16 model's tensors and KV cache (SmolLM2's 9 heads, 3 KV heads, head 64; decode at batch 1 and 64
over 128 and 1024 tokens), against torch's own bf16 ops; their prefill rows force our kernel's bf16 path, which the
backend leaves to SDPA. A second table times a
whole step's linears (SmolLM2's 120 layer matmuls on distinct random weights, so each streams from memory as in
the model, plus the LM head) at each row count on oneDNN's packed GEMM, on our dot-product kernel
(`linear_tokens`, what the greedy screen runs) and on our panel kernel (`panel_linear`, what the engine runs).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from cuda_ext import fused_ops
from cuda_ext.attention import cpu_backend
from cuda_ext.attention.base import AttentionBatch
from cuda_ext.attention.cpu_backend import CpuAttentionBackend
from cuda_ext.attention.torch_backend import TorchAttentionBackend
from cuda_ext.cpu_ops import load_cpu_ops
from model_executor.layers.linear import PACKING_BATCH_HINT

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE, BLOCK = 9, 3, 64, 576, 1536, 16
# SmolLM2-135M's layer matmuls ([out, in]: qkv, o, gate_up, down) x 30 layers, and its LM head: a decode step.
STEP_LINEAR_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def time_us(fn: Callable[[], object], iterations: int) -> float:
    for _ in range(3):
        fn()
    timings = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        timings.append(time.perf_counter() - start)
    return sorted(timings)[len(timings) // 2] * 1e6


def decode_step(batch_size: int, context: int, dtype: torch.dtype = torch.float32):
    needed = -(-context // BLOCK)
    order = torch.randperm(batch_size * needed).tolist()
    tables = [order[i * needed : (i + 1) * needed] for i in range(batch_size)]
    slots = [table[(context - 1) // BLOCK] * BLOCK + (context - 1) % BLOCK for table in tables]
    batch = AttentionBatch([1] * batch_size, [context] * batch_size, tables, slots, batch_size)
    query = torch.randn(batch_size, HEADS, HEAD_DIM, dtype=dtype)
    key = torch.randn(batch_size, KV_HEADS, HEAD_DIM, dtype=dtype)
    kv_cache = torch.randn(2, batch_size * needed, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    return batch, query, key, key.clone(), kv_cache


def prefill_step(num_chunks: int, query_len: int, context: int, dtype: torch.dtype = torch.float32):
    """num_chunks prompts each adding query_len tokens after `context` cached ones."""
    seq_len = context + query_len
    needed = -(-seq_len // BLOCK)
    order = torch.randperm(num_chunks * needed).tolist()
    tables = [order[i * needed : (i + 1) * needed] for i in range(num_chunks)]
    slots = [table[pos // BLOCK] * BLOCK + pos % BLOCK for table in tables for pos in range(context, seq_len)]
    batch = AttentionBatch([query_len] * num_chunks, [seq_len] * num_chunks, tables, slots, 0)
    tokens = num_chunks * query_len
    query = torch.randn(tokens, HEADS, HEAD_DIM, dtype=dtype)
    key = torch.randn(tokens, KV_HEADS, HEAD_DIM, dtype=dtype)
    kv_cache = torch.randn(2, num_chunks * needed, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    return batch, query, key, key.clone(), kv_cache


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--linear-rows", default="1,8,16,32,64,128,512", help="row counts of the linear-step table")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if load_cpu_ops() is None:
        print("the C++ CPU kernels could not be built here (see the warning above)")
        return 1
    cpu = torch.device("cpu")
    reference, ours = TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM), CpuAttentionBackend(HEADS, KV_HEADS, HEAD_DIM)
    rows = [
        *attention_rows(reference, ours, cpu, args.iterations),
        *layer_op_rows(args.iterations),
        *attention_rows(reference, ours, cpu, args.iterations, torch.bfloat16),
        *layer_op_rows(args.iterations, torch.bfloat16),
    ]
    print(f"torch threads: {torch.get_num_threads()}")
    print(f"| {'op (one layer)':<36} | {'torch us':>9} | {'C++ us':>9} | speedup |")
    print(f"|{'-' * 38}|{'-' * 11}|{'-' * 11}|---------|")
    for name, torch_us, cpp_us in rows:
        print(f"| {name:<36} | {torch_us:>9.1f} | {cpp_us:>9.1f} | {torch_us / max(cpp_us, 1e-3):>6.2f}x |")
    print()
    paths = ("oneDNN", "dot", "panel")
    print(f"| {'a step of linears (121 weights)':<40} | " + " | ".join(f"{path + ' ms':>9}" for path in paths) + " |")
    print(f"|{'-' * 42}|" + "|".join("-" * 11 for _ in paths) + "|")
    for num_rows, timings in linear_step_rows([int(rows) for rows in args.linear_rows.split(",")]).items():
        label = f"{num_rows} rows ({2 * num_rows * STEP_LINEAR_PARAMS / timings['panel'] / 1e6:.0f} GFLOP/s panel)"
        print(f"| {label:<40} | " + " | ".join(f"{timings[path]:>9.1f}" for path in paths) + " |")
    return 0


STEP_LINEAR_PARAMS = sum(rows * columns for rows, columns in STEP_LINEAR_SHAPES)


def linear_step_rows(row_counts: list[int], repeats: int = 5) -> dict[int, dict[str, float]]:
    """Per row count, each path's ms for one step's linears on distinct random weights (each streams from memory,
    as in the model): the median of `repeats` steps, the paths alternated."""
    ops = load_cpu_ops()
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(rows, columns, generator=generator) for rows, columns in STEP_LINEAR_SHAPES]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_BATCH_HINT) for weight in weights]
    panels = [ops.pack_panels(weight) for weight in weights]

    def onednn_step(inputs: dict[int, torch.Tensor], outputs: list[torch.Tensor]) -> None:
        for weight in onednn:
            torch.ops.mkldnn._linear_pointwise(inputs[weight.shape[1]], weight, None, "none", [], "")

    def dot_step(inputs: dict[int, torch.Tensor], outputs: list[torch.Tensor]) -> None:
        for weight, out in zip(weights, outputs, strict=True):
            ops.linear_tokens(out, inputs[weight.shape[1]], weight)

    def panel_step(inputs: dict[int, torch.Tensor], outputs: list[torch.Tensor]) -> None:
        for weight, panel, out in zip(weights, panels, outputs, strict=True):
            ops.panel_linear(out, inputs[weight.shape[1]], panel)

    steps = {"oneDNN": onednn_step, "dot": dot_step, "panel": panel_step}
    results = {}
    for num_rows in row_counts:
        inputs = {columns: torch.randn(num_rows, columns, generator=generator) for _, columns in STEP_LINEAR_SHAPES}
        outputs = [torch.empty(num_rows, weight.shape[0]) for weight in weights]

        timings: dict[str, list[float]] = {name: [] for name in steps}
        for step in steps.values():
            step(inputs, outputs)  # warm-up: oneDNN creates its primitive for this shape on first use
        for _ in range(repeats):
            for name, step in steps.items():
                start = time.perf_counter()
                step(inputs, outputs)
                timings[name].append(time.perf_counter() - start)
        results[num_rows] = {name: sorted(values)[len(values) // 2] * 1000 for name, values in timings.items()}
    return results


# (batch, context) of the decode rows: fp32's, and the bf16 ones issue 38 names.
DECODE_SHAPES = {
    torch.float32: ((1, 128), (1, 2048), (16, 256), (64, 150), (64, 1024)),
    torch.bfloat16: ((1, 128), (1, 1024), (64, 128), (64, 1024)),
}


def dtype_label(dtype: torch.dtype) -> str:
    return "bf16 " if dtype == torch.bfloat16 else ""


def attention_rows(
    reference, ours, cpu, iterations: int, dtype: torch.dtype = torch.float32
) -> list[tuple[str, float, float]]:
    rows = []
    label = dtype_label(dtype)
    for batch_size, context in DECODE_SHAPES[dtype]:
        batch, query, key, value, kv_cache = decode_step(batch_size, context, dtype)
        reference_metadata = reference.build_metadata(batch, BLOCK, cpu)
        our_metadata = ours.build_metadata(batch, BLOCK, cpu)
        rows.append(
            (
                f"{label}decode attention {batch_size} x ctx {context}",
                time_us(partial(reference.forward, query, key, value, kv_cache, reference_metadata), iterations),
                time_us(partial(ours.forward, query, key, value, kv_cache, our_metadata), iterations),
            )
        )
    for num_chunks, query_len, context in ((8, 64, 0), (8, 64, 200), (1, 512, 256), (1, 16, 1000), (1, 128, 1000)):
        batch, query, key, value, kv_cache = prefill_step(num_chunks, query_len, context, dtype)
        reference_metadata = reference.build_metadata(batch, BLOCK, cpu)
        our_metadata = ours.build_metadata(batch, BLOCK, cpu)
        our_metadata.prefill.fits_kernel = True
        # Our kernel for every dtype it reads, bf16 included (the backend sends bf16 chunks to SDPA).
        routed_dtypes = cpu_backend.PREFILL_KERNEL_DTYPES
        cpu_backend.PREFILL_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
        try:
            rows.append(
                (
                    f"{label}prefill {num_chunks} x {query_len} after {context}",
                    time_us(partial(reference.forward, query, key, value, kv_cache, reference_metadata), iterations),
                    time_us(partial(ours.forward, query, key, value, kv_cache, our_metadata), iterations),
                )
            )
        finally:
            cpu_backend.PREFILL_KERNEL_DTYPES = routed_dtypes
    return rows


def layer_op_rows(iterations: int, dtype: torch.dtype = torch.float32) -> list[tuple[str, float, float]]:
    ops = load_cpu_ops()
    rows = []
    label = dtype_label(dtype)
    for tokens in (1, 64, 512):
        # Normalised rows and a unit weight keep the in-place op's repeated calls in range.
        x, residual = (torch.randn(tokens, HIDDEN) * 0.01).to(dtype), torch.randn(tokens, HIDDEN, dtype=dtype)
        weight = torch.ones(HIDDEN, dtype=dtype)
        rows.append(
            (
                f"{label}add + RMSNorm, {tokens} tokens",
                time_us(partial(add_then_norm, x, residual, weight), iterations),
                time_us(partial(ops.fused_add_rms_norm, x, residual, weight, 1e-5), iterations),
            )
        )
        qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype)
        query = qkv[:, : HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
        key = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
        angles = torch.rand(tokens, 1, HEAD_DIM // 2)
        cos, sin = angles.cos(), angles.sin()
        rows.append(
            (
                f"{label}rotary, {tokens} tokens",
                time_us(partial(fused_ops.rotary_reference, query, key, cos, sin, HEAD_DIM // 2), iterations),
                time_us(partial(ops.rotary_embedding, query, key, cos, sin), iterations),
            )
        )
        gate_up = torch.randn(tokens, 2 * INTERMEDIATE, dtype=dtype)
        rows.append(
            (
                f"{label}SiLU-and-mul, {tokens} tokens",
                time_us(partial(torch_silu_and_mul, gate_up), iterations),
                time_us(partial(fused_ops.silu_and_mul, gate_up), iterations),
            )
        )
    return rows


def add_then_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return fused_ops.rms_norm_reference(x + residual, weight, 1e-5)


def torch_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate_up[:, :INTERMEDIATE]) * gate_up[:, INTERMEDIATE:]


if __name__ == "__main__":
    raise SystemExit(main())
