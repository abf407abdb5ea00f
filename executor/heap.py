"""The serving processes' start-up heap, frozen out of Python's cyclic garbage collector.

A long-lived actor loads hundreds of thousands of objects once (model and tokenizer code, config, the scheduler's
and KV-block pool's state) and never frees them; every full collection rescanned them all. In the scheduler actor
that was ~330,000 objects and ~0.2 s a full collection: a stall of every stream's next token. Frozen, a collection
scans only what was allocated since (vLLM's engine core does the same).
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


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
