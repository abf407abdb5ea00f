"""The request-field table: every field OpenAI's SDK can send is honoured or refused with a 400 naming it, and
unknown keys are accepted and logged once."""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from serve_app.request_fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    check_request_fields,
    refused_fields_markdown,
)
from serve_app.validation import RequestError

LOGGER_NAME = "serve_app.request_fields"
TABLES = {"chat": CHAT_FIELDS, "completions": COMPLETION_FIELDS}
BASE_REQUESTS = {
    "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "completions": {"model": "m", "prompt": "hi"},
}

# A value each refused field may carry that the server does not honour, as a client would send it.
REFUSED_VALUES: dict[str, Any] = {
    "store": True,
    "service_tier": "flex",
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "draft"},
    "web_search_options": {},
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto",
    "reasoning_effort": "low",
    "verbosity": "low",
    "prompt_cache_key": "user-1",
    "prompt_cache_options": {"mode": "explicit"},
    "prompt_cache_retention": "24h",
    "moderation": {"input": True},
    "echo": True,
    "add_special_tokens": True,
    "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": False},
    "documents": [{"title": "t", "text": "x"}],
    "mm_processor_kwargs": {"num_crops": 4},
    "thinking": {"type": "enabled"},
    "include_reasoning": False,
    "suffix": "}",
    "best_of": 3,
    "prompt_embeds": "AAAA",
    "prompt_logprobs": 0,
    "use_beam_search": True,
    "length_penalty": 0.5,
    "bad_words": ["spam"],
    "allowed_token_ids": [1, 2],
    "logits_processors": ["pkg.Processor"],
    "truncate_prompt_tokens": 16,
    "return_tokens_as_token_ids": True,
    "spaces_between_special_tokens": False,
    "priority": 5,
    "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": r"\s*",
    "structural_tag": "{}",
    "request_id": "mine",
    "cache_salt": "salt",
    "kv_transfer_params": {"do_remote_prefill": True},
    "vllm_xargs": {"k": 1},
    "return_token_ids": True,
}

REFUSED = [
    (endpoint, field) for endpoint, table in TABLES.items() for field, rule in table.items() if not rule.honoured
]


def sdk_fields(*param_classes: type) -> set[str]:
    return {name for param_class in param_classes for name in param_class.__annotations__}


def unknown_field_records(caplog: pytest.LogCaptureFixture, field: str) -> list[logging.LogRecord]:
    expected = f"request field {field!r} is not part of the API and was ignored"
    return [record for record in caplog.records if record.getMessage() == expected]


@pytest.mark.parametrize(
    ("table", "param_classes"),
    [
        (
            CHAT_FIELDS,
            (chat_create_params.CompletionCreateParamsBase, chat_create_params.CompletionCreateParamsStreaming),
        ),
        (
            COMPLETION_FIELDS,
            (
                completion_create_params.CompletionCreateParamsBase,
                completion_create_params.CompletionCreateParamsStreaming,
            ),
        ),
    ],
    ids=["chat", "completions"],
)
def test_every_field_of_the_installed_sdk_is_in_the_table(table, param_classes):
    missing = sdk_fields(*param_classes) - table.keys()
    assert not missing, f"openai {openai.__version__} sends fields the table does not rule on: {sorted(missing)}"


def test_every_refused_field_has_a_test_value():
    assert {field for _, field in REFUSED} <= REFUSED_VALUES.keys()


@pytest.mark.parametrize(("endpoint", "field"), REFUSED, ids=[f"{e}-{f}" for e, f in REFUSED])
def test_refused_field_is_a_400_naming_it(endpoint, field):
    payload = {**BASE_REQUESTS[endpoint], field: REFUSED_VALUES[field]}
    with pytest.raises(RequestError) as raised:
        check_request_fields(payload, endpoint)
    assert raised.value.status == 400
    assert raised.value.param == field
    assert raised.value.message.startswith(f"{field} is not supported by this server: ")
    assert raised.value.message.endswith(".") and "\n" not in raised.value.message


@pytest.mark.parametrize(("endpoint", "field"), REFUSED, ids=[f"{e}-{f}" for e, f in REFUSED])
def test_refused_field_passes_with_null_and_its_accepted_values(endpoint, field, caplog):
    rule = TABLES[endpoint][field]
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        for value in (None, *rule.accepted):
            check_request_fields({**BASE_REQUESTS[endpoint], field: value}, endpoint)
    assert not caplog.records


@pytest.mark.parametrize(
    ("endpoint", "field", "value"),
    [
        ("chat", "store", False),
        ("chat", "service_tier", "auto"),
        ("chat", "service_tier", "default"),
        ("chat", "modalities", ["text"]),
        ("chat", "echo", False),
        ("chat", "use_beam_search", False),
        ("completions", "length_penalty", 1.0),
        ("completions", "priority", 0),
    ],
)
def test_values_that_ask_for_nothing_missing_pass(endpoint, field, value):
    check_request_fields({**BASE_REQUESTS[endpoint], field: value}, endpoint)


@pytest.mark.parametrize(("field", "value"), [("store", 0), ("store", "false"), ("use_beam_search", 0)])
def test_accepted_values_match_as_json_not_loosely(field, value):
    with pytest.raises(RequestError) as raised:
        check_request_fields({**BASE_REQUESTS["chat"], field: value}, "chat")
    assert raised.value.param == field


def test_echo_is_honoured_on_completions_and_refused_on_chat():
    check_request_fields({**BASE_REQUESTS["completions"], "echo": True}, "completions")
    with pytest.raises(RequestError, match="echo is not supported by this server"):
        check_request_fields({**BASE_REQUESTS["chat"], "echo": True}, "chat")


@pytest.mark.parametrize(("n", "best_of"), [(None, 1), (1, 1), (3, 3), (3, 1), (None, None)])
def test_best_of_equal_to_n_or_one_passes(n, best_of):
    payload = {**BASE_REQUESTS["completions"], "best_of": best_of}
    if n is not None:
        payload["n"] = n
    check_request_fields(payload, "completions")


@pytest.mark.parametrize(("n", "best_of"), [(None, 2), (1, 3), (2, 4), (3, True), (3, 3.0)])
def test_best_of_above_n_is_refused(n, best_of):
    payload = {**BASE_REQUESTS["completions"], "best_of": best_of}
    if n is not None:
        payload["n"] = n
    with pytest.raises(RequestError) as raised:
        check_request_fields(payload, "completions")
    assert raised.value.param == "best_of"
    assert "request n choices" in raised.value.message


@pytest.mark.parametrize("metadata", [None, {}, {"team": "search", "trace": "abc"}, {f"k{i}": "v" for i in range(16)}])
def test_metadata_of_string_pairs_passes(metadata):
    check_request_fields({**BASE_REQUESTS["chat"], "metadata": metadata}, "chat")


@pytest.mark.parametrize(
    "metadata",
    [
        "team=search",
        ["team", "search"],
        {"count": 3},
        {"nested": {"a": "b"}},
        {f"k{i}": "v" for i in range(17)},
        {"k" * 65: "v"},
        {"k": "v" * 513},
    ],
)
def test_metadata_not_string_pairs_is_a_400(metadata):
    with pytest.raises(RequestError) as raised:
        check_request_fields({**BASE_REQUESTS["chat"], "metadata": metadata}, "chat")
    assert raised.value.status == 400
    assert raised.value.param == "metadata"
    assert raised.value.message.startswith("metadata must be an object")


def test_first_refused_field_in_the_body_is_named():
    payload = {**BASE_REQUESTS["chat"], "audio": {"voice": "alloy"}, "store": True}
    with pytest.raises(RequestError) as raised:
        check_request_fields(payload, "chat")
    assert raised.value.param == "audio"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_honoured_fields_pass_without_a_warning(endpoint, caplog):
    table = TABLES[endpoint]
    payload = {field: "any value" for field, rule in table.items() if rule.honoured and rule.shape_error is None}
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        check_request_fields(payload, endpoint)
    assert not caplog.records


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_unknown_field_passes_and_is_logged_once(endpoint, caplog):
    field = f"x_unknown_{uuid.uuid4().hex[:8]}"
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        for _ in range(3):
            check_request_fields({**BASE_REQUESTS[endpoint], field: 1}, endpoint)
        check_request_fields({**BASE_REQUESTS["chat"], field: 2}, "chat")
    assert len(unknown_field_records(caplog, field)) == 1


def test_completions_only_field_sent_to_chat_is_unknown_not_refused():
    # vLLM's chat endpoint ignores suffix and best_of; so does this one (with the once-per-name warning).
    check_request_fields({**BASE_REQUESTS["chat"], "suffix": "}", "best_of": 5}, "chat")


def test_a_body_that_is_not_an_object_is_left_to_the_request_model():
    check_request_fields([1, 2], "chat")  # type: ignore[arg-type]


def captured_sdk_body(send: Any) -> dict[str, Any]:
    """The JSON body the real `openai` SDK puts on the wire for one call."""
    bodies: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(400, json={"error": {"message": "captured", "type": "BadRequestError", "code": 400}})

    client = openai.OpenAI(
        api_key="k",
        base_url="http://sdk.invalid/v1",
        max_retries=0,
        timeout=5,
        http_client=httpx.Client(transport=httpx.MockTransport(answer)),
    )
    with pytest.raises(openai.BadRequestError):
        send(client)
    return bodies[0]


def test_what_the_sdk_sends_for_store_and_suffix_is_refused():
    chat_body = captured_sdk_body(
        lambda client: client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], store=True, metadata={"team": "search"}
        )
    )
    with pytest.raises(RequestError) as raised:
        check_request_fields(chat_body, "chat")
    assert raised.value.param == "store"

    completion_body = captured_sdk_body(lambda client: client.completions.create(model="m", prompt="a", suffix="b"))
    with pytest.raises(RequestError) as raised:
        check_request_fields(completion_body, "completions")
    assert raised.value.param == "suffix"


def test_markdown_table_lists_every_refused_field_with_its_endpoints():
    rows = {
        line.split("|")[1].strip().strip("`"): line.split("|")[2].strip()
        for line in refused_fields_markdown().splitlines()[2:]
    }
    refused_on: dict[str, list[str]] = {}
    for endpoint, field in REFUSED:
        refused_on.setdefault(field, []).append(endpoint)
    assert rows == {field: ", ".join(endpoints) for field, endpoints in refused_on.items()}
    assert rows["echo"] == "chat"
    assert "temperature" not in rows


def test_the_docs_carry_the_current_refused_fields_table():
    docs = (Path(__file__).resolve().parents[1] / "docs" / "request-fields.md").read_text()
    assert refused_fields_markdown() in docs


def test_user_safety_identifier_and_metadata_go_to_the_request_log_line_cut_short(caplog):
    from serve_app.protocol import ChatCompletionRequest
    from serve_app.serving import MAX_LOGGED_TAG_CHARS, log_request_tags

    body = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "user": "u" * (4 * MAX_LOGGED_TAG_CHARS),
            "safety_identifier": "person-7",
            "metadata": {"team": "search"},
        }
    )
    with caplog.at_level(logging.INFO, logger="serve_app.serving"):
        log_request_tags("chatcmpl-1", body)
    (record,) = caplog.records
    line = record.getMessage()
    assert "chatcmpl-1" in line and "person-7" in line and "search" in line
    assert f"({4 * MAX_LOGGED_TAG_CHARS} characters)" in line and len(line) < 2 * MAX_LOGGED_TAG_CHARS
