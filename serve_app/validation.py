"""Checks a request passes before anything reaches an engine: the body as strict JSON, the request model, the
model name, the prompt's length."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from configs.sampling_params import SamplingParams
from serve_app.http_guard import HttpGuard

# Only a JSON text with a \uD800-\uDFFF escape can hold a lone surrogate once strictly decoded as UTF-8.
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
SAMPLING_FIELDS = frozenset(field.name for field in dataclasses.fields(SamplingParams))


class RequestError(Exception):
    """A client error: becomes an OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, error_type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.error_type, self.param = status, message, error_type, param


def parameter_named_in(message: str) -> str | None:
    """The request parameter an engine error message starts with, for the error's `param`."""
    first_word = message.split(" ", 1)[0]
    return first_word if first_word in SAMPLING_FIELDS else None


def validate_payload(model: type[BaseModel], payload: Any) -> Any:
    """A JSON object -> the request model, or a 400 naming the first bad field (never pydantic's 422). Chat and
    completions bodies first go through the table of fields we honour or refuse (serve_app.request_fields)."""
    if not isinstance(payload, dict):
        raise RequestError(400, "request body must be a JSON object")
    endpoint = getattr(model, "endpoint", None)
    if endpoint is not None:
        from serve_app.request_fields import check_request_fields  # it imports this module

        check_request_fields(payload, endpoint)
    try:
        return model.model_validate(payload)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        raise RequestError(400, f"{param}: {first['msg']}", param=param) from error


def lone_surrogate_path(payload: Any) -> str | None:
    """Where the first string (key or value) with a lone UTF-16 surrogate is: no tokenizer can encode one."""
    stack: list[tuple[str, Any]] = [("", payload)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                stack += [(f"{path}.{key}" if path else str(key), key), (f"{path}.{key}" if path else str(key), item)]
        elif isinstance(value, list):
            stack += [(f"{path}.{index}" if path else str(index), item) for index, item in enumerate(value)]
    return None


async def parse_body(request: Request, model: type[BaseModel], guard: HttpGuard) -> Any:
    """The HTTP body as the request model: strict UTF-8, JSON, no lone surrogates, the model's own checks."""
    raw = await guard.read_json_body(request)
    try:
        # JSON between systems is UTF-8 (RFC 8259); strict decoding also refuses UTF-8-encoded surrogates.
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise RequestError(400, f"request body is not valid UTF-8: {error}") from error
    try:
        payload = json.loads(text)
    except (ValueError, RecursionError) as error:
        # ValueError also covers integers past Python's digit limit; RecursionError, nesting past the parser's.
        raise RequestError(400, f"request body is not valid JSON: {error}") from error
    if SURROGATE_ESCAPE.search(text):
        path = lone_surrogate_path(payload)
        if path is not None:
            raise RequestError(400, f"{path}: a string holds a lone UTF-16 surrogate escape.", param=path)
    return validate_payload(model, payload)


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise RequestError(404, f"The model `{requested}` does not exist.", "NotFoundError", "model")


@dataclass(frozen=True, slots=True)
class PromptLengthLimit:
    """Characters past which a prompt cannot fit the context whatever it says, so it is refused untokenized.

    With byte-level vocabularies and no normalizer a token covers at most as many characters as its vocabulary
    string is long; for other tokenizers there is no such bound (`max_chars` is None) and every prompt is tokenized.
    """

    max_model_len: int
    max_chars: int | None

    @classmethod
    def of(cls, tokenizer: Any, max_model_len: int) -> PromptLengthLimit:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or backend.normalizer is not None:
            return cls(max_model_len, None)
        return cls(max_model_len, max_model_len * max(len(token) for token in tokenizer.get_vocab()))

    def check(self, num_chars: int, param: str) -> None:
        if self.max_chars is not None and num_chars > self.max_chars:
            raise RequestError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, your request has "
                f"{num_chars} characters, more than {self.max_model_len} tokens can hold. Please reduce the length "
                "of the input.",
                param=param,
            )
