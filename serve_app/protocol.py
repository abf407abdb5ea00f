"""OpenAI request and response bodies (pydantic), and the mapping of a request to SamplingParams.

Every JSON body and SSE chunk the server sends is one of the response models here, dumped with `model_dump_json()`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from configs.sampling_params import SamplingParams, StructuredOutputsParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class OpenAIBaseModel(BaseModel):
    # Unknown fields are accepted (vLLM does the same); request_fields refuses the known ones we do not honour and
    # logs the others once. NaN is not a number.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class ConstraintError(ValueError):
    """A request's output constraint is malformed: `field` is the request field that holds it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class JsonSchemaFormat(OpenAIBaseModel):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's `structured_outputs` request field: exactly one constraint."""

    model_config = ConfigDict(extra="forbid")
    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True


class SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's extras)."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    # Which table of serve_app.request_fields applies to the raw body.
    endpoint: ClassVar[str]

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The output constraint the request asks for, and the field that asked (for errors). Raises
        ConstraintError when more than one asks, or the one that asks is malformed."""
        asked: list[tuple[str, dict[str, Any]]] = []
        response_format = self.response_format
        if response_format is not None and response_format.type == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif response_format is not None and response_format.type == "json_schema":
            if response_format.json_schema is None:
                raise ConstraintError(
                    "response_format", "response_format.json_schema is required when type is json_schema."
                )
            asked.append(("response_format", {"json": response_format.json_schema.json_schema}))
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            asked.append(("structured_outputs", fields))
        for name, key in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            if getattr(self, name) is not None:
                asked.append((name, {key: getattr(self, name)}))
        if not asked:
            return None, None
        if len(asked) > 1:
            names = " and ".join(name for name, _ in asked)
            raise ConstraintError(asked[0][0], f"{asked[0][0]}: give one output constraint, not {names}.")
        field, fields = asked[0]
        try:
            return StructuredOutputsParams(**fields), field
        except ValueError as error:
            raise ConstraintError(field, f"{field}: {error}") from error

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        defaults: Mapping[str, Any] | None = None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """Raises ValueError naming the parameter when a value is out of range. `defaults`: the model's
        generation_config.json values for the sampling fields the request omits or sets to null (as vLLM does);
        `max_tokens` comes resolved (see `explicit_max_tokens`); `structured_outputs` too (checked by the caller)."""
        defaults = defaults or {}

        def pick(name: str, fallback: float) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        logit_bias = None
        if self.logit_bias:
            try:
                logit_bias = {int(token): float(bias) for token, bias in self.logit_bias.items()}
            except ValueError as error:
                raise ValueError("logit_bias keys must be token ids (integers as strings).") from error
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", 1.0),
            logit_bias=logit_bias,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs,
            structured_outputs=structured_outputs,
        )


class CompletionRequest(SamplingFields):
    endpoint: ClassVar[str] = "completions"
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None

    def explicit_max_tokens(self) -> int | None:
        """The max_tokens the client sent; None when it left it out (OpenAI's 16 applies) or sent null."""
        return self.max_tokens if "max_tokens" in self.model_fields_set else None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str


class MessageToolCall(OpenAIBaseModel):
    """A tool call of an earlier assistant message in the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    endpoint: ClassVar[str] = "chat"
    messages: list[ChatMessage]
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def explicit_max_tokens(self) -> int | None:
        """The client's limit: max_completion_tokens (OpenAI's current name) before the deprecated max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = True


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """vLLM's /v1/load_lora_adapter body; `base_model_name` picks the model when the app serves several."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    # vLLM's id of the adapter; the name identifies it here.
    lora_int_id: int | None = None


# Responses. Field order is the JSON key order; a None field is sent as null unless its model says otherwise.


class ResponseModel(BaseModel):
    # Built by the server, never from client input: extra fields are a bug; a logprob may be -inf.
    model_config = ConfigDict(extra="forbid")


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class StreamChunk(ResponseModel):
    """A stream chunk: its `usage` is left out of every chunk but the last one of a stream that asked for it."""

    @model_serializer(mode="wrap")
    def _omit_missing_usage(self, handler: Any) -> dict[str, Any]:
        fields = handler(self)
        if fields.get("usage") is None:
            fields.pop("usage", None)
        return fields


class CompletionLogprobs(ResponseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ChatTokenLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprobEntry(ChatTokenLogprob):
    top_logprobs: list[ChatTokenLogprob]


class ChatLogprobs(ResponseModel):
    content: list[ChatLogprobEntry]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionStreamResponse(StreamChunk):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ToolCallFunction(ResponseModel):
    name: str
    arguments: str


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(ResponseModel):
    """`tool_calls` is sent only when the model called tools (then `content` may be null)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _omit_no_tool_calls(self, handler: Any) -> dict[str, Any]:
        fields = handler(self)
        if not fields.get("tool_calls"):
            fields.pop("tool_calls", None)
        return fields


class ChatCompletionChoice(ResponseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage


class DeltaFunction(ResponseModel):
    """A piece of a streamed call: the name once, in the call's first delta; then pieces of the arguments."""

    name: str | None = None
    arguments: str | None = None

    @model_serializer
    def _set_fields_only(self) -> dict[str, str]:
        pairs = (("name", self.name), ("arguments", self.arguments))
        return {name: value for name, value in pairs if value is not None}


class DeltaToolCall(ResponseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler: Any) -> dict[str, Any]:
        return {name: value for name, value in handler(self).items() if value is not None}


class DeltaMessage(ResponseModel):
    """What a chat stream chunk adds to the message: only the fields it sets are sent (`{}` on the last one)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler: Any) -> dict[str, Any]:
        return {name: value for name, value in handler(self).items() if value is not None}


class ChatCompletionStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(StreamChunk):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Usage | None = None


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(ResponseModel):
    """OpenAI's error shape."""

    error: ErrorInfo


def error_body(message: str, error_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    return ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=param, code=code)).model_dump()


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedserve"
    # vLLM's: where the weights come from, and the base model of a LoRA adapter (null for a base model).
    root: str | None = None
    parent: str | None = None
    max_model_len: int


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(ResponseModel):
    prompt: str


class VersionResponse(ResponseModel):
    version: str
