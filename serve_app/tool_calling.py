"""A chat request's tools: what the chat template sees, how tool_choice constrains the output, and which parser reads
calls from the model's text (OpenAI's semantics, vLLM's flags)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from configs.sampling_params import StructuredOutputsParams
from serve_app.protocol import ChatCompletionRequest, ChatTool, ConstraintError, NamedToolChoice, SamplingFields
from serve_app.tool_parsers import NamedToolCallParser, RequiredToolCallsParser, ToolParser, tool_parser
from serve_app.validation import RequestError

# A function without `parameters` takes an object of anything (OpenAI's reading of an omitted schema).
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True, slots=True)
class ToolCallPlan:
    """How one chat request handles tools. `parser` None: the output is plain content."""

    parser: ToolParser | None = None
    constraint: StructuredOutputsParams | None = None
    max_calls: int | None = None
    """parallel_tool_calls false: at most one call is returned."""


def requested_constraint(body: SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's own output constraint and its field; a malformed one is a 400 naming the field."""
    try:
        return body.structured_outputs_params()
    except ConstraintError as error:
        raise RequestError(400, str(error), param=error.field) from error


def template_tools(tools: list[ChatTool] | None) -> list[dict[str, Any]] | None:
    """The tool definitions as the chat template reads them (OpenAI's JSON shape)."""
    if not tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in tools]


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else ANY_OBJECT


def required_calls_schema(tools: list[ChatTool], max_calls: int | None) -> dict[str, Any]:
    """A JSON array of one or more calls, each naming a tool and giving arguments that match its parameters."""
    call_shapes = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": _parameters(tool)},
            "required": ["name", "parameters"],
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": call_shapes}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return schema


def plan_tool_calls(body: ChatCompletionRequest, parser_name: str | None, auto_tool_choice: bool) -> ToolCallPlan:
    """Check the request's tools against tool_choice and the server's flags; raises RequestError (400)."""
    tools, choice = body.tools or [], body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise RequestError(400, "tool_choice needs tools: the request names none.", param="tool_choice")
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise RequestError(400, "tools: each function name must be unique.", param="tools")
    if choice == "none":
        return ToolCallPlan()
    has_constraint = requested_constraint(body)[0] is not None
    max_calls = 1 if body.parallel_tool_calls is False else None
    if choice == "auto":
        if not (auto_tool_choice and parser_name):
            raise RequestError(
                400,
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set on the server.',
                param="tool_choice",
            )
        return ToolCallPlan(parser=tool_parser(parser_name), max_calls=max_calls)
    if has_constraint:
        raise RequestError(
            400,
            "tool_choice 'required' or a named function constrains the output itself: drop response_format.",
            param="tool_choice",
        )
    if choice == "required":
        schema = required_calls_schema(tools, max_calls)
        return ToolCallPlan(RequiredToolCallsParser(), StructuredOutputsParams(json=schema), max_calls)
    assert isinstance(choice, NamedToolChoice)
    named = next((tool for tool in tools if tool.function.name == choice.function.name), None)
    if named is None:
        raise RequestError(
            400,
            f"tool_choice names {choice.function.name!r}, which is not among the tools {names}.",
            param="tool_choice",
        )
    return ToolCallPlan(NamedToolCallParser(named.function.name), StructuredOutputsParams(json=_parameters(named)))


def template_messages(messages: list[Any], texts: list[str]) -> list[dict[str, Any]]:
    """Messages for the chat template: role and content, plus an assistant's tool calls (arguments as objects, as
    templates expect) and a tool message's tool_call_id and name."""
    conversation = []
    for index, (message, text) in enumerate(zip(messages, texts)):
        entry: dict[str, Any] = {"role": message.role, "content": text}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            calls = []
            for call in message.tool_calls:
                try:
                    arguments = json.loads(call.function.arguments)
                except ValueError as error:
                    raise RequestError(
                        400,
                        f"messages.{index}.tool_calls: arguments of {call.function.name!r} are not JSON: {error}",
                        param=f"messages.{index}.tool_calls",
                    ) from error
                function = {"name": call.function.name, "arguments": arguments}
                calls.append({"id": call.id, "type": "function", "function": function})
            entry["tool_calls"] = calls
        conversation.append(entry)
    return conversation
