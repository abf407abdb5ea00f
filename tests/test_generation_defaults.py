"""The model's generation_config.json as the server's sampling defaults (model.generation_config auto | vllm), and
model.max_logprobs as the limit on logprobs, through the real server and the `openai` SDK."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import httpx
import openai
import pytest

from configs.app_config import AppConfig
from configs.engine_config import EngineConfig
from serve_app.serving import generation_defaults

MODEL = "tiny"
PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Hello"}]
MAX_MODEL_LEN = 64
MAX_LOGPROBS = 3
# What the model's authors ship: 5 new tokens, greedy.
SHIPPED = {"bos_token_id": 1, "eos_token_id": 2, "max_new_tokens": 5, "temperature": 0.0, "top_p": 0.9}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("generation-defaults") / "tiny"
    shutil.copytree(tiny_model_dir, directory)
    (directory / "generation_config.json").write_text(json.dumps(SHIPPED))
    return directory


def app_config(model_dir: Path, generation_config: str) -> AppConfig:
    return AppConfig.model_validate(
        {
            "model": {
                "name": str(model_dir),
                "served_model_name": MODEL,
                "max_model_len": MAX_MODEL_LEN,
                "generation_config": generation_config,
                "max_logprobs": MAX_LOGPROBS,
            },
            "cache": {"num_kv_blocks": 64},
            "parallel": {"worker_num_cpus": 0.5, "num_threads": 1},
            "serve": {
                "app_name": f"gen-{generation_config}",
                "route_prefix": f"/gen-{generation_config}",
                "ingress_num_cpus": 0.1,
            },
        }
    )


@pytest.fixture(scope="module")
def auto_url(deploy_module_app, model_dir: Path) -> str:
    return f"{deploy_module_app(app_config(model_dir, 'auto'))}/v1"


@pytest.fixture(scope="module")
def auto(auto_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=auto_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def vllm(deploy_module_app, model_dir: Path) -> openai.OpenAI:
    url = f"{deploy_module_app(app_config(model_dir, 'vllm'))}/v1"
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


IGNORE_EOS = {"extra_body": {"ignore_eos": True}}


def test_defaults_are_read_validated_and_logged(model_dir: Path, tmp_path: Path, caplog):
    caplog.set_level(logging.INFO, logger="model_executor.model_info")
    expected = {"max_tokens": 5, "temperature": 0.0, "top_p": 0.9}
    assert generation_defaults(EngineConfig(model=str(model_dir))) == expected
    assert "Default sampling parameters have been overridden by the model's generation config" in caplog.text
    assert generation_defaults(EngineConfig(model=str(model_dir), generation_config="vllm")) == {}

    # A value no request could carry is left out (with a warning), not turned into a 400 for every request.
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "generation_config.json").write_text(json.dumps({"top_p": 0.0, "top_k": 20}))
    caplog.clear()
    assert generation_defaults(EngineConfig(model=str(broken))) == {"top_k": 20}
    assert "ignoring the model's generation config top_p=0.0" in caplog.text


@pytest.mark.serve
def test_a_completion_without_max_tokens_gets_the_models_default(auto):
    response = auto.completions.create(model=MODEL, prompt=PROMPT, **IGNORE_EOS)
    (choice,) = response.choices
    assert response.usage.completion_tokens == 5 and choice.finish_reason == "length"
    # The shipped temperature 0 makes it greedy: the same as asking for temperature 0.
    greedy = auto.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, **IGNORE_EOS)
    assert choice.text == greedy.choices[0].text
    again = auto.completions.create(model=MODEL, prompt=PROMPT, **IGNORE_EOS)
    assert again.choices[0].text == choice.text


@pytest.mark.serve
def test_an_explicit_max_tokens_wins_over_the_models_default(auto):
    for max_tokens in (2, 9):
        response = auto.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, **IGNORE_EOS)
        assert response.usage.completion_tokens == max_tokens
        chat = auto.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=max_tokens, **IGNORE_EOS)
        assert chat.usage.completion_tokens == max_tokens


@pytest.mark.serve
def test_chat_without_max_tokens_gets_the_models_default_streamed_or_not(auto):
    response = auto.chat.completions.create(model=MODEL, messages=CHAT, **IGNORE_EOS)
    assert response.usage.completion_tokens == 5 and response.choices[0].finish_reason == "length"
    stream = auto.chat.completions.create(
        model=MODEL, messages=CHAT, stream=True, stream_options={"include_usage": True}, **IGNORE_EOS
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 5
    assert [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason] == ["length"]
    streamed = "".join(choice.delta.content or "" for chunk in chunks for choice in chunk.choices)
    assert streamed == response.choices[0].message.content


@pytest.mark.serve
def test_null_means_the_models_default(auto_url):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": None, "temperature": None, "ignore_eos": True}
    nulls = httpx.post(f"{auto_url}/completions", json=body, timeout=120)
    assert nulls.status_code == 200, nulls.text
    greedy = httpx.post(f"{auto_url}/completions", json={**body, "max_tokens": 5, "temperature": 0}, timeout=120).json()
    assert nulls.json()["usage"]["completion_tokens"] == 5
    assert nulls.json()["choices"][0]["text"] == greedy["choices"][0]["text"]


@pytest.mark.serve
def test_the_models_default_is_capped_by_the_room_the_prompt_leaves(auto):
    prompt = [5] * (MAX_MODEL_LEN - 2)
    response = auto.completions.create(model=MODEL, prompt=[prompt, [5, 6, 7]], **IGNORE_EOS)
    assert [choice.finish_reason for choice in response.choices] == ["length", "length"]
    assert response.usage.completion_tokens == 2 + 5
    # The client's own max_tokens is never cut: too many is a 400.
    with pytest.raises(openai.BadRequestError, match="maximum context length is 64 tokens"):
        auto.completions.create(model=MODEL, prompt=prompt, max_tokens=5)


@pytest.mark.serve
def test_generation_config_vllm_ignores_the_models_file(vllm):
    response = vllm.completions.create(model=MODEL, prompt=PROMPT, **IGNORE_EOS)
    assert response.usage.completion_tokens == 16  # OpenAI's default, not the model's 5
    chat = vllm.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=7, **IGNORE_EOS)
    assert chat.usage.completion_tokens == 7


@pytest.mark.serve
def test_logprobs_above_max_logprobs_is_a_400_naming_the_field_and_the_limit(auto):
    response = auto.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logprobs=MAX_LOGPROBS)
    assert all(len(top) == MAX_LOGPROBS for top in response.choices[0].logprobs.top_logprobs)
    with pytest.raises(openai.BadRequestError) as refused:
        auto.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logprobs=MAX_LOGPROBS + 1)
    error = refused.value.body
    assert error["param"] == "logprobs" and "at most 3" in error["message"] and "max_logprobs" in error["message"]

    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            auto.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=2, logprobs=True, top_logprobs=MAX_LOGPROBS + 1, stream=stream
            )
        assert refused.value.body["param"] == "top_logprobs" and "at most 3" in refused.value.body["message"]
