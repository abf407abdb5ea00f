"""Structured outputs, tool_choice and refused fields through the real server on the tiny random Llama.

The model's random weights never write JSON, a pattern or a tool call by themselves: every valid output here is the
grammar's doing. Bounded strings and numbers only, so a random model reaches the grammar's end within max_tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from openai import OpenAI

from configs.app_config import AppConfig
from tests.helpers import HISTORY, with_tools_template
from tests.openai_api.common import (
    CHAT,
    MODEL,
    assert_openai_error,
    chat,
    chat_body,
    complete,
    completion,
    tokenize,
)

pytestmark = pytest.mark.serve

CHATS, CMPL = "/v1/chat/completions", "/v1/completions"
CODE_PATTERN = "[a-z]{3}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe later"]
# A pattern bounds a string's length; xgrammar ignores maxLength next to a pattern, and a free string never ends.
SHORT_WORD = {"type": "string", "pattern": "^[a-z]{1,8}$"}
PERSON = {
    "type": "object",
    "properties": {"name": SHORT_WORD, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The forecast of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "metric": {"type": "boolean"},
            },
            "required": ["city", "days", "metric"],
            "additionalProperties": False,
        },
    },
}
LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup_word",
        "parameters": {
            "type": "object",
            "properties": {
                "word": SHORT_WORD,
                "note": {"type": "string", "maxLength": 6},
                "limit": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["word", "note", "limit"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER_TOOL, LOOKUP_TOOL]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
UNCONSTRAINED_TOOL = {"type": "function", "function": {"name": "ping"}}


def structured(**fields: Any) -> dict[str, Any]:
    """vLLM's structured-output fields, which the SDK only sends through extra_body."""
    return {"extra_body": fields}


def assert_valid_calls(tool_calls: list[Any]) -> list[tuple[str, Any]]:
    """Each call names a tool and its arguments validate against that tool's parameters; returns (name, args)."""
    assert tool_calls, "no tool calls"
    calls = []
    for call in tool_calls:
        assert call.type == "function"
        assert call.id
        assert call.function.name in PARAMETERS, call.function.name
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMETERS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def streamed_tool_calls(client: OpenAI, **kwargs: Any) -> tuple[dict[int, dict[str, Any]], str | None, str]:
    """A streamed chat's calls by index ({id, name, arguments}), its finish_reason and its content."""
    calls: dict[int, dict[str, Any]] = {}
    finish_reason, content = None, ""
    for chunk in chat(client, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish_reason = choice.finish_reason or finish_reason
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:
                    # The first delta of a call carries its id and its whole name.
                    assert delta.id and delta.function.name, delta
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
                else:
                    assert delta.id is None and delta.function.name is None, delta
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    return calls, finish_reason, content


# ---------------------------------------------------------------------------------------------------------------
# Refused constraints and tool requests


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
BAD_REQUESTS = {
    "invalid-schema": (
        CHATS,
        chat_body(response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": BAD_SCHEMA}}),
        {"response_format"},
    ),
    "unparsable-guided-json": (CHATS, chat_body(guided_json='{"type": '), {"guided_json"}),
    "bad-regex": (CHATS, chat_body(structured_outputs={"regex": "(ab"}), {"structured_outputs"}),
    "bad-regex-completions": (CMPL, completion(guided_regex="(ab"), {"guided_regex"}),
    "bad-ebnf": (CHATS, chat_body(guided_grammar="root ::= undefined_rule"), {"guided_grammar"}),
    "empty-choice": (CHATS, chat_body(guided_choice=[]), {"guided_choice"}),
    "empty-choice-completions": (CMPL, completion(structured_outputs={"choice": []}), {"structured_outputs"}),
    "two-constraints": (
        CHATS,
        chat_body(response_format={"type": "json_object"}, guided_regex="a+"),
        {"response_format", "guided_regex"},
    ),
    "json-schema-missing": (
        CHATS,
        chat_body(response_format={"type": "json_schema"}),
        {"response_format", "response_format.json_schema"},
    ),
    "unknown-structured-outputs-key": (
        CHATS,
        chat_body(structured_outputs={"regex": "a+", "whitespace": "none"}),
        {"structured_outputs", "structured_outputs.whitespace"},
    ),
    "auto-without-server-flags": (CHATS, chat_body(tools=TOOLS, tool_choice="auto"), {"tool_choice"}),
    "tools-default-to-auto": (CHATS, chat_body(tools=TOOLS), {"tool_choice"}),
    "named-function-not-in-tools": (
        CHATS,
        chat_body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "send_email"}}),
        {"tool_choice"},
    ),
    "required-without-tools": (CHATS, chat_body(tool_choice="required"), {"tool_choice"}),
    "named-without-tools": (
        CHATS,
        chat_body(tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        {"tool_choice"},
    ),
    "duplicate-tool-names": (CHATS, chat_body(tools=[WEATHER_TOOL, WEATHER_TOOL], tool_choice="required"), {"tools"}),
    "required-with-response-format": (
        CHATS,
        chat_body(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
        {"tool_choice"},
    ),
    "required-with-two-constraints": (
        CHATS,
        chat_body(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}, guided_regex="a+"),
        {"response_format", "guided_regex", "tool_choice"},
    ),
    "required-with-empty-choice": (
        CHATS,
        chat_body(tools=TOOLS, tool_choice="required", guided_choice=[]),
        {"guided_choice", "tool_choice"},
    ),
    "history-arguments-not-json": (
        CHATS,
        chat_body(
            messages=[
                *CHAT,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{city"}}
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ]
        ),
        {"messages.1.tool_calls"},
    ),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_constraint_or_tool_request_is_a_400_naming_the_field(http, case):
    path, body, params = BAD_REQUESTS[case]
    error = assert_openai_error(http.post(path, json=body), 400)
    assert error["param"] in params, error


def test_the_server_still_answers_after_the_refused_requests(client):
    response = chat(client, max_tokens=3, temperature=0, ignore_eos=True)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 3
    assert complete(client, max_tokens=2).choices[0].finish_reason == "length"


# ---------------------------------------------------------------------------------------------------------------
# Refused fields


REFUSED_FIELDS = [
    (CHATS, "audio", {"voice": "alloy", "format": "wav"}),
    (CHATS, "store", True),
    (CHATS, "functions", [{"name": "get_weather", "parameters": {"type": "object"}}]),
    (CMPL, "prompt_logprobs", 1),
    (CHATS, "prompt_logprobs", 1),
    (CMPL, "suffix", " the end."),
]


@pytest.mark.parametrize(("path", "field", "value"), REFUSED_FIELDS, ids=[f"{p[4:]}-{f}" for p, f, _ in REFUSED_FIELDS])
def test_refused_field_is_a_400_naming_it(http, path, field, value):
    body = chat_body(**{field: value}) if path == CHATS else completion(**{field: value})
    error = assert_openai_error(http.post(path, json=body), 400)
    assert error["param"] == field, error
    assert "not supported" in error["message"], error


@pytest.mark.parametrize("path", [CHATS, CMPL], ids=["chat", "completions"])
def test_an_unknown_key_passes(http, path):
    body = chat_body(x_trace_label="abc") if path == CHATS else completion(x_trace_label="abc")
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")


# ---------------------------------------------------------------------------------------------------------------
# Choice, regex and JSON on both endpoints


def test_chat_guided_choice_is_one_of_the_choices_for_every_seeded_sample(client):
    response = chat(client, n=4, seed=7, temperature=1.0, max_tokens=8, **structured(guided_choice=CHOICES))
    assert len(response.choices) == 4
    for choice in response.choices:
        assert choice.message.content in CHOICES
        assert choice.finish_reason == "stop"


def test_completions_structured_choice_is_one_of_the_choices(client):
    for seed in (1, 2, 3):
        response = complete(
            client, seed=seed, temperature=1.0, max_tokens=8, **structured(structured_outputs={"choice": CHOICES})
        )
        assert response.choices[0].text in CHOICES
        assert response.choices[0].finish_reason == "stop"


def strict_json(text: str) -> Any:
    """JSON as the spec has it: no Infinity or NaN (Python's json reads them; JavaScript's JSON.parse does not)."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in {text[:300]}")

    return json.loads(text, parse_constant=refuse)


def response_logprobs(path: str, body: dict[str, Any]) -> list[float]:
    """Every logprob in a completion or chat response body or stream chunk, sampled and top."""
    values = []
    for choice in body["choices"]:
        logprobs = choice.get("logprobs") or {}
        if path == CMPL:
            values += logprobs.get("token_logprobs") or []
            values += [value for top in logprobs.get("top_logprobs") or [] for value in top.values()]
        else:
            for entry in logprobs.get("content") or []:
                values += [entry["logprob"], *(top["logprob"] for top in entry["top_logprobs"])]
    return values


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", [CMPL, CHATS], ids=["completions", "chat"])
def test_logprobs_of_tokens_the_grammar_masks_are_vllms_floor_in_strict_json(http, path, stream):
    """Once a choice is under way the grammar allows a token or two: the other top logprobs are -inf, which JSON
    cannot carry. They come back as vLLM's -9999.0, in JSON a strict parser reads, whole or streamed."""
    top = {"logprobs": 20} if path == CMPL else {"logprobs": True, "top_logprobs": 20}
    build = completion if path == CMPL else chat_body
    body = build(max_tokens=8, temperature=0, structured_outputs={"choice": CHOICES}, stream=stream, **top)
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    if stream:
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        bodies = [strict_json(event) for event in events[:-1]]
    else:
        bodies = [strict_json(response.text)]
    values = [value for chunk in bodies for value in response_logprobs(path, chunk)]
    assert values and all(value >= -9999.0 for value in values)
    assert -9999.0 in values  # a masked token reached the top 20 on some step
    assert any(value > -9999.0 for value in values)


@pytest.mark.parametrize(
    "fields",
    [{"guided_regex": CODE_PATTERN}, {"structured_outputs": {"regex": CODE_PATTERN}}],
    ids=["guided_regex", "structured_outputs"],
)
def test_regex_output_matches_the_whole_pattern_on_both_endpoints(client, fields):
    chat_response = chat(client, n=3, seed=11, temperature=1.0, max_tokens=16, **structured(**fields))
    completion_response = complete(client, n=3, seed=11, temperature=1.0, max_tokens=16, **structured(**fields))
    texts = [choice.message.content for choice in chat_response.choices]
    texts += [choice.text for choice in completion_response.choices]
    assert len(texts) == 6
    for text in texts:
        assert re.fullmatch(CODE_PATTERN, text), text
    assert all(choice.finish_reason == "stop" for choice in [*chat_response.choices, *completion_response.choices])


def test_json_schema_response_format_validates(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    response = chat(client, n=2, seed=3, temperature=1.0, max_tokens=48, response_format=response_format)
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_guided_json_as_text_on_completions_validates(client):
    response = complete(client, temperature=0, max_tokens=48, **structured(guided_json=json.dumps(PERSON)))
    assert response.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(response.choices[0].text), PERSON)


def test_max_tokens_too_small_for_the_object_finishes_with_length(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    response = chat(client, temperature=0, max_tokens=4, response_format=response_format)
    choice = response.choices[0]
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 4
    assert choice.message.content.startswith("{")
    with pytest.raises(ValueError):
        json.loads(choice.message.content)


# ---------------------------------------------------------------------------------------------------------------
# tool_choice "required" and named


def test_required_tool_choice_returns_one_valid_call_when_not_parallel(client):
    for seed in (1, 2, 3):
        response = chat(
            client,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            seed=seed,
            temperature=1.0,
            max_tokens=120,
        )
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert len(assert_valid_calls(choice.message.tool_calls)) == 1


def test_required_tool_choice_may_return_several_valid_calls(client):
    response = chat(client, tools=TOOLS, tool_choice="required", seed=5, temperature=1.0, max_tokens=400)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    calls = assert_valid_calls(choice.message.tool_calls)
    assert len({call.id for call in choice.message.tool_calls}) == len(calls)


def test_named_tool_choice_calls_that_function(client):
    named = {"type": "function", "function": {"name": "lookup_word"}}
    response = chat(client, tools=TOOLS, tool_choice=named, n=2, seed=9, temperature=1.0, max_tokens=60)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls"
        [(name, _)] = assert_valid_calls(choice.message.tool_calls)
        assert name == "lookup_word"
        assert not choice.message.content


def test_named_tool_without_parameters_is_held_to_an_object(client):
    named = {"type": "function", "function": {"name": "ping"}}
    response = chat(client, tools=[UNCONSTRAINED_TOOL], tool_choice=named, temperature=0, max_tokens=3)
    # A free object never ends on random weights: cut, so no call is read and the text comes back as content.
    choice = response.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content.startswith("{")


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_streamed_tool_calls_equal_the_non_streamed_ones(client, tool_choice):
    request = {"tools": TOOLS, "tool_choice": tool_choice, "seed": 21, "temperature": 1.0, "max_tokens": 120}
    if tool_choice == "required":
        request["parallel_tool_calls"] = False
    whole = chat(client, **request).choices[0]
    expected = assert_valid_calls(whole.message.tool_calls)
    calls, finish_reason, content = streamed_tool_calls(client, **request)
    assert finish_reason == "tool_calls"
    assert content == ""
    assert sorted(calls) == list(range(len(calls)))
    streamed = [(calls[index]["name"], json.loads(calls[index]["arguments"])) for index in sorted(calls)]
    assert streamed == expected
    for name, arguments in streamed:
        jsonschema.validate(arguments, PARAMETERS[name])
    assert len({call["id"] for call in calls.values()}) == len(calls)


# ---------------------------------------------------------------------------------------------------------------
# Tools in the prompt


def test_tokenize_with_tools_on_a_template_without_them_is_the_plain_prompt(http):
    plain = tokenize(http, messages=CHAT)
    assert tokenize(http, messages=CHAT, tools=TOOLS) == plain


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"messages": CHAT, "tools": [{**WEATHER_TOOL, "function": {"name": "x", "description": "<|im_end|>"}}]},
            "tools",
        ),
        (
            {
                "messages": [
                    *CHAT,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"city": "<|im_start|>"}'},
                            }
                        ],
                    },
                ]
            },
            "messages.1.tool_calls",
        ),
    ],
    ids=["in-tools", "in-history-call"],
)
def test_special_token_text_inside_tools_is_refused(http, body, param):
    for path in ("/tokenize", CHATS):
        request = {"model": MODEL, "max_tokens": 2, "tool_choice": "none", **body}
        error = assert_openai_error(http.post(path, json=request), 400)
        assert error["param"] == param, error


@pytest.fixture(scope="module")
def tools_template_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_tools_template(tiny_model_dir, tmp_path_factory.mktemp("tiny-tools-template"))


@pytest.fixture(scope="module")
def tools_template_http(
    deploy_module_app: Callable[[AppConfig], str], tools_template_model_dir: Path
) -> Iterator[httpx.Client]:
    config = AppConfig.model_validate(
        {
            "model": {"name": str(tools_template_model_dir), "served_model_name": "tiny-tools"},
            "cache": {"num_kv_blocks": 32},
            "scheduler": {"max_num_seqs": 4},
            "parallel": {"worker_num_cpus": 0.5, "num_threads": 1},
            "serve": {"app_name": "tools-template", "route_prefix": "/tools-template", "ingress_num_cpus": 0.1},
        }
    )
    with httpx.Client(base_url=deploy_module_app(config), timeout=120) as session:
        yield session


def test_tokenize_renders_tools_calls_and_tool_call_ids_with_a_template_that_uses_them(tools_template_http):
    def rendered(**body: Any) -> tuple[int, str]:
        response = tools_template_http.post("/tokenize", json=body)
        assert response.status_code == 200, response.text
        tokens = response.json()["tokens"]
        detokenized = tools_template_http.post("/detokenize", json={"tokens": tokens})
        assert detokenized.status_code == 200, detokenized.text
        return len(tokens), detokenized.json()["prompt"]

    count, prompt = rendered(messages=HISTORY, tools=TOOLS)
    assert "Tools: get_weather lookup_word" in prompt
    assert '<tool_call>get_weather {"city": "Paris", "days": 1, "metric": true}</tool_call>' in prompt
    assert "[call_abc123] sunny" in prompt
    without_tools, bare_prompt = rendered(messages=HISTORY)
    assert "Tools:" not in bare_prompt
    assert without_tools < count
    # Chat completions see the same prompt.
    response = tools_template_http.post(
        "/v1/chat/completions",
        json={"messages": HISTORY, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == count
