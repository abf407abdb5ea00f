"""Overload and time limits: a bounded queue answers 503 + Retry-After, a request over its time limit answers
504 (or an SSE error), and every admitted request still completes with no KV block leaked."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import ray

from configs.app_config import AppConfig
from serve_app.engines import ENGINE_NAMESPACE, engine_actor_name

pytestmark = [pytest.mark.serve, pytest.mark.alone]

CONFIG = AppConfig.model_validate(
    {
        "model": {"name": "tiny-random-llama"},
        "cache": {"num_kv_blocks": 128},
        "scheduler": {"max_num_seqs": 1, "max_waiting_requests": 2},
        "parallel": {"worker_num_cpus": 0.5, "num_threads": 1},
        "serve": {"app_name": "limits", "route_prefix": "/limits", "ingress_num_cpus": 0.1, "request_timeout_s": 0.5},
    }
)


@pytest.fixture(scope="module")
def base(deploy_module_app):
    return deploy_module_app(CONFIG)


def wait_until_idle(timeout_s: float = 30) -> dict:
    engine = ray.get_actor(engine_actor_name(CONFIG.serve.app_name), namespace=ENGINE_NAMESPACE)
    deadline = time.monotonic() + timeout_s
    while True:
        stats = ray.get(engine.stats.remote())
        if stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_kv_blocks:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)


def test_full_queue_is_503_with_retry_after_and_admitted_requests_finish(base):
    body = {"prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(f"{base}/v1/completions", json=body) for _ in range(10)))

    responses = asyncio.run(burst())
    statuses = [response.status_code for response in responses]
    assert set(statuses) <= {200, 503}
    refused = [response for response in responses if response.status_code == 503]
    assert refused, statuses  # one running + two waiting cannot hold ten
    assert all(response.headers.get("retry-after") == "1" for response in refused)
    assert all("overloaded" in response.json()["error"]["message"] for response in refused)
    admitted = [response.json() for response in responses if response.status_code == 200]
    assert admitted and all(result["usage"]["completion_tokens"] == 40 for result in admitted)
    wait_until_idle()


def test_request_over_its_time_limit_is_504_and_freed(base):
    # Two 1,900-token completions of the tiny model, one after the other (max_num_seqs 1): 3x the 0.5 s limit or more.
    body = {"prompt": [5, 6, 7], "max_tokens": 1900, "n": 2, "ignore_eos": True}
    started = time.monotonic()
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert response.status_code == 504
    assert "did not finish within 0.5 s" in response.json()["error"]["message"]
    assert time.monotonic() - started < 20
    with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=60) as stream:
        events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == 504
    wait_until_idle()
