"""What the engine hands back per request: the offline API's result type and the streaming unit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    """Per generated token a model_executor.sampler.TokenLogprobs, when the request asked for logprobs."""

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
