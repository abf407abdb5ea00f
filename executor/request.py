"""A request's state inside the engine: tokens, progress, status."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

from configs.sampling_params import SamplingParams

if TYPE_CHECKING:
    from model_executor.lora import LoRAAdapter


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in FINISH_REASONS


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence being generated (a parent with n > 1 becomes n of these)."""

    __slots__ = (
        "arrival_time",
        "block_hashes",
        "first_scheduled_time",
        "first_token_time",
        "gate_request_id",
        "grammar",
        "grammar_key",
        "last_token_time",
        "lora",
        "max_next_drafts",
        "max_tokens",
        "num_computed_tokens",
        "num_drafts_in_flight",
        "num_failed_verifies",
        "num_output_placeholders",
        "num_prompt_tokens",
        "num_tokens_sent",
        "request_id",
        "sampling_params",
        "status",
        "steps_until_drafts",
        "stop_reason",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        gate_request_id: str | None = None,
        grammar: Future | None = None,
        grammar_key: str | None = None,
        lora: LoRAAdapter | None = None,
    ):
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.arrival_time = time.monotonic()
        self.num_computed_tokens = 0  # tokens whose KV is written or being written by a step already scheduled
        # Tokens that steps in flight will sample, not known here yet (async scheduling: the running step's and the
        # one queued behind it).
        self.num_output_placeholders = 0
        # Drafts the step in flight verifies (speculative decoding); None when it runs none.
        self.num_drafts_in_flight: int | None = None
        self.max_next_drafts: int | None = None  # None: the configured num_speculative_tokens
        self.num_failed_verifies = 0  # steps in a row whose drafts were all rejected
        self.steps_until_drafts = 0  # decode steps left without drafts (back-off after failed drafts)
        self.status = RequestStatus.WAITING
        self.stop_reason: str | int | None = None
        self.block_hashes: list[int] = []  # chained hashes of this request's full blocks, grown lazily
        # Sibling of an n > 1 request: waits until this request has scheduled the shared prompt, then reuses it.
        self.gate_request_id = gate_request_id
        # Structured outputs: the compile of its grammar (it waits in the queue until it is done) and the grammar's key.
        self.grammar = grammar
        self.grammar_key = grammar_key
        # The LoRA adapter that serves it (None: the base model): its KV blocks are cached under the adapter.
        self.lora = lora
        self.num_tokens_sent = 0  # tokens the model runner already knows
        # Monotonic timestamps for the latency metrics.
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.token_ids) + self.num_output_placeholders

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def waits_for_grammar(self) -> bool:
        return self.grammar is not None and not self.grammar.done()

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
