"""vLLM's periodic engine stats line, logged by the scheduler actor: throughput, load, KV cache and prefix cache
(and draft acceptance with speculative decoding) over the last interval; silent while the engine is idle.

It reads counters the engine already keeps (EngineMetrics, CoreStats) from a timer, never from the step loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from executor.engine_core import EngineCore

logger = logging.getLogger(__name__)

# Seconds between two stats lines, as vLLM's VLLM_LOG_STATS_INTERVAL; the environment variable overrides it.
DEFAULT_STATS_LOG_INTERVAL_S = 10.0
STATS_LOG_INTERVAL_ENV = "PAGEDSERVE_LOG_STATS_INTERVAL"


def stats_log_interval_s() -> float:
    """The interval: $PAGEDSERVE_LOG_STATS_INTERVAL (seconds, > 0) when set, else 10 s."""
    raw = os.environ.get(STATS_LOG_INTERVAL_ENV)
    if raw is None:
        return DEFAULT_STATS_LOG_INTERVAL_S
    try:
        interval = float(raw)
    except ValueError:
        interval = 0.0
    if not interval > 0 or interval == float("inf"):
        logger.warning(
            "%s=%r is not a positive number of seconds; logging stats every %.0f s",
            STATS_LOG_INTERVAL_ENV,
            raw,
            DEFAULT_STATS_LOG_INTERVAL_S,
        )
        return DEFAULT_STATS_LOG_INTERVAL_S
    return interval


@dataclass(frozen=True, slots=True)
class Totals:
    """The engine's cumulative counts at one moment (a new core after a rebuild starts again from zero)."""

    time: float
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0


def percent(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole else 0.0


class LoggingStatLogger:
    """Logs one line per interval in which the engine ran or held requests (vLLM's LoggingStatLogger)."""

    def __init__(self, engine_index: int = 0):
        self.engine_index = engine_index
        self.core: EngineCore | None = None
        self.last = Totals(time.monotonic())

    def log(self, core: EngineCore) -> str | None:
        """Log the line for the interval since the last call and return it; None (and nothing logged) when the
        engine had nothing to do in it."""
        stats = core.stats()
        metrics = core.metrics
        now = Totals(
            time=time.monotonic(),
            prompt_tokens=metrics.total(metrics.prompt_tokens),
            generation_tokens=metrics.total(metrics.generation_tokens),
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            num_draft_tokens=stats.num_draft_tokens,
            num_accepted_draft_tokens=stats.num_accepted_draft_tokens,
        )
        # A rebuilt engine's counters start from zero: count from there.
        last = self.last if core is self.core else Totals(self.last.time)
        self.core, self.last = core, now
        prompt_tokens = now.prompt_tokens - last.prompt_tokens
        generation_tokens = now.generation_tokens - last.generation_tokens
        if not (prompt_tokens or generation_tokens or stats.num_running or stats.num_waiting):
            return None
        elapsed = max(now.time - last.time, 1e-9)
        device = "GPU" if core.model_info.device == "cuda" else "CPU"
        hit_rate = percent(
            now.prefix_cache_hits - last.prefix_cache_hits, now.prefix_cache_queries - last.prefix_cache_queries
        )
        line = (
            f"Engine {self.engine_index:03d}: Avg prompt throughput: {prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"{device} KV cache usage: {100.0 * stats.kv_cache_usage:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%"
        )
        if core.config.scheduler.speculative_config is not None:
            drafted = now.num_draft_tokens - last.num_draft_tokens
            accepted = now.num_accepted_draft_tokens - last.num_accepted_draft_tokens
            line += f", Draft acceptance rate: {percent(accepted, drafted):.1f}% ({accepted} of {drafted} drafts)"
        logger.info("%s", line)
        return line

    async def run(self, current_core: Callable[[], EngineCore | None], interval_s: float | None = None) -> None:
        """Log every interval until cancelled; `current_core` is None while the engine is down (nothing logged)."""
        interval_s = stats_log_interval_s() if interval_s is None else interval_s
        while True:
            await asyncio.sleep(interval_s)
            core = current_core()
            if core is None:
                continue
            try:
                self.log(core)
            except Exception:
                # A stats line is never worth the engine: report it and keep serving.
                logger.exception("logging the engine stats failed")
