"""The serving processes' heaps: the start-up heap frozen out of Python's cyclic garbage collector, and the model
worker's freed memory kept for its next step.

A long-lived actor loads hundreds of thousands of objects once (model and tokenizer code, config, the scheduler's
and KV-block pool's state) and never frees them; every full collection rescanned them all. In the scheduler actor
that was ~330,000 objects and ~0.2 s a full collection: a stall of every stream's next token. Frozen, a collection
scans only what was allocated since (vLLM's engine core does the same).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import platform

logger = logging.getLogger(__name__)

# glibc's mallopt parameters.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
# What a step allocates (a 512-token prefill's activations, a few MiB each) stays in the heap once freed; the
# largest threshold glibc accepts.
KEPT_ALLOCATION_BYTES = 32 << 20
# Free heap glibc may keep at its top instead of returning it to the kernel.
KEPT_FREE_HEAP_BYTES = 1 << 30


def freeze_startup_heap(process: str) -> int:
    """Collect once, then move every object alive now to the permanent generation; returns how many that is."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: %d start-up objects frozen out of the cyclic GC", process, frozen)
    return frozen


def thaw_heap() -> None:
    """Before what was frozen is replaced (an engine rebuild): its cycles become collectable again."""
    gc.unfreeze()


def keep_freed_memory(enabled: bool, single_arena: bool) -> bool:
    """Make glibc keep what a model step frees for the next step; returns whether the settings took.

    By default glibc serves allocations above a moving threshold with fresh mmaps and hands a heap's free top back
    to the kernel, so each step's activations come back as new pages, page-faulted in again every step.
    `enabled`: the config's `runtime.keep_freed_memory`. `single_arena`: the process's threads share the main heap,
    for a worker whose steps run on a thread of their own (a thread's own arena frees whole 64 MiB heaps at once,
    whatever the thresholds). Set it before that thread first allocates. glibc only.
    """
    if not enabled or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    settings = [(M_MMAP_THRESHOLD, KEPT_ALLOCATION_BYTES), (M_TRIM_THRESHOLD, KEPT_FREE_HEAP_BYTES)]
    if single_arena:
        settings.append((M_ARENA_MAX, 1))
    return all(mallopt(parameter, value) == 1 for parameter, value in settings)
