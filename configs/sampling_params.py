"""Per-request sampling parameters: the shared vocabulary of the ingress, the scheduler and the sampler."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

# Below this temperature a request is sampled greedily (argmax), as in vLLM.
GREEDY_TEMPERATURE_EPS = 1e-5


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output's text (vLLM's names): exactly one of these is set.

    The grammar engine checks the constraint itself (`model_executor.structured_output.check_structured_outputs`).
    """

    json: str | dict[str, Any] | None = None
    """A JSON schema (as a dict or its JSON text) the output must validate against."""
    regex: str | None = None
    """A regular expression the whole output must match."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF (GBNF-style) grammar whose `root` rule the output must derive."""
    json_object: bool | None = None
    """The output is any JSON object (OpenAI's response_format json_object)."""
    disable_any_whitespace: bool = True
    """JSON without free whitespace between tokens (compact separators): small models otherwise loop on newlines."""

    def __post_init__(self) -> None:
        kinds = self.kinds
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object; got "
                f"{', '.join(kinds) if kinds else 'none'}."
            )
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or its JSON text).")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_outputs.regex must be a string.")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("structured_outputs.grammar must be a string.")
        if self.choice is not None and (
            not isinstance(self.choice, list | tuple)
            or not self.choice
            or not all(isinstance(option, str) and option for option in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings.")

    @property
    def kinds(self) -> list[str]:
        """The constraints set (valid params have exactly one)."""
        named = {"json": self.json, "regex": self.regex, "choice": self.choice, "grammar": self.grammar}
        kinds = [name for name, value in named.items() if value is not None]
        return [*kinds, "json_object"] if self.json_object else kinds

    @property
    def kind(self) -> str:
        return self.kinds[0]

    @property
    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar: equal keys share one compilation."""
        value = {"json": self.json, "regex": self.regex, "choice": self.choice, "grammar": self.grammar}.get(self.kind)
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        return self.kind, text or "", self.disable_any_whitespace


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops.

    Every check here is independent of the model; checks against the vocabulary and the context length
    happen when the engine admits the request.
    """

    n: int = 1
    """Number of completions to sample for the prompt; they share the prompt's KV blocks."""
    temperature: float = 1.0
    """0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability mass reaches top_p, in (0, 1]."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's probability, in [0, 1]."""
    seed: int | None = None
    """Per-request seed: the same seed and parameters give the same tokens."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already in the output, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit per occurrence in the output, in [-2, 2]."""
    repetition_penalty: float = 1.0
    """CTRL-style penalty on tokens in the prompt or output (> 1 discourages repetition), in (0, 2]."""
    logit_bias: dict[int, float] | None = None
    """Token id -> bias added to its logit, each in [-100, 100]."""
    max_tokens: int | None = 16
    """Maximum number of generated tokens; None means up to the model's context length."""
    min_tokens: int = 0
    """EOS and stop_token_ids are suppressed until this many tokens are generated."""
    stop: list[str] = field(default_factory=list)
    """Strings that end the completion; the matched string is dropped unless include_stop_str_in_output."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end the completion (kept in the output token ids)."""
    ignore_eos: bool = False
    """Keep generating past the model's end-of-sequence token."""
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    logprobs: int | None = None
    """Return the sampled token's logprob plus this many top alternatives per position (0 up to the engine's
    model.max_logprobs, which `verify_max_logprobs` checks)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (compiled by the sampling worker)."""
    lora_name: str | None = None
    """The loaded LoRA adapter that serves the request (the server sets it from `model`); None: the base model."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    def _verify(self) -> None:
        def fail(name: str, rule: str, value: object) -> None:
            raise ValueError(f"{name} must be {rule}, got {value!r}.")

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", "an integer >= 1", self.n)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                fail(name, "a finite number", getattr(self, name))
        if self.temperature < 0:
            fail("temperature", "non-negative", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "in (0, 1]", self.top_p)
        if not isinstance(self.top_k, int) or self.top_k < 0:
            fail("top_k", "0 or -1 (disabled) or a positive integer", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "in [0, 1]", self.min_p)
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", "in [-2, 2]", self.presence_penalty)
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        if not 0.0 < self.repetition_penalty <= 2.0:
            fail("repetition_penalty", "in (0, 2]", self.repetition_penalty)
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail("max_tokens", "an integer >= 1", self.max_tokens)
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            fail("stop", "a list of non-empty strings", self.stop)
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "a list of non-negative token ids", self.stop_token_ids)
        if self.lora_name is not None and (not isinstance(self.lora_name, str) or not self.lora_name):
            fail("lora_name", "a non-empty string or None", self.lora_name)
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            fail("logprobs", "an integer >= 0", self.logprobs)
        # torch generators take seeds in [-2**63, 2**64 - 1]; completion i of n uses seed + i.
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed <= 2**64 - self.n):
            fail("seed", f"an integer in [-2**63, 2**64 - n] (n = {self.n})", self.seed)
        for token_id, bias in (self.logit_bias or {}).items():
            if not isinstance(token_id, int) or token_id < 0:
                fail("logit_bias", "keyed by non-negative token ids", token_id)
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                fail("logit_bias", "values in [-100, 100]", bias)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def verify_max_logprobs(self, max_logprobs: int, param: str = "logprobs") -> None:
        """Reject more logprobs than the engine's model.max_logprobs allows (`param`: the request's name for them)."""
        if self.logprobs is not None and self.logprobs > max_logprobs:
            raise ValueError(f"{param} must be at most {max_logprobs} (model.max_logprobs), got {self.logprobs}.")

    def verify_against_vocab(self, vocab_size: int) -> None:
        """Reject token ids the model does not have (logit_bias keys, stop_token_ids)."""
        for token_id in self.logit_bias or {}:
            if token_id >= vocab_size:
                raise ValueError(f"logit_bias token id {token_id} is out of the vocabulary (size {vocab_size}).")
        for token_id in self.stop_token_ids:
            if token_id >= vocab_size:
                raise ValueError(f"stop_token_ids entry {token_id} is out of the vocabulary (size {vocab_size}).")
