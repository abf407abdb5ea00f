"""What the engine hands back per request: the offline API's result type and the streaming unit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from configs.engine_config import EngineConfig


@dataclass
class Logprob:
    """One token's log-probability at one position of a completion, as vLLM's `Logprob`."""

    logprob: float
    rank: int | None = None
    """1-based: how many tokens are at least as likely."""
    decoded_token: str | None = None


# vLLM's shape of a completion's logprobs: per generated token, token id -> Logprob (the sampled token first).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One of the n completions of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """"stop" (eos, stop token or stop string), "length" (max_tokens or context), "abort", or None while running."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the completion; None for eos or length."""
    logprobs: list[Any] | None = None
    """When the request asked for logprobs, per generated token: from `LLM`, a dict token id -> Logprob (vLLM's
    SampleLogprobs); from the engine and the server's output processor, a model_executor.sampler.TokenLogprobs."""
    cumulative_logprob: float | None = None
    """Sum of the generated tokens' logprobs when the request asked for logprobs (as vLLM: None otherwise)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class EngineInfo:
    """What an ingress needs to validate requests the way the engine will, and the config the engine runs."""

    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    engine_config: EngineConfig


@dataclass(frozen=True)
class CoreStats:
    """The scheduler's load and KV cache now, and its cumulative counts (the actor's stats and metrics read it)."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_kv_blocks: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    num_steps_planned_ahead: int
    num_requests: int


@dataclass(frozen=True)
class EngineStats(CoreStats):
    """A scheduler actor's state now: its core's stats, its lifecycle, and per-request bookkeeping (all zero when
    idle)."""

    num_steps: int
    num_rebuilds: int
    num_clients: int
    draining: bool
    rss_bytes: int
    num_tracked_requests: int
    num_undelivered_outputs: int
    num_early_aborts: int


@dataclass(frozen=True)
class EngineTopology:
    """The scheduler actor's process and its model workers' identities (rank, pid, node)."""

    engine_pid: int
    workers: list[dict[str, Any]]
    placement_group_id: str | None
