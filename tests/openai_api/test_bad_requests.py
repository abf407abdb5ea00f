"""Errors: OpenAI's shape, the right status, never 422 or 500."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.openai_api.common import (
    CHAT,
    MAX_BODY_BYTES,
    MAX_MODEL_LEN,
    MODEL,
    PROMPT,
    VOCAB_SIZE,
    assert_openai_error,
    chat,
    chat_body,
    complete,
    completion,
)

pytestmark = pytest.mark.serve


@dataclass(frozen=True)
class Bad:
    name: str
    path: str
    body: dict[str, Any] | bytes
    status: int = 400
    param: str | tuple[str, ...] | None = None  # None: not checked
    message: str = ""
    content_type: str = "application/json"


CMPL, CHATS = "/v1/completions", "/v1/chat/completions"
BAD_REQUESTS = [
    Bad("prompt_too_long", CMPL, completion(prompt=[100] * MAX_MODEL_LEN), message="maximum context length"),
    Bad("prompt_text_too_long", CMPL, completion(prompt="hi " * 3000), message="maximum context length"),
    Bad("prompt_plus_max_tokens", CMPL, completion(max_tokens=MAX_MODEL_LEN), message="maximum context length"),
    Bad("chat_too_long", CHATS, chat_body(messages=[{"role": "user", "content": "hi " * 3000}]), message="maximum"),
    Bad("empty_prompt", CMPL, completion(prompt=""), param="prompt"),
    Bad("empty_prompt_list", CMPL, completion(prompt=[]), param="prompt"),
    Bad("empty_token_list", CMPL, completion(prompt=[[]]), param="prompt"),
    Bad("empty_string_in_list", CMPL, completion(prompt=["hi", ""]), param="prompt"),
    Bad("prompt_wrong_type", CMPL, completion(prompt=5)),
    Bad("prompt_missing", CMPL, {"model": MODEL}, param="prompt"),
    Bad("token_out_of_vocab", CMPL, completion(prompt=[5, VOCAB_SIZE]), param="prompt", message=str(VOCAB_SIZE)),
    Bad("negative_token", CMPL, completion(prompt=[[5, -1]]), param="prompt"),
    Bad("empty_messages", CHATS, chat_body(messages=[]), param="messages"),
    Bad("messages_missing", CHATS, {"model": MODEL}, param="messages"),
    Bad("bad_role", CHATS, chat_body(messages=[{"role": "wizard", "content": "hi"}])),
    Bad("image_part", CHATS, chat_body(messages=[{"role": "user", "content": [{"type": "image_url"}]}])),
    Bad("temperature_negative", CMPL, completion(temperature=-0.5), param="temperature"),
    Bad("temperature_nan", CMPL, b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', param="temperature"),
    Bad("top_p_zero", CMPL, completion(top_p=0), param="top_p"),
    Bad("top_p_above_one", CMPL, completion(top_p=1.5), param="top_p"),
    Bad("top_k_negative", CMPL, completion(top_k=-2), param="top_k"),
    Bad("min_p_above_one", CMPL, completion(min_p=1.5), param="min_p"),
    Bad("presence_penalty", CMPL, completion(presence_penalty=2.5), param="presence_penalty"),
    Bad("frequency_penalty", CMPL, completion(frequency_penalty=-3), param="frequency_penalty"),
    Bad("repetition_penalty", CMPL, completion(repetition_penalty=0), param="repetition_penalty"),
    Bad("n_zero", CMPL, completion(n=0), param="n"),
    Bad("n_above_max", CMPL, completion(n=9), param="n"),
    Bad("chat_n_above_max", CHATS, chat_body(n=9), param="n"),
    Bad("n_not_int", CMPL, completion(n="two"), param="n"),
    Bad("max_tokens_zero", CMPL, completion(max_tokens=0), param="max_tokens"),
    Bad("max_tokens_negative", CMPL, completion(max_tokens=-1), param="max_tokens"),
    Bad(
        "max_completion_tokens_zero",
        CHATS,
        chat_body(max_completion_tokens=0),
        param=("max_completion_tokens", "max_tokens"),
    ),
    Bad("min_tokens_above_max", CMPL, completion(min_tokens=5), param="min_tokens"),
    Bad("logit_bias_out_of_vocab", CMPL, completion(logit_bias={str(VOCAB_SIZE): 1}), param="logit_bias"),
    Bad("logit_bias_negative_id", CMPL, completion(logit_bias={"-1": 1}), param="logit_bias"),
    Bad("logit_bias_not_int", CMPL, completion(logit_bias={"hello": 1}), param="logit_bias"),
    Bad("logit_bias_too_big", CMPL, completion(logit_bias={"5": 101}), param="logit_bias"),
    Bad("logit_bias_11_entries", CMPL, completion(logit_bias={str(i): 1 for i in range(11)}), param="logit_bias"),
    Bad("stop_empty", CMPL, completion(stop=""), param="stop"),
    Bad("stop_list_with_empty", CMPL, completion(stop=["ok", ""]), param="stop"),
    Bad("stop_token_out_of_vocab", CMPL, completion(stop_token_ids=[VOCAB_SIZE]), param="stop_token_ids"),
    Bad("stop_token_negative", CMPL, completion(stop_token_ids=[-1]), param="stop_token_ids"),
    Bad(
        "stream_options_without_stream",
        CMPL,
        completion(stream_options={"include_usage": True}),
        param="stream_options",
    ),
    Bad(
        "chat_stream_options_no_stream",
        CHATS,
        chat_body(stream_options={"include_usage": True}),
        param="stream_options",
    ),
    Bad("top_logprobs_without_logprobs", CHATS, chat_body(top_logprobs=2), param="top_logprobs"),
    Bad("chat_top_logprobs_21", CHATS, chat_body(logprobs=True, top_logprobs=21), param=("top_logprobs", "logprobs")),
    Bad("logprobs_21", CMPL, completion(logprobs=21), param="logprobs"),
    Bad("logprobs_negative", CMPL, completion(logprobs=-1), param="logprobs"),
    Bad("echo_with_logprobs", CMPL, completion(echo=True, logprobs=1), param="echo"),
    Bad("chat_template", CHATS, chat_body(chat_template="{{ 'pwned' }}"), param="chat_template"),
    Bad("chat_template_kwargs", CHATS, chat_body(chat_template_kwargs={"x": 1}), param="chat_template_kwargs"),
    Bad("unknown_model", CMPL, completion(model="gpt-4"), status=404, param="model", message="gpt-4"),
    Bad("chat_unknown_model", CHATS, chat_body(model="gpt-4"), status=404, param="model"),
    Bad("tokenize_unknown_model", "/tokenize", {"model": "gpt-4", "prompt": "hi"}, status=404, param="model"),
    Bad("tokenize_both_forms", "/tokenize", {"prompt": "hi", "messages": CHAT}),
    Bad("tokenize_neither_form", "/tokenize", {"model": MODEL}),
    Bad("tokenize_empty_messages", "/tokenize", {"messages": []}, param="messages"),
    Bad("detokenize_out_of_vocab", "/detokenize", {"tokens": [1, VOCAB_SIZE]}, param="tokens"),
    Bad("detokenize_negative", "/detokenize", {"tokens": [-1]}, param="tokens"),
    Bad("detokenize_missing_tokens", "/detokenize", {"model": MODEL}, param="tokens"),
    Bad("malformed_json", CMPL, b'{"model": "tiny", "prompt": ', message="JSON"),
    Bad("empty_body", CMPL, b"", message="JSON"),
    Bad("json_array", CMPL, b'[{"model": "tiny", "prompt": "hi"}]', message="object"),
    Bad("json_string", CHATS, b'"hello"', message="object"),
    Bad("json_null", "/tokenize", b"null", message="object"),
    Bad("invalid_utf8", CMPL, b'{"model": "tiny", "prompt": "\xff\xfe"}'),
    Bad("deep_nesting", CMPL, b'{"prompt": ' + b"[" * 20000 + b"]" * 20000 + b"}"),
    Bad(
        "wrong_content_type", CMPL, json.dumps(completion()).encode(), content_type="text/plain", message="Content-Type"
    ),
    Bad("form_content_type", CHATS, b"prompt=hi", content_type="application/x-www-form-urlencoded"),
    Bad("no_content_type", CMPL, json.dumps(completion()).encode(), content_type="", message="Content-Type"),
    Bad("body_too_large", CMPL, completion(prompt="x" * (MAX_BODY_BYTES + 10)), status=413),
    Bad("unknown_route", "/v1/engines", {"prompt": "hi"}, status=404),
]


def send(http: httpx.Client, bad: Bad) -> httpx.Response:
    headers = {"Content-Type": bad.content_type} if bad.content_type else {}
    content = bad.body if isinstance(bad.body, bytes) else json.dumps(bad.body).encode()
    request = http.build_request("POST", bad.path, content=content, headers=headers)
    if not bad.content_type:
        request.headers.pop("Content-Type", None)
    return http.send(request)


@pytest.mark.parametrize("bad", BAD_REQUESTS, ids=[bad.name for bad in BAD_REQUESTS])
def test_bad_request_is_an_openai_error(http, bad):
    response = send(http, bad)
    error = assert_openai_error(response, bad.status)
    if bad.param is not None:
        accepted = bad.param if isinstance(bad.param, tuple) else (bad.param,)
        assert error["param"] in accepted, error
    assert bad.message in error["message"], error


def test_no_bad_request_is_422_or_500(http):
    statuses = {bad.name: send(http, bad).status_code for bad in BAD_REQUESTS}
    for name, status in statuses.items():
        assert status != 422, name
        assert status != 500, name
        assert 400 <= status < 500, (name, status)


def test_body_limit_also_holds_for_chunked_bodies(http):
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(MAX_BODY_BYTES // 1024 + 2):
            yield b"x" * 1024
        yield b'"}'

    response = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert "content-length" not in response.request.headers
    assert_openai_error(response, 413)
    fits = http.post(
        "/v1/completions",
        content=json.dumps(completion(prompt="hello " * 2000)).encode(),
        headers={"Content-Type": "application/json; charset=utf-8"},
    )
    assert fits.status_code == 200, fits.text


def test_wrong_method_is_405(http):
    assert_openai_error(http.get("/v1/completions"), 405)
    assert_openai_error(http.post("/v1/models", json={}), 405)
    assert_openai_error(http.get("/v1/nope"), 404)


def test_sdk_raises_the_right_classes_with_our_messages(client, root):
    with pytest.raises(openai.BadRequestError) as too_long:
        complete(client, "hi " * 3000, max_tokens=4)
    assert too_long.value.status_code == 400
    assert "maximum context length" in too_long.value.message
    assert too_long.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as bad_n:
        complete(client, PROMPT, n=9)
    assert bad_n.value.param == "n"
    assert "n must be at most 8" in bad_n.value.message
    with pytest.raises(openai.BadRequestError) as bad_chat:
        chat(client, [], max_tokens=2)
    assert bad_chat.value.param == "messages"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert unknown.value.status_code == 404
    assert unknown.value.param == "model"
    assert "no-such-model" in unknown.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)
    keyless = OpenAI(base_url=f"{root}/v1", api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as denied:
        keyless.models.list()
    assert denied.value.status_code == 401
    assert "API key" in denied.value.message
    with pytest.raises(openai.AuthenticationError):
        keyless.completions.create(model=MODEL, prompt="hi", max_tokens=2)
