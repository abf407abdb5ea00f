"""Batched LoRA on CPU: the torch path of `cuda_ext.lora_ops` against a naive per-row loop, per layer call.

    python -m benchmarks.bench_lora [--threads 2] [--iterations 20] [--rows 1,16,64,512,2048] [--slots 4] [--rank 16]

Shapes are SmolLM2-135M's: o_proj (576 -> 576, one slice) and qkv_proj (576 -> 576 + 192 + 192, three slices).
Rows are spread over the slots at random, a quarter of them with no adapter. Prints microseconds per call for
each path and the speedup, and with CUDA present also the Triton kernels on the GPU.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable

import torch

from cuda_ext.lora_ops import LoraRowGroups, add_lora_sliced

logger = logging.getLogger(__name__)

HIDDEN = 576
# (name, slice widths) of the projections timed
PROJECTIONS = [("o_proj", [576]), ("qkv_proj", [576, 192, 192])]


def time_us(fn: Callable[[], object], iterations: int, synchronize: Callable[[], object] = lambda: None) -> float:
    for _ in range(3):
        fn()
    synchronize()
    timings = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        synchronize()
        timings.append(time.perf_counter() - start)
    return sorted(timings)[len(timings) // 2] * 1e6


def naive_per_row(out, x, lora_a_slices, lora_b_slices, row_slots, scalings, offsets) -> None:
    """The obvious loop: every adapted row does its own two matrix-vector products per slice."""
    for row, slot in enumerate(row_slots.tolist()):
        if slot < 0:
            continue
        for lora_a, lora_b, offset in zip(lora_a_slices, lora_b_slices, offsets, strict=True):
            low_rank = (lora_a[slot] @ x[row]) * scalings[slot]
            out[row, offset : offset + lora_b.shape[1]] += lora_b[slot] @ low_rank


def make_case(num_rows: int, num_slots: int, rank: int, widths: list[int], dtype: torch.dtype, device: str):
    generator = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, HIDDEN, generator=generator).to(device, dtype)
    out = torch.randn(num_rows, sum(widths), generator=generator).to(device, dtype)
    lora_a_slices = [
        (torch.randn(num_slots, rank, HIDDEN, generator=generator) * 0.05).to(device, dtype) for _ in widths
    ]
    lora_b_slices = [
        (torch.randn(num_slots, width, rank, generator=generator) * 0.05).to(device, dtype) for width in widths
    ]
    row_slots = torch.randint(0, num_slots, (num_rows,), generator=generator)
    row_slots[torch.rand(num_rows, generator=generator) < 0.25] = -1
    offsets = [sum(widths[:index]) for index in range(len(widths))]
    scalings = torch.full((num_slots,), 2.0, device=device)
    return out, x, lora_a_slices, lora_b_slices, row_slots.to(device), scalings, offsets


def cpu_row(name: str, widths: list[int], num_rows: int, args: argparse.Namespace) -> None:
    dtype = getattr(torch, args.dtype)
    out, x, lora_a, lora_b, row_slots, scalings, offsets = make_case(
        num_rows, args.slots, args.rank, widths, dtype, "cpu"
    )
    # Grouping is built once per step and shared by every layer: it is not part of a layer call.
    groups = LoraRowGroups(row_slots, args.slots)
    naive = time_us(lambda: naive_per_row(out, x, lora_a, lora_b, row_slots, scalings, offsets), args.iterations)
    ours = time_us(lambda: add_lora_sliced(out, x, lora_a, lora_b, groups, scalings, offsets), args.iterations)
    logger.info("%-9s %6d %12.1f %12.1f %7.1fx", name, num_rows, naive, ours, naive / ours)


def cuda_row(name: str, widths: list[int], num_rows: int, args: argparse.Namespace) -> None:
    out, x, lora_a, lora_b, row_slots, scalings, offsets = make_case(
        num_rows, args.slots, args.rank, widths, torch.bfloat16, "cuda"
    )
    groups = LoraRowGroups(row_slots, args.slots)
    timings = [
        time_us(
            lambda use_triton=use_triton: add_lora_sliced(
                out, x, lora_a, lora_b, groups, scalings, offsets, use_triton=use_triton
            ),
            args.iterations,
            torch.cuda.synchronize,
        )
        for use_triton in (False, True)
    ]
    logger.info("%-9s %6d %12.1f %12.1f %7.1fx", name, num_rows, timings[0], timings[1], timings[0] / timings[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--rows", default="1,16,64,512,2048")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="CPU dtype")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    row_counts = [int(value) for value in args.rows.split(",")]
    logger.info("CPU, %s, %d threads", args.dtype, args.threads)
    logger.info("%-9s %6s %12s %12s %8s", "layer", "rows", "naive us", "lora_ops us", "speedup")
    for name, widths in PROJECTIONS:
        for num_rows in row_counts:
            cpu_row(name, widths, num_rows, args)
    if torch.cuda.is_available():
        logger.info("CUDA (%s), bfloat16: the grouped torch path vs the Triton kernels", torch.cuda.get_device_name())
        logger.info("%-9s %6s %12s %12s %8s", "layer", "rows", "torch us", "triton us", "speedup")
        for name, widths in PROJECTIONS:
            for num_rows in row_counts:
                cuda_row(name, widths, num_rows, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
