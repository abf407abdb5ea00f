"""Structured outputs and tool calling end to end: SmolLM2 behind Ray Serve with n-gram drafts and the hermes tool
parser, answering in JSON schemas through the `openai` SDK; and a tiny random Llama at TP=2 with drafts and the
llama3_json parser, whose constrained greedy text equals the offline single-rank engine's."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from configs.app_config import AppConfig
from configs.sampling_params import SamplingParams, StructuredOutputsParams
from tests.helpers import assert_engine_drained

pytestmark = [pytest.mark.serve, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
SPECULATIVE = {"num_speculative_tokens": 3, "disable_by_batch_size": None}
SMOL_APP = AppConfig.model_validate(
    {
        "cache": {"num_kv_blocks": 512},
        "scheduler": {"max_num_seqs": 32, "speculative_config": SPECULATIVE},
        "parallel": {"worker_num_cpus": 1},
        "serve": {
            "app_name": "smol-structured",
            "route_prefix": "/smol-structured",
            "ingress_num_cpus": 0.1,
            "tool_call_parser": "hermes",
            "enable_auto_tool_choice": True,
        },
    }
)
TINY_MODEL = "tiny-llama3-json"
TINY_APP = AppConfig.model_validate(
    {
        "model": {"name": "tiny-random-llama", "served_model_name": TINY_MODEL},
        "cache": {"num_kv_blocks": 128},
        "scheduler": {"max_num_seqs": 8, "speculative_config": SPECULATIVE},
        "parallel": {"tensor_parallel_size": 2, "worker_num_cpus": 0.5, "num_threads": 1},
        "serve": {
            "app_name": "tiny-llama3-json",
            "route_prefix": "/tiny-llama3-json",
            "ingress_num_cpus": 0.1,
            "tool_call_parser": "llama3_json",
            "enable_auto_tool_choice": True,
        },
    }
)
REQUEST_TIMEOUT_S = 300


def obj(required: list[str] | None = None, **properties: Any) -> dict[str, Any]:
    """A closed object schema; every property required unless `required` says which."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


def text(max_length: int = 30) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length}


def integer(minimum: int, maximum: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def array(items: dict[str, Any], min_items: int, max_items: int) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


ADDRESS = obj(street=text(40), city=text(25))
# (what to ask, the schema of the answer): nested objects, bounded arrays, enums, ranges, booleans, numbers, optional
# fields, anyOf, $defs/$ref, patterns, arrays of objects.
SCHEMA_REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("Describe a fictional person.", obj(name=text(), age=integer(0, 120))),
    (
        "Tell me about Paris.",
        obj(name=text(), country=text(), population=integer(0, 40_000_000), is_capital={"type": "boolean"}),
    ),
    (
        "Recommend a classic novel.",
        obj(
            title=text(50),
            author=text(40),
            year=integer(1400, 2025),
            genres=array({"enum": ["fiction", "history", "science", "poetry", "mystery"]}, 1, 3),
        ),
    ),
    ("Give me a point in the plane.", obj(x={"type": "number"}, y={"type": "number"})),
    (
        "Write an online shop order for a customer.",
        obj(
            id=integer(1, 9999),
            customer=obj(name=text(), email={"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"}),
            items=array(obj(product=text(20), quantity=integer(1, 10)), 1, 3),
        ),
    ),
    ("How do you feel today?", obj(mood={"enum": ["happy", "sad", "angry", "calm"]})),
    ("Describe a cat.", obj(["name"], name=text(), nickname=text(), age=integer(0, 30))),
    (
        "Give me a way to contact a shop.",
        obj(
            contact={
                "anyOf": [
                    obj(email={"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"}),
                    obj(phone={"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}),
                ]
            }
        ),
    ),
    (
        "Where does a person live and work?",
        {
            "$defs": {"address": ADDRESS},
            **obj(home={"$ref": "#/$defs/address"}, work={"$ref": "#/$defs/address"}),
        },
    ),
    (
        "Book a flight.",
        obj(
            code={"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            date={"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
        ),
    ),
    ("List three fruits.", array(text(20), 3, 3)),
    (
        "What is the weather like this weekend?",
        obj(is_raining={"type": "boolean"}, is_weekend={"type": "boolean"}, temperature_c=integer(-30, 50)),
    ),
    (
        "Give the forecast for London.",
        obj(
            city={"enum": ["London", "Paris", "Berlin"]},
            forecast=array(
                obj(day={"enum": ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]}, high=integer(-20, 45)), 2, 3
            ),
        ),
    ),
    (
        "Give me a recipe for pancakes.",
        obj(name=text(), ingredients=array(text(25), 2, 5), minutes=integer(1, 300), vegetarian={"type": "boolean"}),
    ),
    (
        "Rate a movie you like.",
        obj(title=text(40), stars=integer(1, 5), score={"type": "number", "minimum": 0, "maximum": 10}),
    ),
    (
        "Describe a product in a store.",
        obj(
            sku={"type": "string", "pattern": "^[A-Z0-9]{6}$"},
            price={"type": "number", "minimum": 0},
            in_stock={"type": "boolean"},
            tags=array({"enum": ["new", "sale", "popular"]}, 0, 2),
        ),
    ),
    ("Describe a company.", obj(name=text(), ceo=obj(name=text(), age=integer(18, 99)), hq=ADDRESS)),
    ("How many legs does a spider have?", obj(answer={"anyOf": [integer(0, 100), text(10)]})),
    ("Write a 2 by 2 matrix of digits.", array(array(integer(0, 9), 2, 2), 2, 2)),
    (
        "Plan a team meeting.",
        obj(
            title=text(40),
            attendees=array(obj(name=text(20), rsvp={"enum": ["yes", "no", "maybe"]}), 1, 3),
            online={"type": "boolean"},
            room={"anyOf": [{"type": "null"}, text(10)]},
        ),
    ),
]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city.",
        "parameters": obj(city={"type": "string"}),
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "description": "The time in a timezone.", "parameters": obj(zone=text(20))},
}
HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|London)"\}\}\n</tool_call>'
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def smol_root(deploy_module_app: Callable[[AppConfig], str]) -> str:
    return deploy_module_app(SMOL_APP)


@pytest.fixture(scope="module")
def smol(smol_root: str) -> OpenAI:
    return OpenAI(base_url=f"{smol_root}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def tiny_root(deploy_module_app: Callable[[AppConfig], str]) -> str:
    return deploy_module_app(TINY_APP)


@pytest.fixture(scope="module")
def tiny(tiny_root: str) -> OpenAI:
    return OpenAI(base_url=f"{tiny_root}/v1", api_key="unused", timeout=120, max_retries=0)


def accepted_drafts(root: str, served_model_name: str) -> float:
    """The app's count of speculative drafts accepted so far, from its /metrics."""
    metrics = httpx.get(f"{root}/metrics", timeout=30).text
    prefix = "pagedserve:spec_decode_num_accepted_tokens_total{"
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(prefix) and f'model_name="{served_model_name}"' in line
    ]
    assert len(values) == 1, values
    return values[0]


def ask(client: OpenAI, question: str, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], **{"temperature": 0, **kwargs}
    )


def json_schema_format(schema: dict[str, Any], name: str = "answer") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


# ---------------------------------------------------------------------------------------------------------------
# JSON on SmolLM2


def test_twenty_concurrent_json_schema_answers_each_validate(smol):
    def answer(question: str, schema: dict[str, Any]) -> Any:
        return ask(smol, question, max_tokens=300, response_format=json_schema_format(schema))

    with ThreadPoolExecutor(max_workers=len(SCHEMA_REQUESTS)) as pool:
        futures = [pool.submit(answer, question, schema) for question, schema in SCHEMA_REQUESTS]
        responses = [future.result(timeout=REQUEST_TIMEOUT_S) for future in futures]
    for (question, schema), response in zip(SCHEMA_REQUESTS, responses, strict=True):
        choice = response.choices[0]
        assert choice.finish_reason == "stop", (question, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population: int = Field(ge=0, le=40_000_000)
    is_capital: bool


def test_sdk_parse_sends_a_strict_schema_and_reads_the_object_back(smol):
    response = smol.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me about Paris."}],
        response_format=City,
        max_tokens=120,
        temperature=0,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, City)
    assert choice.message.parsed == City.model_validate_json(choice.message.content)


def test_json_object_response_format_is_a_json_object(smol):
    response = ask(
        smol,
        "Describe a cat as JSON with its name and age.",
        max_tokens=200,
        response_format={"type": "json_object"},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content), dict)


def test_n_seeded_samples_all_validate(smol):
    question, schema = SCHEMA_REQUESTS[2]
    response = ask(
        smol, question, n=3, seed=17, temperature=0.9, max_tokens=200, response_format=json_schema_format(schema)
    )
    assert len(response.choices) == 3
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_completions_with_structured_choice_and_regex(smol):
    choices = [" Paris", " London", " Berlin"]
    response = smol.completions.create(
        model=MODEL,
        prompt="Q: What is the capital of France?\nA:",
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert response.choices[0].text in choices
    assert response.choices[0].finish_reason == "stop"
    pattern = " [0-9]{4}"
    response = smol.completions.create(
        model=MODEL,
        prompt="The French Revolution began in the year",
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert re.fullmatch(pattern, response.choices[0].text), response.choices[0].text
    assert response.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------------------------------------------------------
# The hermes parser on SmolLM2, its text forced into a call


def test_hermes_call_is_parsed_into_tool_calls(smol):
    response = smol.chat.completions.create(
        model=MODEL,
        messages=WEATHER_QUESTION,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="auto",
        temperature=0,
        max_tokens=64,
        extra_body={"structured_outputs": {"regex": HERMES_CALL}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    [call] = choice.message.tool_calls
    assert call.id and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "London")


def test_hermes_call_streamed_with_the_sdk_helper_equals_the_non_streamed_call(smol):
    request = {
        "model": MODEL,
        "messages": WEATHER_QUESTION,
        "tools": [WEATHER_TOOL, TIME_TOOL],
        "tool_choice": "auto",
        "temperature": 0,
        "max_tokens": 64,
        "extra_body": {"structured_outputs": {"regex": HERMES_CALL}},
    }
    [expected] = smol.chat.completions.create(**request).choices[0].message.tool_calls
    with smol.chat.completions.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    done = [event for event in events if event.type == "tool_calls.function.arguments.done"]
    assert [(event.name, json.loads(event.arguments)) for event in done] == [
        ("get_weather", json.loads(expected.function.arguments))
    ]
    assert not "".join(event.delta for event in events if event.type == "content.delta")
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == (expected.function.name, expected.function.arguments)
    assert call.id.startswith("chatcmpl-tool-")


def test_plain_answer_with_auto_tools_is_content(smol):
    pattern = "[A-Za-z ]{1,20}"
    response = smol.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        tools=[WEATHER_TOOL],
        tool_choice="auto",
        temperature=0,
        max_tokens=32,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert not choice.message.tool_calls
    assert re.fullmatch(pattern, choice.message.content), choice.message.content


def test_history_with_a_call_and_its_result_is_part_of_the_prompt(smol):
    history = [
        *WEATHER_QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_7",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_7", "content": "Sunny, 24 degrees."},
    ]
    with_calls = smol.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER_TOOL], temperature=0, max_tokens=24
    )
    without = smol.chat.completions.create(
        model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL], temperature=0, max_tokens=1
    )
    assert with_calls.choices[0].finish_reason in ("stop", "length")
    assert with_calls.usage.prompt_tokens > without.usage.prompt_tokens


# ---------------------------------------------------------------------------------------------------------------
# The llama3_json parser, and constrained greedy text at TP=2 with drafts, on the tiny random Llama

TINY_TOOL = {"type": "function", "function": {"name": "f", "parameters": obj(x=integer(0, 9), tag=text(4))}}
LLAMA3_CALL = r'\{"name": "f", "parameters": \{"x": [0-9], "tag": "[a-z]{1,4}"\}\}'
TINY_SCHEMA = obj(name={"type": "string", "pattern": "^[a-z]{1,8}$"}, age=integer(0, 120))
TINY_PROMPTS = ["Record 1: the entry reads", "one two one two one two"]
TINY_REGEX = "(ab){6}-[0-9]{2}"


def tiny_chat(tiny: OpenAI, **kwargs: Any) -> Any:
    return tiny.chat.completions.create(
        model=TINY_MODEL,
        messages=[{"role": "user", "content": "Call f."}],
        tools=[TINY_TOOL],
        tool_choice="auto",
        max_tokens=48,
        extra_body={"structured_outputs": {"regex": LLAMA3_CALL}},
        **{"temperature": 0, **kwargs},
    )


def assert_llama3_call(name: str, arguments: str) -> None:
    assert name == "f"
    assert re.fullmatch(r'\{"x": [0-9], "tag": "[a-z]{1,4}"\}', arguments), arguments
    jsonschema.validate(json.loads(arguments), TINY_TOOL["function"]["parameters"])


def test_llama3_json_call_parsed_streamed_and_not(tiny):
    choice = tiny_chat(tiny).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    [call] = choice.message.tool_calls
    assert_llama3_call(call.function.name, call.function.arguments)
    calls: dict[int, dict[str, str]] = {}
    finish_reason, content = None, ""
    for chunk in tiny_chat(tiny, stream=True):
        for streamed in chunk.choices:
            content += streamed.delta.content or ""
            finish_reason = streamed.finish_reason or finish_reason
            for delta in streamed.delta.tool_calls or []:
                if delta.index not in calls:
                    assert delta.id and delta.function.name, delta
                    calls[delta.index] = {"name": delta.function.name, "arguments": ""}
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert finish_reason == "tool_calls"
    assert content == ""
    assert list(calls.values()) == [{"name": call.function.name, "arguments": call.function.arguments}]


@pytest.fixture(scope="module")
def offline_constrained(tiny_model_dir: Path) -> dict[tuple[str, str], str]:
    """(constraint kind, prompt) -> the single-rank engine's greedy constrained text, without drafts."""
    from executor import LLM

    llm = LLM(model=str(tiny_model_dir), show_progress=False, num_kv_blocks=64)
    texts = {}
    for kind, spec in (
        ("json", StructuredOutputsParams(json=TINY_SCHEMA)),
        ("regex", StructuredOutputsParams(regex=TINY_REGEX)),
    ):
        params = SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=spec)
        for prompt, output in zip(TINY_PROMPTS, llm.generate(TINY_PROMPTS, params, use_tqdm=False), strict=True):
            texts[(kind, prompt)] = output.outputs[0].text
    return texts


def test_tp2_with_drafts_gives_the_single_rank_constrained_text(tiny, tiny_root, offline_constrained):
    accepted_before = accepted_drafts(tiny_root, TINY_MODEL)
    for kind, fields in (("json", {"json": TINY_SCHEMA}), ("regex", {"regex": TINY_REGEX})):
        response = tiny.completions.create(
            model=TINY_MODEL,
            prompt=TINY_PROMPTS,
            max_tokens=48,
            temperature=0,
            extra_body={"structured_outputs": fields},
        )
        choices = sorted(response.choices, key=lambda choice: choice.index)
        assert [choice.text for choice in choices] == [offline_constrained[(kind, prompt)] for prompt in TINY_PROMPTS]
        assert all(choice.finish_reason == "stop" for choice in choices)
    for prompt in TINY_PROMPTS:
        jsonschema.validate(json.loads(offline_constrained[("json", prompt)]), TINY_SCHEMA)
        assert re.fullmatch(TINY_REGEX, offline_constrained[("regex", prompt)])
    # The repeated "ab" is drafted by n-gram lookup: the equal texts came through accepted drafts.
    assert accepted_drafts(tiny_root, TINY_MODEL) > accepted_before


def test_tp2_n_two_seeded_json_schema_samples_validate(tiny):
    response = tiny.chat.completions.create(
        model=TINY_MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        n=2,
        seed=4,
        temperature=1.0,
        max_tokens=48,
        response_format=json_schema_format(TINY_SCHEMA),
    )
    assert len(response.choices) == 2
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), TINY_SCHEMA)


def test_drafts_were_accepted_under_the_grammar_and_both_engines_drain(smol_root, tiny_root):
    assert accepted_drafts(smol_root, MODEL) > 0
    assert_engine_drained(SMOL_APP.serve.app_name, timeout_s=60)
    assert_engine_drained(TINY_APP.serve.app_name, timeout_s=60)
