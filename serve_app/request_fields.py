"""Every request field of chat completions and completions, honoured or refused: nothing is silently ignored.

Each field OpenAI's request schemas define, and each vLLM extension, is listed in `CHAT_FIELDS` or
`COMPLETION_FIELDS`. A refused field set to a value the server does not honour is a 400 naming it; keys in neither
table keep vLLM's behaviour: accepted, and logged once per field name per process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from serve_app.validation import RequestError

logger = logging.getLogger(__name__)

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def same_json_value(value: Any, accepted: Any) -> bool:
    """JSON equality: `false` is not `0`, `1` is `1.0`, lists compare item by item."""
    if isinstance(value, bool) or isinstance(accepted, bool):
        return value is accepted
    if isinstance(value, list) and isinstance(accepted, list):
        return len(value) == len(accepted) and all(map(same_json_value, value, accepted))
    if isinstance(value, (int, float)) and isinstance(accepted, (int, float)):
        return value == accepted
    return type(value) is type(accepted) and value == accepted


@dataclass(frozen=True, slots=True)
class FieldRule:
    """How the server treats one request field: honoured (`refused_because` is None), or refused unless its value
    is null, one of `accepted`, or passes `accepted_if` (for values that depend on the rest of the request)."""

    refused_because: str | None = None
    accepted: tuple[Any, ...] = ()
    accepted_if: Callable[[Any, Mapping[str, Any]], bool] | None = None
    accepted_if_text: str = ""
    # For honoured fields whose shape is checked here: the error message, or None when the value is fine.
    shape_error: Callable[[Any], str | None] | None = None

    @property
    def honoured(self) -> bool:
        return self.refused_because is None

    def error_for(self, field: str, value: Any, payload: Mapping[str, Any]) -> str | None:
        """The 400's message for this value of the field, or None when the server takes it."""
        if value is None:
            return None
        if self.honoured:
            return self.shape_error(value) if self.shape_error else None
        if any(same_json_value(value, accepted) for accepted in self.accepted):
            return None
        if self.accepted_if is not None and self.accepted_if(value, payload):
            return None
        return f"{field} is not supported by this server: {self.refused_because}."

    def accepted_markdown(self) -> str:
        """The values this field is accepted with, for the README table."""
        values = ["`null`", *(f"`{json_text(value)}`" for value in self.accepted)]
        if self.accepted_if_text:
            values.append(self.accepted_if_text)
        return ", ".join(values)


def json_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(json_text(item) for item in value) + "]"
    return str(value)


HONOURED = FieldRule()


def refused(reason: str, *accepted: Any) -> FieldRule:
    """A field refused unless null or one of `accepted` (the values that ask for nothing we lack)."""
    return FieldRule(refused_because=reason, accepted=accepted)


def metadata_shape_error(value: Any) -> str | None:
    """OpenAI's metadata: at most 16 string keys (64 characters) to string values (512 characters)."""
    well_formed = (
        isinstance(value, dict)
        and len(value) <= MAX_METADATA_PAIRS
        and all(
            isinstance(key, str)
            and isinstance(item, str)
            and len(key) <= MAX_METADATA_KEY_CHARS
            and len(item) <= MAX_METADATA_VALUE_CHARS
            for key, item in value.items()
        )
    )
    if well_formed:
        return None
    return (
        f"metadata must be an object of at most {MAX_METADATA_PAIRS} string keys (up to {MAX_METADATA_KEY_CHARS} "
        f"characters) to string values (up to {MAX_METADATA_VALUE_CHARS} characters)."
    )


def best_of_matches_n(value: Any, payload: Mapping[str, Any]) -> bool:
    """best_of equal to n (or 1) asks for no server-side ranking: the n choices are all returned."""
    n = payload.get("n")
    n = 1 if n is None else n
    return type(value) is int and (value == 1 or (type(n) is int and value == n))


CHAT_TEMPLATE_REASON = "the model's own chat template renders prompts"
NO_REASONING_PARSER = "no reasoning parser runs here; reasoning text, if the model writes any, stays in content"

# Fields both endpoints honour (OpenAI's and vLLM's names for knobs the server implements).
SHARED_HONOURED = {
    name: HONOURED
    for name in (
        "model",
        "n",
        "stream",
        "stream_options",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "user",
        "response_format",
        "top_k",
        "min_p",
        "repetition_penalty",
        "stop_token_ids",
        "ignore_eos",
        "min_tokens",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    )
}

# vLLM extensions both endpoints refuse; a value equal to vLLM's default asks for nothing and is accepted.
SHARED_REFUSED = {
    "prompt_logprobs": refused("prompt token logprobs are not computed"),
    "use_beam_search": refused("beam search is not implemented; use n with sampling", False),
    "length_penalty": refused("it only applies to beam search, which is not implemented", 1),
    "bad_words": refused("banned words are not implemented; use logit_bias on their token ids"),
    "allowed_token_ids": refused("token allow-lists are not implemented; use logit_bias or structured_outputs"),
    "logits_processors": refused("custom logits processors are not loaded"),
    "truncate_prompt_tokens": refused("prompts are never truncated; shorten the prompt"),
    "return_tokens_as_token_ids": refused("logprob tokens are always returned as text", False),
    "spaces_between_special_tokens": refused("special tokens are decoded as the tokenizer joins them", True),
    "priority": refused("requests are scheduled first come, first served", 0),
    "guided_decoding_backend": refused("the structured-output backend is chosen by the server"),
    "guided_whitespace_pattern": refused("the JSON grammar's whitespace is fixed by the server"),
    "structural_tag": refused("structural tags are not implemented; use structured_outputs"),
    "request_id": refused("the server names requests; send the X-Request-Id header to tag one"),
    "cache_salt": refused("the prefix cache is shared and cannot be salted"),
    "kv_transfer_params": refused("KV cache transfer between servers is not implemented"),
    "vllm_xargs": refused("no extra engine arguments are read"),
    "return_token_ids": refused("token ids are not returned; use /tokenize", False),
}

CHAT_FIELDS: dict[str, FieldRule] = {
    **SHARED_HONOURED,
    **SHARED_REFUSED,
    **{
        name: HONOURED
        for name in (
            "messages",
            "max_completion_tokens",
            "top_logprobs",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "add_generation_prompt",
            "continue_final_message",
            "safety_identifier",
        )
    },
    "metadata": FieldRule(shape_error=metadata_shape_error),
    "store": refused("completions are not stored", False),
    "service_tier": refused('requests are served in one tier; send "auto" or "default"', "auto", "default"),
    "modalities": refused("only text is generated, not audio", ["text"]),
    "audio": refused("only text is generated, not audio"),
    "prediction": refused("predicted outputs are not implemented"),
    "web_search_options": refused("there is no web search"),
    "functions": refused("it is deprecated; use tools and tool_choice"),
    "function_call": refused("it is deprecated; use tools and tool_choice"),
    "reasoning_effort": refused(NO_REASONING_PARSER),
    "verbosity": refused("output length is set with max_completion_tokens, not a verbosity level"),
    "prompt_cache_key": refused("prefix caching is automatic here"),
    "prompt_cache_options": refused("prefix caching is automatic here"),
    "prompt_cache_retention": refused("prefix caching is automatic here"),
    "moderation": refused("no moderation runs here"),
    "echo": refused("echoing the prompt is only served by /v1/completions", False),
    "add_special_tokens": refused("the chat template already places the model's special tokens", False),
    "chat_template": refused(CHAT_TEMPLATE_REASON),
    "chat_template_kwargs": refused(CHAT_TEMPLATE_REASON),
    "documents": refused(f"{CHAT_TEMPLATE_REASON}; put the documents' text in messages"),
    "mm_processor_kwargs": refused("only text inputs are served"),
    "thinking": refused(NO_REASONING_PARSER),
    "include_reasoning": refused(NO_REASONING_PARSER, True),
}

COMPLETION_FIELDS: dict[str, FieldRule] = {
    **SHARED_HONOURED,
    **SHARED_REFUSED,
    "prompt": HONOURED,
    "echo": HONOURED,
    "add_special_tokens": HONOURED,
    "suffix": refused("fill-in-the-middle is not implemented; put the text in the prompt"),
    "best_of": FieldRule(
        refused_because="server-side ranking of candidates is not implemented; request n choices and pick among them",
        accepted_if=best_of_matches_n,
        accepted_if_text="`1`, or equal to `n`",
    ),
    "prompt_embeds": refused("prompt embeddings are not accepted; send text or token ids"),
}

FIELD_TABLES: dict[str, dict[str, FieldRule]] = {"chat": CHAT_FIELDS, "completions": COMPLETION_FIELDS}

_logged_unknown_fields: set[str] = set()
_logged_unknown_fields_lock = threading.Lock()


def log_unknown_field_once(field: str) -> None:
    with _logged_unknown_fields_lock:
        if field in _logged_unknown_fields:
            return
        _logged_unknown_fields.add(field)
    logger.warning("request field %r is not part of the API and was ignored", field)


def check_request_fields(payload: dict[str, Any], endpoint: Literal["chat", "completions"]) -> None:
    """Raises RequestError(400, message, param=<field>) for the first refused field set to a value the server does
    not honour; logs unknown keys once. Called on the raw JSON dict before pydantic validation."""
    if not isinstance(payload, dict):
        # Not an object: the request model's validation answers with its own 400.
        return
    table = FIELD_TABLES[endpoint]
    for field, value in payload.items():
        rule = table.get(field)
        if rule is None:
            log_unknown_field_once(field)
            continue
        message = rule.error_for(field, value, payload)
        if message is not None:
            raise RequestError(400, message, param=field)


def refused_fields_markdown() -> str:
    """The README table of refused fields, generated from the field tables so the docs cannot drift."""
    # One row per field and rule: a rule shared by both endpoints is one row naming both.
    rows: dict[tuple[str, int], tuple[FieldRule, list[str]]] = {}
    for endpoint, table in FIELD_TABLES.items():
        for field, rule in table.items():
            if not rule.honoured:
                rows.setdefault((field, id(rule)), (rule, []))[1].append(endpoint)
    lines = ["| Field | Endpoints | Accepted values | Otherwise a 400, because |", "| --- | --- | --- | --- |"]
    for (field, _), (rule, endpoints) in sorted(rows.items(), key=lambda row: (row[0][0], row[1][1])):
        lines.append(f"| `{field}` | {', '.join(endpoints)} | {rule.accepted_markdown()} | {rule.refused_because} |")
    return "\n".join(lines) + "\n"
