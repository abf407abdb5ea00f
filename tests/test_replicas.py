"""Several engine replicas (each its own scheduler actor, workers and placement group) behind one ingress."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
import ray

from configs.app_config import AppConfig
from serve_app.engine_router import merge_expositions, prefix_key, prefix_owner
from serve_app.engines import ENGINE_NAMESPACE, engine_actor_name


def replica_config(routing: str) -> AppConfig:
    return AppConfig.model_validate(
        {
            "model": {"name": "tiny-random-llama"},
            "cache": {"num_kv_blocks": 128},
            "parallel": {"worker_num_cpus": 0.5, "num_threads": 1},
            "serve": {
                "app_name": f"replicas-{routing}",
                "route_prefix": f"/{routing}",
                "ingress_num_cpus": 0.1,
                "engine_replicas": 2,
                "routing": routing,
                "routing_prefix_tokens": 32,
            },
        }
    )


def generated_tokens_per_engine(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    pattern = r'^vllm:generation_tokens_total\{[^}]*engine="(\d+)"[^}]*\} ([0-9.e+]+)$'
    return {engine: float(value) for engine, value in re.findall(pattern, text, flags=re.MULTILINE)}


async def send_all(url: str, prompts: list[list[int]]) -> list[dict]:
    async with httpx.AsyncClient(timeout=120) as client:
        responses = await asyncio.gather(
            *(
                client.post(f"{url}/completions", json={"prompt": prompt, "max_tokens": 4, "ignore_eos": True})
                for prompt in prompts
            )
        )
    return [response.json() for response in responses]


@pytest.mark.serve
@pytest.mark.parametrize("routing", ["least_loaded", "prefix"])
def test_two_engine_replicas(deploy_app, routing):
    config = replica_config(routing)
    base = deploy_app(config)
    engines = [
        ray.get_actor(engine_actor_name(config.serve.app_name, index), namespace=ENGINE_NAMESPACE) for index in range(2)
    ]
    pids = {ray.get(engine.topology.remote()).engine_pid for engine in engines}
    assert len(pids) == 2  # two scheduler actors, each with its own workers
    if routing == "least_loaded":
        prompts = [[10 + index, 11, 12, 13] for index in range(16)]
        results = asyncio.run(send_all(f"{base}/v1", prompts))
        assert all(result["usage"]["completion_tokens"] == 4 for result in results)
        per_engine = generated_tokens_per_engine(base)
        assert set(per_engine) == {"0", "1"} and all(tokens > 0 for tokens in per_engine.values())
        assert sum(per_engine.values()) >= 16 * 4
    else:
        shared = list(range(100, 140))  # longer than routing_prefix_tokens
        owner = str(prefix_owner(prefix_key(shared, 32), [0, 1]))
        prompts = [[*shared, 500 + index] for index in range(8)]
        results = asyncio.run(send_all(f"{base}/v1", prompts))
        assert all(result["usage"]["completion_tokens"] == 4 for result in results)
        per_engine = generated_tokens_per_engine(base)
        assert per_engine[owner] >= 8 * 4
        assert per_engine.get(str(1 - int(owner)), 0.0) == 0.0


def test_merge_expositions_keeps_one_header_per_family():
    first = b'# HELP a doc\n# TYPE a counter\na_total{engine="0"} 1.0\n'
    second = b'# HELP a doc\n# TYPE a counter\na_total{engine="1"} 2.0\n'
    merged = merge_expositions([first, second]).decode().splitlines()
    assert merged == ["# HELP a doc", "# TYPE a counter", 'a_total{engine="0"} 1.0', 'a_total{engine="1"} 2.0']
