"""What the scheduler sends the model runner each step, and what comes back: plain data only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from configs.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """Sent once when a request is first scheduled, or again when it resumes after preemption."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    grammar_key: str | None = None
    """Its structured-output constraint: a grammar the plan that introduced it shipped (StepPlan.grammars)."""
    lora_slot: int = -1
    """The adapter slot its rows use (a LoRA load of this or an earlier plan filled it); -1: the base model."""


@dataclass(slots=True)
class LoRALoad:
    """An adapter every rank loads into a slot before the step runs, each reading its own slices from `path`."""

    name: str
    slot: int
    path: str
    scaling: float


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already holds: only what changed since the last step."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    new_token_ids: list[int] = field(default_factory=list)
    """Tokens sampled since the runner last heard of the request (every rank learns them, not only the sampler)."""


@dataclass(slots=True)
class StepPlan:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    """request id -> tokens it advances this step."""
    finished_request_ids: list[str] = field(default_factory=list)
    """Requests gone for good since the last step (finished or aborted): the runner forgets them."""
    preempted_request_ids: list[str] = field(default_factory=list)
    """Requests whose blocks were taken back; they come again as new requests, keeping their seed state."""
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """request id -> drafts it verifies this step, run after its last known token (counted in its scheduled tokens)."""
    grammars: dict[str, str] = field(default_factory=dict)
    """Compiled grammars the sampling rank has not had yet: key -> serialized (xgrammar)."""
    grammar_tokenizer_info: str | None = None
    """The serialized tokenizer description grammars are loaded with: in the plan that ships the first grammar."""
    evicted_grammars: list[str] = field(default_factory=list)
    """Grammars no request uses any more, which the sampling rank forgets."""
    lora_loads: list[LoRALoad] = field(default_factory=list)
    """Adapters loaded into slots before this step's rows run (replacing what the slots held)."""
    lora_capacity: tuple[int, int] | None = None
    """(max_loras, max_lora_rank) the slots are sized for: in every plan with LoRA loads."""

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass(slots=True)
class StepResult:
    """The tokens of each request that reached the end of its known tokens this step: one sampled token, or with
    drafts, the drafts accepted and the token sampled after them."""

    request_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[Any]] = field(default_factory=list)
    """Empty when no request asked; else per request, per token a model_executor.sampler.TokenLogprobs or None."""
