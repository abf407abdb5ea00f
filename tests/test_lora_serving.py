"""LoRA adapters over HTTP, as vLLM serves them: loaded at start (`lora_modules`) or at run time
(`/v1/load_lora_adapter`), requested by `model`, listed in `/v1/models` with their base model, mixed with base
requests in the same batches on every engine replica, unloaded again."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from openai import NotFoundError, OpenAI

from configs.app_config import AppConfig
from configs.sampling_params import SamplingParams
from executor import LLM, LoRARequest
from tests.test_lora import ALL_TARGETS, write_peft_adapter

PROMPTS = [[11, 12, 13, 14, 15, 16], [40, 41, 42], [7, 7, 8, 9, 10, 11, 12, 13]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("served-adapters")
    return {
        "alpha": write_peft_adapter(tiny_llama_dir, root / "alpha", 3, r=8, lora_alpha=16, target_modules=ALL_TARGETS),
        "beta": write_peft_adapter(tiny_llama_dir, root / "beta", 4, r=4, lora_alpha=8, target_modules=["q_proj"]),
    }


@pytest.fixture(scope="module")
def lora_app(deploy_module_app, tiny_llama_dir, adapter_dirs):
    config = AppConfig.model_validate(
        {
            "model": {"name": str(tiny_llama_dir), "served_model_name": "tiny"},
            "cache": {"num_kv_blocks": 128},
            "parallel": {"worker_num_cpus": 0.5, "num_threads": 1},
            "lora": {"enable_lora": True, "max_loras": 2, "lora_modules": [f"alpha={adapter_dirs['alpha']}"]},
            "serve": {
                "app_name": "lora-app",
                "route_prefix": "/lora-app",
                "ingress_num_cpus": 0.1,
                "engine_replicas": 2,
            },
        }
    )
    return deploy_module_app(config)


def offline_texts(model_dir, adapter_dirs) -> dict[str | None, list[str]]:
    """Each prompt's greedy text under the base model and each adapter, from the offline engine (whose adapter
    tokens tests/test_lora.py checks against PEFT merged)."""
    llm = LLM(model=str(model_dir), enable_lora=True, max_loras=2, num_kv_blocks=64, distributed_executor="uniproc")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    texts = {}
    for name in (None, "alpha", "beta"):
        request = LoRARequest(name, 1, str(adapter_dirs[name])) if name else None
        outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], params, lora_request=request)
        texts[name] = [output.outputs[0].text for output in outputs]
    return texts


async def complete_all(url: str, models: list[str]) -> list[dict]:
    async with httpx.AsyncClient(timeout=120) as client:
        responses = await asyncio.gather(
            *(
                client.post(
                    f"{url}/completions",
                    json={
                        "model": model,
                        "prompt": prompt,
                        "max_tokens": MAX_TOKENS,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                )
                for model in models
                for prompt in PROMPTS
            )
        )
    assert all(response.status_code == 200 for response in responses), [response.text for response in responses]
    return [response.json() for response in responses]


@pytest.mark.serve
def test_adapters_load_list_and_serve_beside_the_base_model(lora_app, tiny_llama_dir, adapter_dirs):
    client = OpenAI(base_url=f"{lora_app}/v1", api_key="unused", max_retries=0)
    assert [(card.id, card.parent) for card in client.models.list().data] == [("tiny", None), ("alpha", "tiny")]
    loaded = httpx.post(
        f"{lora_app}/v1/load_lora_adapter",
        json={"lora_name": "beta", "lora_path": str(adapter_dirs["beta"])},
        timeout=60,
    )
    assert loaded.status_code == 200 and "beta" in loaded.text
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {"tiny", "alpha", "beta"} and cards["beta"].parent == "tiny"
    assert cards["beta"].root == str(adapter_dirs["beta"])
    expected = offline_texts(tiny_llama_dir, adapter_dirs)
    assert expected["alpha"] != expected[None]  # the adapters change the output
    # Base and both adapters at once, twice over (both engine replicas serve every adapter).
    models = ["tiny", "alpha", "beta"] * 2
    results = asyncio.run(complete_all(f"{lora_app}/v1", models))
    for position, result in enumerate(results):
        model = models[position // len(PROMPTS)]
        assert result["model"] == model
        assert result["choices"][0]["text"] == expected[None if model == "tiny" else model][position % len(PROMPTS)]


@pytest.mark.serve
def test_bad_loads_and_unloads_are_refused_and_an_unloaded_adapter_is_gone(lora_app, adapter_dirs, tmp_path):
    url = f"{lora_app}/v1"
    missing = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)}, timeout=60)
    assert missing.status_code == 400 and "adapter_config.json" in missing.json()["error"]["message"]
    taken = httpx.post(
        f"{url}/load_lora_adapter", json={"lora_name": "alpha", "lora_path": str(adapter_dirs["beta"])}, timeout=60
    )
    assert taken.status_code == 400 and "alpha" in taken.json()["error"]["message"]
    extra = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "y", "lora_path": "p", "bogus": 1}, timeout=60)
    assert extra.status_code == 400
    loaded = httpx.post(
        f"{url}/load_lora_adapter", json={"lora_name": "gamma", "lora_path": str(adapter_dirs["beta"])}, timeout=60
    )
    assert loaded.status_code == 200
    assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "gamma"}, timeout=60).status_code == 200
    client = OpenAI(base_url=url, api_key="unused", max_retries=0)
    with pytest.raises(NotFoundError, match=r"gamma.*does not exist"):
        client.completions.create(model="gamma", prompt="hi", max_tokens=2)
    again = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "gamma"}, timeout=60)
    assert again.status_code == 404
    # The server still serves the others.
    assert client.completions.create(model="alpha", prompt="hi", max_tokens=2).choices[0].text is not None
