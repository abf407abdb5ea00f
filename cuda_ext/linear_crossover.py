"""Up to how many rows our fp32 linear kernel beats oneDNN's packed GEMM: measured once per machine, cached on disk.

The crossover is a property of the core, not of the instruction set: with the same AVX-512 build, a step of
linears at 64 rows ran 1.18x oneDNN's speed on the Intel VM (two 512-bit loads a cycle) and 0.86x on the Zen 4 VM
(one), until a load the compiler had folded into every FMA was pinned in a register (1.06x there since; 128 rows
measured). So `python -m cuda_ext.cpu_ops` (`make setup`) times a decode step's linears at a ladder of row counts
on both paths and stores the answer beside the build; a process that finds none measures it on first use (a few
seconds, under the build's lock, so concurrent workers neither measure twice nor disturb each other's timings).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

OVERRIDE_ENV = "PAGEDSERVE_LINEAR_KERNEL_MAX_ROWS"
CACHE_FILE = "linear_kernel_max_rows.json"
# SmolLM2-135M's layer matmuls ([out, in]: qkv, o, gate_up, down) x 30 layers, and its LM head: a decode step.
STEP_LINEAR_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
# Enough layers that the weights (~110 MB) stream from memory, as a real step's do, at a third of the set-up time.
CALIBRATION_SHAPES = STEP_LINEAR_SHAPES[: 4 * 8] + STEP_LINEAR_SHAPES[-1:]
CALIBRATION_ROWS = (1, 8, 16, 24, 32, 48, 64, 96, 128)
# Past the point where both paths run near the core's peak they tie within this VM's step-to-step noise (Zen 4: 1.02-
# 1.06x from 64 to 192 rows); a tie goes to our kernel.
TIE_MARGIN = 0.05
# Where nothing can be timed: our kernel won up to 8 rows on every machine measured (Zen 3 AVX2, Zen 4, Intel).
FALLBACK = 8
# oneDNN picks its blocked layout for a typical M (as model_executor.layers.linear packs it).
PACKING_BATCH_HINT = 64


def step_timer(ops: ModuleType, shapes: Sequence[tuple[int, int]], seed: int = 0) -> Callable[[int, int], dict]:
    """A function (rows, repeats) -> {"oneDNN": ms, "ours": ms}: the median of `repeats` steps of these linears on
    distinct random weights (each streams from memory, as in the model), the two paths alternated."""
    generator = torch.Generator().manual_seed(seed)
    weights = [torch.randn(rows, columns, generator=generator) for rows, columns in shapes]
    packed = [torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_BATCH_HINT) for weight in weights]
    input_sizes = sorted({columns for _, columns in shapes})

    def time_rows(num_rows: int, repeats: int) -> dict:
        inputs = {columns: torch.randn(num_rows, columns, generator=generator) for columns in input_sizes}
        outputs = [torch.empty(num_rows, weight.shape[0]) for weight in weights]

        def onednn_step() -> None:
            for weight in packed:
                torch.ops.mkldnn._linear_pointwise(inputs[weight.shape[1]], weight, None, "none", [], "")

        def our_step() -> None:
            for weight, out in zip(weights, outputs, strict=True):
                ops.linear_tokens(out, inputs[weight.shape[1]], weight)

        steps = {"oneDNN": onednn_step, "ours": our_step}
        timings: dict[str, list[float]] = {name: [] for name in steps}
        for step in steps.values():
            step()  # warm-up: oneDNN creates its primitive for this shape on first use
        for _ in range(repeats):
            for name, step in steps.items():
                start = time.perf_counter()
                step()
                timings[name].append(time.perf_counter() - start)
        return {name: sorted(values)[len(values) // 2] * 1000 for name, values in timings.items()}

    return time_rows


def loses(onednn_ms: float, ours_ms: float) -> bool:
    """Ours is slower by more than the tie margin: within it, ours (closer is step-to-step noise, and our kernel hands
    a preempted thread's claims to the other, where oneDNN's static split waits for it)."""
    return ours_ms > onednn_ms * (1 + TIE_MARGIN)


def crossover_rows(timings: Sequence[tuple[int, float, float]]) -> int:
    """The largest row count up to which our kernel lost at no count measured ((rows, oneDNN ms, ours ms), any
    order); 0 where it lost at the smallest."""
    best = 0
    for rows, onednn_ms, ours_ms in sorted(timings):
        if loses(onednn_ms, ours_ms):
            break
        best = rows
    return best


def measure_kernel_max_rows(
    ops: ModuleType,
    shapes: Sequence[tuple[int, int]] = CALIBRATION_SHAPES,
    row_counts: Sequence[int] = CALIBRATION_ROWS,
    repeats: int = 5,
) -> tuple[int, list[tuple[int, float, float]]]:
    """(the crossover, the timings behind it) on this machine at torch's current thread count."""
    time_rows = step_timer(ops, shapes)
    timings = []
    for rows in sorted(row_counts):
        result = time_rows(rows, repeats)
        timings.append((rows, result["oneDNN"], result["ours"]))
        if loses(result["oneDNN"], result["ours"]):
            break  # past the crossover: the larger counts only cost set-up time
    return crossover_rows(timings), timings


def kernel_source_hash() -> str:
    """Which kernels a cached crossover was measured with: torch rebuilds them in place when the source changes."""
    from cuda_ext.cpu_ops import SOURCE

    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


def _read_cache(path: os.PathLike) -> dict:
    """Crossovers by thread count, measured with this source of the kernels (any other's are dropped)."""
    try:
        with open(path) as file:
            cached = json.load(file)
    except (OSError, ValueError):
        return {}
    if not isinstance(cached, dict) or cached.get("kernels") != kernel_source_hash():
        return {}
    return cached


@functools.cache
def kernel_max_rows(ops: ModuleType) -> int:
    """Up to how many rows linears take our kernel in this process: `PAGEDSERVE_LINEAR_KERNEL_MAX_ROWS` if set,
    else this machine's measured crossover at torch's thread count (measured and cached on first use)."""
    override = os.environ.get(OVERRIDE_ENV)
    if override is not None:
        return max(0, int(override))
    from cuda_ext.cpu_ops import build_directory, exclusive_build

    directory = build_directory()
    cache_path = directory / CACHE_FILE
    threads = str(torch.get_num_threads())
    cached = _read_cache(cache_path).get(threads)
    if isinstance(cached, int):
        return cached
    with exclusive_build(directory):
        measured = _read_cache(cache_path)
        if isinstance(measured.get(threads), int):
            return measured[threads]
        started = time.perf_counter()
        try:
            rows, timings = measure_kernel_max_rows(ops)
        except (RuntimeError, AttributeError) as error:  # a torch build without oneDNN's packed linear
            logger.warning("could not time oneDNN here (%s): linears of up to %d rows take our kernel", error, FALLBACK)
            return FALLBACK
        measured.update({"kernels": kernel_source_hash(), threads: rows})
        try:
            cache_path.write_text(json.dumps(measured, indent=1))
        except OSError as error:  # read-only cache: measured again by the next process
            logger.warning("could not cache the linear kernel's crossover in %s: %s", cache_path, error)
    table = ", ".join(f"{r}: {ours / onednn:.2f}" for r, onednn, ours in timings)
    logger.info(
        "linear kernel up to %d rows at %s threads (ours / oneDNN step time by rows: %s; measured in %.1f s, cached "
        "in %s)",
        rows,
        threads,
        table,
        time.perf_counter() - started,
        cache_path,
    )
    return rows
