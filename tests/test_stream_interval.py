"""`scheduler.stream_interval` over real HTTP with the `openai` SDK: a stream's tokens arrive in chunks (its first
token alone), with the same text and usage as a stream of one token per event, and nothing left behind."""

from __future__ import annotations

import pytest
from openai import OpenAI

from configs.app_config import AppConfig
from tests.helpers import assert_engine_drained

pytestmark = pytest.mark.serve

MODEL = "tiny-chunked"
PREFIX = "/chunked"
INTERVAL = 3
CONFIG = AppConfig.model_validate(
    {
        "model": {"name": "tiny-random-llama", "served_model_name": MODEL},
        "cache": {"num_kv_blocks": 128},
        "scheduler": {"max_num_seqs": 16, "stream_interval": INTERVAL},
        "parallel": {"worker_num_cpus": 0.5, "num_threads": 1},
        "serve": {"app_name": "chunked", "route_prefix": PREFIX, "ingress_num_cpus": 0.1},
    }
)


@pytest.fixture(scope="module")
def client(deploy_module_app) -> OpenAI:
    return OpenAI(base_url=f"{deploy_module_app(CONFIG)}/v1", api_key="unused", max_retries=0, timeout=120)


def test_tokens_stream_in_chunks_with_the_same_text_and_usage(client: OpenAI):
    kwargs = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 10, "temperature": 0}
    whole = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    chunks = list(
        client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
        )
    )
    texts = [chunk.choices[0].text for chunk in chunks if chunk.choices and chunk.choices[0].text]
    assert "".join(texts) == whole.choices[0].text
    # Ten tokens as 1 + 3 + 3 + 3: at most four text events (a token that ends mid-character may add nothing); outputs
    # that pile up while the stream is busy come merged (the server's contract), so a fast server may send fewer.
    assert 1 <= len(texts) <= 4
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 10
    finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert finish == ["length"]


def test_a_stop_string_inside_a_chunk_ends_the_stream_there(client: OpenAI):
    base = {"model": MODEL, "prompt": "The quick brown fox", "temperature": 0, "extra_body": {"ignore_eos": True}}
    text = client.completions.create(**base, max_tokens=12).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expected = text[: text.index(stop)]
    streamed = client.completions.create(**base, max_tokens=12, stop=[stop], stream=True)
    chunks = list(streamed)
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == expected
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason] == [
        "stop"
    ]


def test_nothing_lingers_in_the_engine_after_streams_end(client: OpenAI):
    for max_tokens in (7, 8, 9):
        list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=max_tokens, temperature=0, stream=True))
    assert_engine_drained(CONFIG.serve.app_name)
