"""Several models behind one /v1 (`models:` in the app config): each with its own engines, routed by the request's
`model`, all listed, metrics labelled per model, an unknown model a 404 naming the served ones."""

from __future__ import annotations

import re

import httpx
import pytest
from openai import NotFoundError, OpenAI

from configs.app_config import AppConfig
from executor import LLM, SamplingParams
from serve_app.engines import existing_engines

PROMPT = [11, 12, 13, 14, 15]


def test_entries_override_the_app_sections_and_names_must_differ():
    config = AppConfig.model_validate(
        {
            "cache": {"num_kv_blocks": 64, "block_size": 8},
            "serve": {"engine_replicas": 1},
            "models": [
                {"model": "tiny-random-llama", "engine_replicas": 2},
                {"model": {"name": "tiny-random-llama", "served_model_name": "other"}, "cache": {"num_kv_blocks": 32}},
            ],
        }
    )
    first, second = config.model_apps()
    assert (first.model_name, first.serve.engine_replicas, first.cache.num_kv_blocks) == ("tiny-random-llama", 2, 64)
    assert (second.model_name, second.serve.engine_replicas, second.cache.num_kv_blocks) == ("other", 1, 32)
    assert second.cache.block_size == 8  # the app's own sections are the entries' defaults
    with pytest.raises(ValueError, match="served model names must differ"):
        AppConfig.model_validate({"models": [{"model": "tiny-random-llama"}, {"model": "tiny-random-llama"}]})
    with pytest.raises(ValueError, match="bogus"):
        AppConfig.model_validate({"models": [{"model": "tiny-random-llama", "bogus": 1}]})


@pytest.fixture(scope="module")
def two_models(deploy_module_app, family_model_dir):
    qwen_dir = family_model_dir("qwen2")
    config = AppConfig.model_validate(
        {
            "cache": {"num_kv_blocks": 128},
            "parallel": {"worker_num_cpus": 0.5, "num_threads": 1},
            "serve": {"app_name": "two-models", "route_prefix": "/two-models", "ingress_num_cpus": 0.1},
            "models": [
                {"model": {"name": "tiny-random-llama", "served_model_name": "tiny-llama"}, "engine_replicas": 2},
                {"model": {"name": str(qwen_dir), "served_model_name": "tiny-qwen"}},
            ],
        }
    )
    return config, deploy_module_app(config), {"tiny-llama": "tiny-random-llama", "tiny-qwen": str(qwen_dir)}


@pytest.mark.serve
def test_requests_reach_the_model_they_name(two_models):
    config, base, weights = two_models
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    listed = client.models.list().data
    assert [card.id for card in listed] == ["tiny-llama", "tiny-qwen"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for served_name, model_dir in weights.items():
        completion = client.completions.create(
            model=served_name, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        assert completion.model == served_name
        offline = LLM(model=model_dir, num_kv_blocks=64, distributed_executor="uniproc")
        expected = offline.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].text
        del offline
        assert completion.choices[0].text == expected
    # Each model its own engines: two for one, one for the other.
    assert len(existing_engines(config, "two-models")) == 3


@pytest.mark.serve
def test_unknown_or_missing_model_is_refused_naming_the_served_ones(two_models):
    _, base, _ = two_models
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    with pytest.raises(NotFoundError, match=r"\['tiny-llama', 'tiny-qwen'\]"):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    missing = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
    tokenized = httpx.post(f"{base}/tokenize", json={"model": "tiny-qwen", "prompt": "hello"}, timeout=60)
    assert tokenized.status_code == 200 and tokenized.json()["count"] > 0


@pytest.mark.serve
def test_metrics_are_labelled_per_model(two_models):
    _, base, _ = two_models
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    for name in ("tiny-llama", "tiny-qwen"):
        client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    text = httpx.get(f"{base}/metrics", timeout=30).text
    generated = re.findall(r'^vllm:generation_tokens_total\{[^}]*model_name="([^"]+)"[^}]*\} ([0-9.e+]+)$', text, re.M)
    assert {name for name, value in generated if float(value) > 0} == {"tiny-llama", "tiny-qwen"}
    replicas = dict(
        re.findall(r'^pagedserve:engine_replicas\{model_name="([^"]+)",state="running"\} (\d+)', text, re.M)
    )
    assert replicas == {"tiny-llama": "2", "tiny-qwen": "1"}
