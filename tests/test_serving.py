"""The OpenAI server for real: Ray Serve ingress -> scheduler actor -> worker actors, over HTTP, with the
official `openai` SDK as the client."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest
import ray

from configs.app_config import AppConfig
from configs.sampling_params import SamplingParams
from serve_app.engines import ENGINE_NAMESPACE, engine_actor_name
from tests.helpers import ray_actors
from tests.test_parity import SMOLLM2_PROMPTS, random_prompts

pytestmark = [pytest.mark.serve, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
SMOL_APP = AppConfig.model_validate(
    {
        "cache": {"num_kv_blocks": 512},
        # Planned ahead: the default with one worker (TP = PP = 1), pinned so this module serves that path.
        "scheduler": {"max_num_seqs": 32, "async_scheduling": True},
        "parallel": {"worker_num_cpus": 1},
        "serve": {"app_name": "smol", "route_prefix": "/smol", "ingress_num_cpus": 0.1},
    }
)


def engine_of(config: AppConfig):
    return ray.get_actor(engine_actor_name(config.serve.app_name), namespace=ENGINE_NAMESPACE)


@pytest.fixture(scope="module")
def smol_url(deploy_module_app):
    return f"{deploy_module_app(SMOL_APP)}/v1"


@pytest.fixture(scope="module")
def client(smol_url):
    from openai import OpenAI

    return OpenAI(base_url=smol_url, api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def offline_greedy(smollm2_llm):
    """What the offline LLM says for each prompt: the server must say the same."""
    params = SamplingParams(temperature=0.0, max_tokens=24)
    outputs = smollm2_llm.generate(SMOLLM2_PROMPTS, params, use_tqdm=False)
    return {prompt: output.outputs[0].text for prompt, output in zip(SMOLLM2_PROMPTS, outputs)}


def wait_until_idle(config: AppConfig, timeout_s: float = 30.0) -> dict:
    engine = engine_of(config)
    deadline = time.monotonic() + timeout_s
    while True:
        stats = ray.get(engine.stats.remote(), timeout=10)
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.num_free_blocks == stats.num_kv_blocks:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle after {timeout_s}s: {stats}")
        time.sleep(0.2)


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [model.id for model in models.data] == [MODEL]


def test_completion_greedy_equals_offline(client, offline_greedy):
    for prompt, expected in offline_greedy.items():
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert response.choices[0].text == expected
        assert response.choices[0].finish_reason in ("length", "stop")
        assert response.usage.completion_tokens <= 24
        assert response.id.startswith("cmpl-")


def test_streamed_completion_equals_non_streamed(client, offline_greedy):
    prompt = SMOLLM2_PROMPTS[1]
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == offline_greedy[prompt]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_completion_streaming_and_not(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
    text = response.choices[0].message.content
    assert "Paris" in text
    assert response.choices[0].finish_reason == "stop"
    assert response.id.startswith("chatcmpl-")
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sixteen_concurrent_streams_all_finish_right(smol_url, offline_greedy):
    from openai import AsyncOpenAI

    prompts = [SMOLLM2_PROMPTS[index % len(SMOLLM2_PROMPTS)] for index in range(16)]

    async def one(client: AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def all_of_them() -> list[str]:
        async with AsyncOpenAI(base_url=smol_url, api_key="unused", timeout=300, max_retries=0) as client:
            return await asyncio.gather(*(one(client, prompt) for prompt in prompts))

    texts = asyncio.run(all_of_them())
    assert texts == [offline_greedy[prompt] for prompt in prompts]
    wait_until_idle(SMOL_APP)


def test_topology_is_separate_actors(smol_url):
    topology = ray.get(engine_of(SMOL_APP).topology.remote(), timeout=30)
    worker_pids = {worker["pid"] for worker in topology.workers}
    assert len(topology.workers) == 1
    assert topology.engine_pid not in worker_pids
    assert os.getpid() not in worker_pids | {topology.engine_pid}


def aborted_requests(smol_url: str) -> float:
    text = httpx.get(f"{smol_url.removesuffix('/v1')}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line
    )


def test_disconnect_mid_stream_frees_blocks(smol_url):
    aborted_before = aborted_requests(smol_url)
    # Long enough that only an abort, not the natural end, can free it within the wait below.
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{smol_url}/completions", json=body) as response:
        assert response.status_code == 200
        received = 0
        for line in response.iter_lines():
            if line.startswith("data: "):
                received += 1
            if received == 3:
                break  # leaving the block closes the connection mid-stream
    # Serve propagates the disconnect through its proxy; on a loaded 2-core box that can take a while.
    stats = wait_until_idle(SMOL_APP, timeout_s=90)
    assert stats.num_free_blocks == stats.num_kv_blocks
    assert aborted_requests(smol_url) == aborted_before + 1


def test_bad_request_is_400_and_server_keeps_serving(client, smol_url):
    response = httpx.post(f"{smol_url}/completions", json={"model": MODEL, "prompt": "hi " * 9000}, timeout=60)
    assert response.status_code == 400
    assert "maximum context length" in response.json()["error"]["message"]
    unknown = httpx.post(f"{smol_url}/completions", json={"model": "nope", "prompt": "hi"}, timeout=60)
    assert unknown.status_code == 404
    assert unknown.json()["error"]["param"] == "model"
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].finish_reason == "length"


def test_tiny_tp2_pp2_over_http_equals_single_rank(deploy_app, tiny_model_dir):
    """The tiny preset through Serve on 4 worker actors (TP=2 x PP=2) answers like one rank offline."""
    from openai import OpenAI

    from executor import LLM

    prompts = random_prompts(4, seed=31)
    offline = LLM(model=str(tiny_model_dir), show_progress=False, num_kv_blocks=128)
    expected = [
        output.outputs[0].text
        for output in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    ]
    config = AppConfig.from_yaml("configs/tiny-tp2-pp2.yaml")
    client = OpenAI(base_url=f"{deploy_app(config)}/v1", api_key="unused", timeout=120, max_retries=0)
    response = client.completions.create(model="tiny-random-llama", prompt=prompts, max_tokens=16, temperature=0)
    assert [choice.text for choice in sorted(response.choices, key=lambda c: c.index)] == expected
    topology = ray.get(engine_of(config).topology.remote(), timeout=30)
    assert sorted((w["pp_rank"], w["tp_rank"]) for w in topology.workers) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({w["pid"] for w in topology.workers}) == 4


def test_the_ingress_replica_froze_its_start_up_heap(smol_url):
    """The tokenizer and Serve's code are out of the cyclic GC's full collections, as in the scheduler actor."""

    def frozen_objects(_actor) -> int:  # nested: travels to the replica by value
        import gc

        return gc.get_freeze_count()

    (replica,) = ray_actors(f"ServeReplica:{SMOL_APP.serve.app_name}:")
    handle = ray.get_actor(replica["Name"], namespace="serve")
    assert ray.get(handle.__ray_call__.remote(frozen_objects), timeout=30) > 10_000
