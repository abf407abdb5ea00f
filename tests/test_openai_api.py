"""OpenAI-API conformance of the pagedserve ingress, over real HTTP with the official `openai` SDK and raw httpx.

One app on the tiny random Llama (random weights: gibberish text, but deterministic under greedy) with an API key,
CORS and small request limits. Every sampling parameter is checked for its effect on the output, every bad request
for an OpenAI-shaped 4xx (never 422 or 500), and the guard (auth, CORS, body limit, content type) against path tricks.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from configs.app_config import AppConfig

pytestmark = pytest.mark.serve

API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "tiny"
ORIGIN = "https://app.example"
PREFIX = "/conf"
VOCAB_SIZE = 49152
MAX_MODEL_LEN = 2048
EOS_ID = 2  # <|im_end|>
MAX_BODY_BYTES = 65536
CONFIG = AppConfig.model_validate(
    {
        "model": {"name": "tiny-random-llama", "served_model_name": MODEL},
        "cache": {"num_kv_blocks": 256},
        "scheduler": {"max_num_seqs": 32},
        "parallel": {"worker_num_cpus": 0.5, "num_threads": 1},
        "serve": {
            "app_name": "conformance",
            "route_prefix": PREFIX,
            "ingress_num_cpus": 0.1,
            "api_key": API_KEY,
            "cors_allow_origins": [ORIGIN],
            "max_body_bytes": MAX_BODY_BYTES,
            "max_n": 8,
            "max_logit_bias_entries": 10,
        },
    }
)
PROMPT = "The quick brown fox"
# Greedy on the tiny model repeats " cortex" five times after this prompt: penalties must change that.
REPEATING_PROMPT = "1 2 3 4 5"
CHAT = [{"role": "user", "content": "Hello"}]
# vLLM's extra sampling fields, which the SDK only sends through extra_body.
EXTRA_FIELDS = frozenset(
    {
        "top_k",
        "min_p",
        "repetition_penalty",
        "stop_token_ids",
        "ignore_eos",
        "min_tokens",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "add_generation_prompt",
        "continue_final_message",
    }
)


# ---------------------------------------------------------------------------------------------------------------------
# Fixtures and helpers


@pytest.fixture(scope="module")
def root(deploy_module_app) -> str:
    """http://127.0.0.1:<port>/conf: the app's root (tokenize, health, metrics, version live here)."""
    return deploy_module_app(CONFIG)


@pytest.fixture(scope="module")
def client(root: str) -> OpenAI:
    return OpenAI(base_url=f"{root}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(root: str) -> Iterator[httpx.Client]:
    """Raw HTTP with the key, relative to the app root."""
    with httpx.Client(base_url=root, headers=AUTH, timeout=120) as session:
        yield session


@pytest.fixture(scope="module")
def anonymous(root: str) -> Iterator[httpx.Client]:
    """Raw HTTP without any key."""
    with httpx.Client(base_url=root, timeout=120) as session:
        yield session


def split_extras(kwargs: dict[str, Any]) -> dict[str, Any]:
    extra = {name: kwargs.pop(name) for name in list(kwargs) if name in EXTRA_FIELDS}
    if extra:
        kwargs["extra_body"] = {**kwargs.get("extra_body", {}), **extra}
    return kwargs


def complete(client: OpenAI, prompt: Any = PROMPT, **kwargs: Any) -> Any:
    return client.completions.create(model=MODEL, prompt=prompt, **split_extras(kwargs))


def chat(client: OpenAI, messages: list[dict[str, Any]] | None = None, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=CHAT if messages is None else messages, **split_extras(kwargs)
    )


def greedy_text(client: OpenAI, prompt: Any = PROMPT, max_tokens: int = 16, **kwargs: Any) -> str:
    response = complete(client, prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)
    return response.choices[0].text


def stop_reason(choice: Any) -> Any:
    return (choice.model_extra or {}).get("stop_reason")


def tokenize(http: httpx.Client, **body: Any) -> dict[str, Any]:
    response = http.post("/tokenize", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def single_token_id(http: httpx.Client, text: str) -> int:
    tokens = tokenize(http, prompt=text, add_special_tokens=False)["tokens"]
    assert len(tokens) == 1, f"{text!r} is {tokens}, not one token"
    return tokens[0]


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric(samples: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    """The sample `name` whose labels include `labels` (model_name="tiny" by default); 0.0 when absent."""
    wanted = {"model_name": MODEL, **labels}.items()
    values = [value for (sample, sample_labels), value in samples.items() if sample == name and wanted <= sample_labels]
    assert len(values) <= 1, f"{name}{labels} is ambiguous: {values}"
    return values[0] if values else 0.0


def scrape(anonymous: httpx.Client) -> dict[tuple[str, frozenset], float]:
    response = anonymous.get("/metrics")
    assert response.status_code == 200, response.text
    return parse_metrics(response.text)


def wait_until_idle(anonymous: httpx.Client, timeout_s: float = 20.0) -> dict[tuple[str, frozenset], float]:
    """Poll /metrics until nothing runs or waits and every KV block is free."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(anonymous)
        running = metric(samples, "vllm:num_requests_running")
        waiting = metric(samples, "vllm:num_requests_waiting")
        usage = metric(samples, "vllm:kv_cache_usage_perc")
        if running == 0 and waiting == 0 and usage == 0.0:
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle after {timeout_s}s: running {running} waiting {waiting} kv {usage}")
        time.sleep(0.2)


def raw_request(port: int, method: str, target: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """Send the request line exactly as given (no client-side path normalization); returns (status, raw reply)."""
    header_lines = {"Host": f"127.0.0.1:{port}", "Connection": "close", **(headers or {})}
    request = f"{method} {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in header_lines.items()) + "\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=60) as connection:
        connection.sendall(request.encode())
        reply = b""
        while chunk := connection.recv(65536):
            reply += chunk
    return int(reply.split(b" ", 2)[1]), reply


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code not in (422, 500), response.text
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["code"] == status, error
    return error


@pytest.fixture(scope="module")
def greedy_reference(client: OpenAI) -> dict[str, Any]:
    """PROMPT's greedy continuation (24 tokens, EOS ignored) with its per-token strings."""
    response = complete(client, PROMPT, max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    choice = response.choices[0]
    assert response.usage.completion_tokens == 24
    return {"text": choice.text, "tokens": choice.logprobs.tokens}


# ---------------------------------------------------------------------------------------------------------------------
# Routes


def test_models_lists_the_served_name(client, http):
    assert [model.id for model in client.models.list().data] == [MODEL]
    body = http.get("/v1/models").json()
    assert body["object"] == "list"
    assert body["data"][0]["object"] == "model"
    assert body["data"][0]["max_model_len"] == MAX_MODEL_LEN


def test_completion_shape_and_usage(client, http):
    response = complete(client, PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    assert response.id.startswith("cmpl-")
    assert response.object == "text_completion"
    assert response.model == MODEL
    [choice] = response.choices
    assert choice.index == 0
    assert choice.finish_reason == "length"
    assert choice.text
    prompt_tokens = tokenize(http, prompt=PROMPT)["count"]
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == 8
    assert response.usage.total_tokens == prompt_tokens + 8


def test_chat_completion_streamed_equals_non_streamed(client, http):
    response = chat(client, max_tokens=10, temperature=0, ignore_eos=True)
    assert response.id.startswith("chatcmpl-")
    assert response.object == "chat.completion"
    [choice] = response.choices
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 10
    assert response.usage.prompt_tokens == tokenize(http, messages=CHAT)["count"]
    chunks = list(chat(client, max_tokens=10, temperature=0, ignore_eos=True, stream=True))
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert len({chunk.id for chunk in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(chunk.choices[0].finish_reason is None for chunk in chunks[:-1])


def test_tokenize_prompt_and_messages(client, http):
    by_prompt = tokenize(http, prompt=PROMPT)
    assert by_prompt["count"] == len(by_prompt["tokens"]) > 0
    assert by_prompt["max_model_len"] == MAX_MODEL_LEN
    assert all(isinstance(token, int) and 0 <= token < VOCAB_SIZE for token in by_prompt["tokens"])
    by_messages = tokenize(http, messages=CHAT)
    assert by_messages["count"] == len(by_messages["tokens"])
    assert by_messages["tokens"][0] == 1  # <|im_start|>: the chat template was applied
    # The token ids the server reports are the ones it generates from.
    assert greedy_text(client, by_prompt["tokens"], max_tokens=6) == greedy_text(client, PROMPT, max_tokens=6)


def test_detokenize_round_trips_tokenize(http):
    text = "Hello, world! Ünïcödé and 数字 123."
    tokens = tokenize(http, prompt=text, add_special_tokens=False)["tokens"]
    response = http.post("/detokenize", json={"model": MODEL, "tokens": tokens})
    assert response.status_code == 200, response.text
    assert response.json() == {"prompt": text}


def test_version(http, anonymous):
    for session in (http, anonymous):
        response = session.get("/version")
        assert response.status_code == 200
        assert isinstance(response.json()["version"], str) and response.json()["version"]


def test_health_is_open(anonymous):
    assert anonymous.get("/health").status_code == 200


def test_metrics_are_open_and_named_like_vllm(client, anonymous):
    complete(client, PROMPT, max_tokens=2, temperature=0, ignore_eos=True)
    response = anonymous.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = parse_metrics(response.text)
    names = {name for name, _ in samples}
    for prefix in ("vllm", "pagedserve"):
        for name in (
            "num_requests_running",
            "num_requests_waiting",
            "kv_cache_usage_perc",
            "generation_tokens_total",
            "prompt_tokens_total",
            "time_to_first_token_seconds_bucket",
            "inter_token_latency_seconds_bucket",
            "e2e_request_latency_seconds_bucket",
            "request_success_total",
        ):
            assert f"{prefix}:{name}" in names, f"{prefix}:{name} missing"
        assert metric(samples, f"{prefix}:request_success_total", finished_reason="length") >= 1
        assert 0.0 <= metric(samples, f"{prefix}:kv_cache_usage_perc") <= 1.0
    success_labels = {("model_name", MODEL), ("finished_reason", "length")}
    assert any(name == "vllm:request_success_total" and success_labels <= labels for name, labels in samples)


def test_metrics_count_requests_and_tokens(client, http, anonymous):
    num_requests, num_tokens = 3, 5
    prompt_tokens = tokenize(http, prompt=PROMPT)["count"]
    before = wait_until_idle(anonymous)
    for _ in range(num_requests):
        response = complete(client, PROMPT, max_tokens=num_tokens, temperature=0, ignore_eos=True)
        assert response.usage.completion_tokens == num_tokens
    after = wait_until_idle(anonymous)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    for prefix in ("vllm", "pagedserve"):
        assert delta(f"{prefix}:generation_tokens_total") >= num_requests * num_tokens
        assert delta(f"{prefix}:request_success_total", finished_reason="length") == num_requests
        assert delta(f"{prefix}:request_success_total", finished_reason="stop") == 0
        assert delta(f"{prefix}:prompt_tokens_total") == num_requests * prompt_tokens
        assert delta(f"{prefix}:time_to_first_token_seconds_count") == num_requests
        assert delta(f"{prefix}:e2e_request_latency_seconds_count") == num_requests
        assert delta(f"{prefix}:inter_token_latency_seconds_count") == num_requests * (num_tokens - 1)
        assert metric(after, f"{prefix}:time_to_first_token_seconds_bucket", le="+Inf") == metric(
            after, f"{prefix}:time_to_first_token_seconds_count"
        )


def test_request_id_is_echoed(http):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    response = http.post("/v1/completions", json=body, headers={"X-Request-Id": "conformance-42"})
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "conformance-42"
    with http.stream(
        "POST", "/v1/completions", json={**body, "stream": True}, headers={"X-Request-Id": "conformance-43"}
    ) as streamed:
        assert streamed.status_code == 200
        assert streamed.headers["x-request-id"] == "conformance-43"
        assert streamed.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in streamed.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    errored = http.post("/v1/completions", json={**body, "n": 0}, headers={"X-Request-Id": "conformance-44"})
    assert errored.status_code == 400
    assert errored.headers["x-request-id"] == "conformance-44"


# ---------------------------------------------------------------------------------------------------------------------
# Prompt forms


def test_prompt_forms_give_one_choice_per_prompt_times_n(client, http):
    prompts = ["Once upon a time", "Hello, my name is"]
    expected = [greedy_text(client, prompt, max_tokens=5) for prompt in prompts]
    assert expected[0] != expected[1]
    token_prompts = [tokenize(http, prompt=prompt)["tokens"] for prompt in prompts]
    for form in (prompts, token_prompts):
        response = complete(client, form, n=2, max_tokens=5, temperature=0, ignore_eos=True)
        assert sorted(choice.index for choice in response.choices) == [0, 1, 2, 3]
        for choice in response.choices:
            assert choice.text == expected[choice.index // 2], choice.index
        assert response.usage.completion_tokens == 4 * 5
        assert response.usage.prompt_tokens == sum(len(tokens) for tokens in token_prompts)
    for form in (prompts[1], token_prompts[1]):
        response = complete(client, form, n=2, max_tokens=5, temperature=0, ignore_eos=True)
        assert sorted(choice.index for choice in response.choices) == [0, 1]
        assert [choice.text for choice in response.choices] == [expected[1]] * 2


def test_token_id_prompt_equals_string_prompt(client, http):
    tokens = tokenize(http, prompt=REPEATING_PROMPT)["tokens"]
    assert greedy_text(client, tokens, max_tokens=12) == greedy_text(client, REPEATING_PROMPT, max_tokens=12)


# ---------------------------------------------------------------------------------------------------------------------
# Sampling parameters, each checked for its effect


def test_n_samples_distinct_completions(client):
    # Sibling completions that finish in the same engine step must all come back: with n=3 the two gated
    # siblings always do. A short timeout, as a lost completion means the request never answers.
    quick = client.with_options(timeout=20)
    response = complete(quick, PROMPT, n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    assert sorted(choice.index for choice in response.choices) == [0, 1, 2]
    assert len({choice.text for choice in response.choices}) == 3
    assert response.usage.completion_tokens == 3 * 8
    again = complete(quick, PROMPT, n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    assert sorted((c.index, c.text) for c in again.choices) == sorted((c.index, c.text) for c in response.choices)
    chat_response = chat(quick, n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    assert sorted(choice.index for choice in chat_response.choices) == [0, 1, 2]
    assert len({choice.message.content for choice in chat_response.choices}) == 3


def test_n_2_samples_distinct_completions(client):
    response = complete(client, PROMPT, n=2, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    assert sorted(choice.index for choice in response.choices) == [0, 1]
    assert len({choice.text for choice in response.choices}) == 2
    assert response.usage.completion_tokens == 2 * 8
    single = complete(client, PROMPT, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    # Completion i draws from seed + i: the first one is the n=1 answer.
    assert [c.text for c in response.choices if c.index == 0] == [single.choices[0].text]


def test_stream_with_n_2_covers_both_indexes(client):
    expected = greedy_text(client, PROMPT, max_tokens=6)
    texts: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, str] = {}
    for chunk in complete(client, PROMPT, n=2, max_tokens=6, temperature=0, ignore_eos=True, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                assert choice.index not in finishes
                finishes[choice.index] = choice.finish_reason
    assert texts == {0: expected, 1: expected}
    assert finishes == {0: "length", 1: "length"}
    chat_texts: dict[int, str] = {0: "", 1: ""}
    for chunk in chat(client, n=2, max_tokens=6, temperature=0, ignore_eos=True, stream=True):
        for choice in chunk.choices:
            chat_texts[choice.index] += choice.delta.content or ""
    assert chat_texts[0] == chat_texts[1] != ""


def test_stream_usage_only_when_asked(client, http):
    prompt_tokens = tokenize(http, prompt=PROMPT)["count"]
    chunks = list(complete(client, PROMPT, max_tokens=5, temperature=0, ignore_eos=True, stream=True))
    assert all(chunk.usage is None for chunk in chunks)
    chunks = list(
        complete(
            client,
            PROMPT,
            n=2,
            max_tokens=5,
            temperature=0,
            ignore_eos=True,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 2 * 5
    assert chunks[-1].usage.prompt_tokens == prompt_tokens
    assert chunks[-1].usage.total_tokens == prompt_tokens + 10
    chat_chunks = list(chat(client, max_tokens=4, temperature=0, ignore_eos=True, stream=True))
    assert all(chunk.usage is None for chunk in chat_chunks)
    chat_chunks = list(
        chat(client, max_tokens=4, temperature=0, ignore_eos=True, stream=True, stream_options={"include_usage": True})
    )
    assert chat_chunks[-1].choices == []
    assert chat_chunks[-1].usage.completion_tokens == 4
    assert chat_chunks[-1].usage.prompt_tokens == tokenize(http, messages=CHAT)["count"]
    assert all(chunk.usage is None for chunk in chat_chunks[:-1])


def test_max_tokens_is_exact_with_ignore_eos(client):
    for max_tokens in (1, 7):
        response = complete(client, PROMPT, max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
        assert response.usage.completion_tokens == max_tokens
        assert len(response.choices[0].logprobs.tokens) == max_tokens
        assert response.choices[0].finish_reason == "length"


def test_max_completion_tokens_for_chat(client):
    response = chat(client, max_completion_tokens=4, temperature=0, ignore_eos=True)
    assert response.usage.completion_tokens == 4
    assert response.choices[0].finish_reason == "length"
    # max_completion_tokens wins over the deprecated max_tokens.
    response = chat(client, max_completion_tokens=3, max_tokens=9, temperature=0, ignore_eos=True)
    assert response.usage.completion_tokens == 3
    response = chat(client, max_tokens=6, temperature=0, ignore_eos=True)
    assert response.usage.completion_tokens == 6


def test_temperature_zero_is_deterministic(client, greedy_reference):
    assert greedy_text(client, PROMPT, max_tokens=24) == greedy_reference["text"]
    assert greedy_text(client, PROMPT, max_tokens=24) == greedy_reference["text"]
    first = chat(client, max_tokens=8, temperature=0, ignore_eos=True).choices[0].message.content
    assert chat(client, max_tokens=8, temperature=0, ignore_eos=True).choices[0].message.content == first


def test_seed_reproduces_and_differs_across_seeds(client):
    def sampled(seed: int) -> str:
        return complete(client, PROMPT, temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True).choices[0].text

    assert sampled(1234) == sampled(1234)
    assert sampled(1234) != sampled(1235)
    greedy = greedy_text(client, PROMPT, max_tokens=12)
    assert sampled(1234) != greedy


@pytest.mark.parametrize("setting", [{"top_p": 1e-6}, {"top_k": 1}, {"min_p": 1.0}])
def test_filters_that_keep_one_token_equal_greedy(client, greedy_reference, setting):
    response = complete(client, PROMPT, temperature=1.0, max_tokens=24, ignore_eos=True, **setting)
    assert response.choices[0].text == greedy_reference["text"]


def test_stop_strings(client, greedy_reference):
    text = greedy_reference["text"]
    stop = text[20:25]
    assert stop.strip() and len(text) > 30
    cut = text.find(stop)
    assert cut > 0
    for stop_value in (stop, ["\x00never\x00", stop]):
        response = complete(client, PROMPT, max_tokens=24, temperature=0, ignore_eos=True, stop=stop_value)
        choice = response.choices[0]
        assert choice.text == text[:cut]
        assert choice.finish_reason == "stop"
        assert stop_reason(choice) == stop
        assert response.usage.completion_tokens < 24
    included = complete(
        client, PROMPT, max_tokens=24, temperature=0, ignore_eos=True, stop=stop, include_stop_str_in_output=True
    )
    assert included.choices[0].text == text[: cut + len(stop)]
    assert included.choices[0].finish_reason == "stop"
    streamed = complete(client, PROMPT, max_tokens=24, temperature=0, ignore_eos=True, stop=[stop], stream=True)
    chunks = list(streamed)
    assert "".join(chunk.choices[0].text for chunk in chunks) == text[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"
    chat_text = chat(client, max_tokens=16, temperature=0, ignore_eos=True).choices[0].message.content
    chat_stop = chat_text[8:12]
    assert chat_stop.strip()
    chat_choice = chat(client, max_tokens=16, temperature=0, ignore_eos=True, stop=chat_stop).choices[0]
    assert chat_choice.message.content == chat_text[: chat_text.find(chat_stop)]
    assert chat_choice.finish_reason == "stop"


def test_stop_token_ids_end_at_first_occurrence(client, http, greedy_reference):
    tokens = greedy_reference["tokens"]
    for position in range(3, len(tokens)):
        piece = tokens[position]
        if not (piece.strip() and piece.isascii()) or piece in tokens[:position]:
            continue
        ids = tokenize(http, prompt=piece, add_special_tokens=False)["tokens"]
        if len(ids) == 1:
            break
    else:
        pytest.fail(f"no usable token in {tokens}")
    [token_id] = ids
    response = complete(
        client, PROMPT, max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[token_id], logprobs=0
    )
    choice = response.choices[0]
    assert response.usage.completion_tokens == position + 1
    assert choice.logprobs.tokens == tokens[: position + 1]
    assert choice.finish_reason == "stop"
    assert stop_reason(choice) == token_id
    assert greedy_reference["text"].startswith(choice.text)
    assert choice.text.endswith(piece)


def test_ignore_eos(client):
    # logit_bias makes EOS the certain next token.
    forced_eos = {"logit_bias": {str(EOS_ID): 100}, "max_tokens": 5, "temperature": 0}
    stopped = complete(client, PROMPT, **forced_eos)
    assert stopped.usage.completion_tokens == 1
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == ""
    ignored = complete(client, PROMPT, ignore_eos=True, **forced_eos)
    assert ignored.usage.completion_tokens == 5
    assert ignored.choices[0].finish_reason == "length"


def test_min_tokens_holds_back_stop_tokens(client, http):
    hello = single_token_id(http, " hello")
    forced = {"logit_bias": {str(hello): 100}, "stop_token_ids": [hello], "max_tokens": 10, "temperature": 0}
    at_once = complete(client, PROMPT, **forced)
    assert at_once.usage.completion_tokens == 1
    assert at_once.choices[0].text == " hello"
    assert stop_reason(at_once.choices[0]) == hello
    held = complete(client, PROMPT, min_tokens=4, **forced)
    assert held.usage.completion_tokens == 5
    assert held.choices[0].finish_reason == "stop"
    assert stop_reason(held.choices[0]) == hello
    assert held.choices[0].text.endswith(" hello")
    assert " hello" not in held.choices[0].text[: -len(" hello")]
    # EOS too is held back until min_tokens.
    eos_held = complete(client, PROMPT, logit_bias={str(EOS_ID): 100}, min_tokens=3, max_tokens=10, temperature=0)
    assert eos_held.usage.completion_tokens == 4
    assert eos_held.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "penalty", [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 1.5}]
)
def test_penalties_change_a_repeating_greedy_output(client, penalty):
    reference = complete(client, REPEATING_PROMPT, max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    tokens = reference.choices[0].logprobs.tokens
    first_repeat = next(i for i, token in enumerate(tokens) if token in tokens[:i])
    penalized = complete(
        client, REPEATING_PROMPT, max_tokens=24, temperature=0, ignore_eos=True, logprobs=0, **penalty
    ).choices[0]
    assert penalized.text != reference.choices[0].text
    assert len(set(penalized.logprobs.tokens)) > len(set(tokens))
    if "repetition_penalty" not in penalty:
        # Output penalties only touch tokens already generated: identical up to the first repeat.
        assert penalized.logprobs.tokens[:first_repeat] == tokens[:first_repeat]


def test_logit_bias_forces_a_token(client, http):
    hello = single_token_id(http, " hello")
    response = complete(client, PROMPT, logit_bias={str(hello): 100}, max_tokens=6, temperature=1.0, ignore_eos=True)
    assert response.choices[0].text == " hello" * 6
    reply = chat(client, logit_bias={str(hello): 100}, max_tokens=4, temperature=0, ignore_eos=True)
    assert reply.choices[0].message.content == " hello" * 4
    # A strong negative bias bans the greedy first token.
    first = greedy_text(client, PROMPT, max_tokens=1)
    banned = single_token_id(http, first)
    other = complete(client, PROMPT, max_tokens=1, temperature=0, logit_bias={str(banned): -100}).choices[0]
    assert other.text != first


def test_completion_logprobs(client):
    for top in (0, 3):
        response = complete(client, PROMPT, max_tokens=6, temperature=0, ignore_eos=True, logprobs=top)
        choice = response.choices[0]
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
        assert len(logprobs.text_offset) == 6
        assert "".join(logprobs.tokens) == choice.text
        assert logprobs.text_offset[0] == 0
        for i in range(5):
            assert logprobs.text_offset[i + 1] == logprobs.text_offset[i] + len(logprobs.tokens[i])
        for token, token_logprob, top_logprobs in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
            assert token_logprob <= 0.0
            assert len(top_logprobs) in (max(top, 1), top + 1)
            assert top_logprobs[token] == pytest.approx(token_logprob)
            assert all(value <= 0.0 for value in top_logprobs.values())
            # Greedy picks the most likely token.
            assert token_logprob == pytest.approx(max(top_logprobs.values()))
    streamed_tokens, streamed_offsets = [], []
    for chunk in complete(client, PROMPT, max_tokens=6, temperature=0, ignore_eos=True, logprobs=2, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed_tokens += chunk.choices[0].logprobs.tokens
            streamed_offsets += chunk.choices[0].logprobs.text_offset
    assert streamed_tokens == logprobs.tokens
    assert streamed_offsets == logprobs.text_offset


def test_chat_logprobs(client):
    response = chat(client, max_tokens=5, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=4)
    choice = response.choices[0]
    content = choice.logprobs.content
    assert len(content) == 5
    assert "".join(entry.token for entry in content) == choice.message.content
    for entry in content:
        assert entry.logprob <= 0.0
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 4
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert [alt.logprob for alt in entry.top_logprobs] == sorted(
            (alt.logprob for alt in entry.top_logprobs), reverse=True
        )
    plain = chat(client, max_tokens=5, temperature=0, ignore_eos=True, logprobs=True)
    assert all(entry.top_logprobs == [] for entry in plain.choices[0].logprobs.content)
    assert chat(client, max_tokens=2, temperature=0).choices[0].logprobs is None


def test_echo_prepends_the_prompt(client, http):
    expected = greedy_text(client, PROMPT, max_tokens=5)
    echoed = complete(client, PROMPT, echo=True, max_tokens=5, temperature=0, ignore_eos=True)
    assert echoed.choices[0].text == PROMPT + expected
    tokens = tokenize(http, prompt=PROMPT)["tokens"]
    echoed_ids = complete(client, tokens, echo=True, max_tokens=5, temperature=0, ignore_eos=True)
    assert echoed_ids.choices[0].text.startswith(PROMPT)
    chunks = list(complete(client, PROMPT, echo=True, max_tokens=5, temperature=0, ignore_eos=True, stream=True))
    assert chunks[0].choices[0].text == PROMPT
    assert "".join(chunk.choices[0].text for chunk in chunks) == PROMPT + expected


def test_skip_special_tokens(client):
    forced = {"logit_bias": {str(EOS_ID): 100}, "ignore_eos": True, "max_tokens": 3, "temperature": 0}
    shown = complete(client, PROMPT, skip_special_tokens=False, **forced)
    assert shown.choices[0].text == "<|im_end|>" * 3
    hidden = complete(client, PROMPT, **forced)
    assert "<|im_end|>" not in hidden.choices[0].text
    assert hidden.choices[0].text == ""
    chat_shown = chat(client, skip_special_tokens=False, **forced)
    assert chat_shown.choices[0].message.content == "<|im_end|>" * 3


def test_add_generation_prompt(client, http):
    with_prompt = tokenize(http, messages=CHAT, add_generation_prompt=True)
    without = tokenize(http, messages=CHAT, add_generation_prompt=False)
    assert with_prompt["count"] > without["count"]
    assert with_prompt["tokens"][: without["count"]] == without["tokens"]
    assert chat(client, max_tokens=1).usage.prompt_tokens == with_prompt["count"]
    assert chat(client, max_tokens=1, add_generation_prompt=False).usage.prompt_tokens == without["count"]


def test_continue_final_message(client, http):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, the"}]
    closed = tokenize(http, messages=messages, add_generation_prompt=False)
    # Closed, the final message ends "<|im_end|>", "\n"; continued, the prompt stops right after "Sure, the".
    assert closed["tokens"][-2] == EOS_ID
    closed_response = chat(client, messages, max_tokens=2, add_generation_prompt=False)
    assert closed_response.usage.prompt_tokens == closed["count"]
    continued_response = chat(client, messages, max_tokens=2, add_generation_prompt=False, continue_final_message=True)
    assert continued_response.usage.prompt_tokens == closed["count"] - 2
    # /tokenize must render a chat the way chat completions will.
    continued = tokenize(http, messages=messages, add_generation_prompt=False, continue_final_message=True)
    assert continued["tokens"] == closed["tokens"][:-2]


def test_user_field_is_accepted(client):
    expected = greedy_text(client, PROMPT, max_tokens=4)
    assert greedy_text(client, PROMPT, max_tokens=4, user="user-1234") == expected
    assert chat(client, max_tokens=2, user="user-1234").usage.completion_tokens <= 2


def test_text_part_content_equals_string_content(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]
    as_parts = chat(client, parts, max_tokens=6, temperature=0, ignore_eos=True)
    as_string = chat(client, CHAT, max_tokens=6, temperature=0, ignore_eos=True)
    assert as_parts.usage.prompt_tokens == as_string.usage.prompt_tokens
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content


# ---------------------------------------------------------------------------------------------------------------------
# Errors: OpenAI's shape, the right status, never 422 or 500


@dataclass(frozen=True)
class Bad:
    name: str
    path: str
    body: dict[str, Any] | bytes
    status: int = 400
    param: str | tuple[str, ...] | None = None  # None: not checked
    message: str = ""
    content_type: str = "application/json"


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **fields}


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": CHAT, "max_tokens": 4, **fields}


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


# ---------------------------------------------------------------------------------------------------------------------
# Auth


def test_auth_on_every_protected_route(root, anonymous):
    protected = [
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", completion()),
        ("POST", "/v1/chat/completions", chat_body()),
        ("POST", "/tokenize", {"prompt": "hi"}),
        ("POST", "/detokenize", {"tokens": [1, 2]}),
        ("GET", "/v1/does-not-exist", None),
    ]
    for method, path, body in protected:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": API_KEY}, {"Authorization": ""}):
            response = anonymous.request(method, path, json=body, headers=headers)
            error = assert_openai_error(response, 401)
            assert error["type"] == "AuthenticationError"
            assert response.headers.get("www-authenticate") == "Bearer"
        with_key = anonymous.request(method, path, json=body, headers=AUTH)
        assert with_key.status_code == (404 if "does-not-exist" in path else 200), (path, with_key.text)
    for path in ("/health", "/metrics", "/version"):
        assert anonymous.get(path).status_code == 200, path


@pytest.mark.parametrize(
    "target",
    [
        "/conf/v1/../v1/models",
        "/conf//v1/models",
        "/conf/v1/models/",
        "/conf/V1/models",
        "/conf/health/../v1/models",
        "/conf/metrics/../v1/models",
        "/conf/./v1/models",
        "/conf/v1/models?x=/health",
        "/conf/v1%2fmodels",
        "/conf/%2e%2e/conf/v1/models",
        "/conf/health/%2e%2e/v1/models",
        "/conf/v1/models#/health",
        "/conf/health%00/../v1/models",
        "http://127.0.0.1/conf/v1/models",
    ],
)
def test_path_tricks_do_not_skip_auth(serve_port, root, target):
    status, reply = raw_request(serve_port, "GET", target)
    assert status in (400, 401, 404), reply[:400]
    assert b'"object": "list"' not in reply and b'"object":"list"' not in reply


def test_spoofed_host_does_not_skip_auth(serve_port, root):
    for host in ("localhost", "evil.example", "127.0.0.1:1", "internal"):
        status, reply = raw_request(serve_port, "GET", "/conf/v1/models", {"Host": host})
        assert status in (400, 401, 404), (host, reply[:400])
    for forwarded in (
        {"X-Forwarded-For": "127.0.0.1"},
        {"X-Original-URL": "/conf/health"},
        {"X-Forwarded-Prefix": "/x"},
    ):
        status, reply = raw_request(serve_port, "GET", "/conf/v1/models", forwarded)
        assert status == 401, (forwarded, reply[:400])
    status, _ = raw_request(serve_port, "GET", "/conf/v1/models", AUTH)
    assert status == 200


# ---------------------------------------------------------------------------------------------------------------------
# CORS


def test_cors(anonymous, http):
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    allowed = anonymous.options("/v1/chat/completions", headers={"Origin": ORIGIN, **preflight})
    assert allowed.status_code in (200, 204)
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in allowed.headers["access-control-allow-methods"]
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    denied = anonymous.options("/v1/chat/completions", headers={"Origin": "https://evil.example", **preflight})
    assert "access-control-allow-origin" not in denied.headers
    assert "access-control-allow-methods" not in denied.headers
    # Actual requests: the allowed origin can read the answer (errors included), another origin cannot.
    ok = http.get("/v1/models", headers={"Origin": ORIGIN})
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    unauthorized = anonymous.get("/v1/models", headers={"Origin": ORIGIN})
    assert unauthorized.status_code == 401
    assert unauthorized.headers["access-control-allow-origin"] == ORIGIN
    other = http.get("/v1/models", headers={"Origin": "https://evil.example"})
    assert other.status_code == 200
    assert "access-control-allow-origin" not in other.headers
    assert "access-control-allow-origin" not in http.get("/v1/models").headers


# ---------------------------------------------------------------------------------------------------------------------
# Afterwards: still serving, nothing leaked


def test_still_serving_and_every_kv_block_free(client, anonymous, greedy_reference):
    assert greedy_text(client, PROMPT, max_tokens=24) == greedy_reference["text"]
    assert chat(client, max_tokens=3).choices[0].message.content is not None
    samples = wait_until_idle(anonymous)
    assert metric(samples, "vllm:kv_cache_usage_perc") == 0.0
    assert metric(samples, "pagedserve:kv_cache_usage_perc") == 0.0
    assert anonymous.get("/health").status_code == 200


def test_seed_outside_int64_is_400_and_engine_survives(client, http, anonymous):
    """Last on purpose: a seed torch cannot take must be refused, not reach (and kill) the engine."""
    for seed in (2**64, -(2**63) - 1):
        response = http.post("/v1/completions", json=completion(seed=seed, temperature=1.0))
        assert response.status_code not in (422, 500, 503), response.text
        error = assert_openai_error(response, 400)
        assert error["param"] == "seed", error
    assert greedy_text(client, PROMPT, max_tokens=4)
    assert anonymous.get("/health").status_code == 200
    wait_until_idle(anonymous)
