"""Constants and plain helpers the conformance modules share (`from tests.openai_api.common import ...`).

The app (tests/openai_api/conftest.py) runs the tiny random Llama (random weights: gibberish text, but deterministic
under greedy) with an API key, CORS and small request limits.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import httpx
from openai import OpenAI

API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "tiny"
ORIGIN = "https://app.example"
PREFIX = "/conf"
VOCAB_SIZE = 49152
MAX_MODEL_LEN = 2048
EOS_ID = 2  # <|im_end|>
MAX_BODY_BYTES = 65536
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


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **fields}


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": CHAT, "max_tokens": 4, **fields}
