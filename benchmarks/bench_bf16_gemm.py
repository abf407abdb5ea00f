"""bf16 linears on CPU: our AMX tile kernel (where the CPU has AMX) and bf16 panel kernel against oneDNN's packed
bf16 GEMM, and our fp32 panel kernel.

    python -m benchmarks.bench_bf16_gemm [--threads 2] [--tokens 1,8,64,256] [--rounds 7] [--layers 30]

SmolLM2-135M's per-projection shapes ([out, in]: q and o 576x576, k and v 192x576, gate and up 1536x576, down
576x1536) on `--layers` layers of distinct random weights, so each weight streams from memory as in a decode step.
A round runs every path once over all layers' weights, in a rotated order (the machine is shared: alternated
rounds see the same background load); per shape and path it prints the time of one call (min / median / max over
the rounds), GFLOP/s and weight GB/s at the median, and our bf16 kernels' speedup over oneDNN's.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable

import torch

from cuda_ext.cpu_ops import load_cpu_ops
from model_executor.layers.linear import PACKING_BATCH_HINT

logger = logging.getLogger(__name__)

# SmolLM2-135M's projections per layer: (name, [out, in]); q/o, k/v and gate/up share a shape.
LAYER_SHAPES = [
    ("q", (576, 576)),
    ("k", (192, 576)),
    ("v", (192, 576)),
    ("o", (576, 576)),
    ("gate", (1536, 576)),
    ("up", (1536, 576)),
    ("down", (576, 1536)),
]
PATHS = ("ours AMX", "ours bf16", "oneDNN bf16", "ours fp32")
# Bytes per weight element each path streams.
WEIGHT_BYTES = {"ours AMX": 2, "ours bf16": 2, "oneDNN bf16": 2, "ours fp32": 4}


def paths_of(ops) -> tuple[str, ...]:
    """The paths this build and CPU run (our AMX kernel only where the tiles are there)."""
    has_amx = getattr(ops, "has_amx", False) and ops.amx_usable()
    return tuple(path for path in PATHS if path != "ours AMX" or has_amx)


Call = Callable[[], object]


def build_calls(ops, num_layers: int, num_tokens: int, generator: torch.Generator) -> dict[str, list[tuple]]:
    """Per path, one (shape, call) per projection of every layer, each on its own weight."""
    paths = paths_of(ops)
    calls: dict[str, list[tuple]] = {path: [] for path in paths}
    inputs = {
        columns: torch.randn(num_tokens, columns, generator=generator) for columns in {s[1] for _, s in LAYER_SHAPES}
    }
    inputs_bf16 = {columns: x.bfloat16() for columns, x in inputs.items()}
    for _ in range(num_layers):
        for _, (rows, columns) in LAYER_SHAPES:
            weight = torch.randn(rows, columns, generator=generator) / columns**0.5
            weight_bf16 = weight.bfloat16()
            panels_bf16 = ops.pack_bf16_panels(weight_bf16)
            packed_onednn = torch.ops.mkldnn._reorder_linear_weight(weight_bf16, PACKING_BATCH_HINT)
            panels_fp32 = ops.pack_panels(weight)
            out_bf16 = torch.empty(num_tokens, rows, dtype=torch.bfloat16)
            out_fp32 = torch.empty(num_tokens, rows)
            x, x_bf16 = inputs[columns], inputs_bf16[columns]
            shape = (rows, columns)
            if "ours AMX" in paths:
                amx_weight = ops.pack_amx_weight(weight_bf16)
                calls["ours AMX"].append((shape, lambda o=out_bf16, x=x_bf16, p=amx_weight: ops.amx_linear(o, x, p)))
            calls["ours bf16"].append(
                (shape, lambda o=out_bf16, x=x_bf16, p=panels_bf16: ops.bf16_panel_linear(o, x, p))
            )
            calls["oneDNN bf16"].append(
                (
                    shape,
                    lambda x=x_bf16, w=packed_onednn: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                )
            )
            calls["ours fp32"].append((shape, lambda o=out_fp32, x=x, p=panels_fp32: ops.panel_linear(o, x, p)))
    return calls


def run_round(calls: list[tuple], timings: dict[tuple[int, int], list[float]]) -> None:
    """Every call once, in layer order; each shape's mean seconds per call appended to its list."""
    totals: dict[tuple[int, int], list[float]] = {}
    for shape, call in calls:
        start = time.perf_counter()
        call()
        totals.setdefault(shape, []).append(time.perf_counter() - start)
    for shape, seconds in totals.items():
        timings.setdefault(shape, []).append(sum(seconds) / len(seconds))


def measure(ops, num_layers: int, num_tokens: int, rounds: int) -> dict[str, dict[tuple[int, int], list[float]]]:
    generator = torch.Generator().manual_seed(num_tokens)
    calls = build_calls(ops, num_layers, num_tokens, generator)
    for path_calls in calls.values():  # warm-up: oneDNN builds its primitive per shape on first use
        run_round(path_calls, {})
    paths = tuple(calls)
    timings: dict[str, dict[tuple[int, int], list[float]]] = {path: {} for path in paths}
    for round_index in range(rounds):
        order = paths[round_index % len(paths) :] + paths[: round_index % len(paths)]
        for path in order:
            run_round(calls[path], timings[path])
    return timings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--tokens", default="1,8,64,256", help="token counts (rows of x)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=30, help="layers of distinct weights (30: SmolLM2's)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = load_cpu_ops()
    if ops is None or not getattr(ops, "has_bf16_panels", False):
        logger.error("our bf16 panel kernel is not built here (no C++ kernels, or no AVX512-BF16 on this CPU)")
        return 1
    print(f"torch threads: {torch.get_num_threads()}, {args.layers} layers of weights, {args.rounds} rounds")
    print("| tokens | shape | path | us min / median / max | GFLOP/s | weight GB/s | ours vs oneDNN |")
    print("|---|---|---|---|---|---|---|")
    for num_tokens in (int(count) for count in args.tokens.split(",")):
        timings = measure(ops, args.layers, num_tokens, args.rounds)
        for shape in dict.fromkeys(shape for _, shape in LAYER_SHAPES):
            rows, columns = shape
            medians = {path: statistics.median(timings[path][shape]) for path in timings}
            for path in timings:
                seconds = timings[path][shape]
                median = medians[path]
                ratio = medians["oneDNN bf16"] / median if path in ("ours AMX", "ours bf16") else None
                print(
                    f"| {num_tokens} | {rows}x{columns} | {path} | {min(seconds) * 1e6:.1f} / {median * 1e6:.1f} / "
                    f"{max(seconds) * 1e6:.1f} | {2 * num_tokens * rows * columns / median / 1e9:.0f} | "
                    f"{WEIGHT_BYTES[path] * rows * columns / median / 1e9:.1f} | "
                    + (f"{ratio:.2f}x" if ratio is not None else "")
                    + " |"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
