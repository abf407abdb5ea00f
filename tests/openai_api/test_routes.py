"""Routes: models, tokenize, detokenize, version, health, metrics and request ids."""

from __future__ import annotations

import pytest

from tests.openai_api.common import (
    CHAT,
    MAX_MODEL_LEN,
    MODEL,
    PROMPT,
    VOCAB_SIZE,
    complete,
    greedy_text,
    metric,
    parse_metrics,
    tokenize,
    wait_until_idle,
)

pytestmark = pytest.mark.serve


def test_models_lists_the_served_name(client, http):
    assert [model.id for model in client.models.list().data] == [MODEL]
    body = http.get("/v1/models").json()
    assert body["object"] == "list"
    assert body["data"][0]["object"] == "model"
    assert body["data"][0]["max_model_len"] == MAX_MODEL_LEN


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
