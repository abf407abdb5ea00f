"""A dead worker: the stream in flight ends with one SSE error chunk and `data: [DONE]`, /health says 503 while
the scheduler actor rebuilds its workers, and then the same endpoint serves again."""

from __future__ import annotations

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
        "parallel": {"worker_num_cpus": 0.5, "num_threads": 1},
        "serve": {"app_name": "faults", "route_prefix": "/faults", "ingress_num_cpus": 0.1},
    }
)


def test_worker_death_mid_stream_ends_with_error_chunk_and_done(deploy_app):
    base = deploy_app(CONFIG)
    engine = ray.get_actor(engine_actor_name(CONFIG.serve.app_name), namespace=ENGINE_NAMESPACE)
    body = {"prompt": [5, 6, 7], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    events: list[str] = []
    started = time.monotonic()
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{base}/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line.removeprefix("data: "))
            if len(events) == 3:
                ray.kill(ray.get(engine.worker_handles.remote())[0])
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and "engine" in error["message"]
    assert all("choices" in json.loads(event) for event in events[:-2])
    assert time.monotonic() - started < 60  # an error, fast, never a hang
    # Down while the scheduler actor rebuilds its workers, then serving again on its own.
    refused = httpx.post(f"{base}/v1/completions", json={"prompt": [5], "max_tokens": 2}, timeout=30)
    assert refused.status_code == 503
    assert refused.json()["error"]["type"] == "ServiceUnavailableError"
    health = [httpx.get(f"{base}/health", timeout=30).status_code]
    deadline = time.monotonic() + 180
    while health[-1] != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
        health.append(httpx.get(f"{base}/health", timeout=30).status_code)
    assert health[0] == 503 and health[-1] == 200
    answer = httpx.post(f"{base}/v1/completions", json={"prompt": [5, 6], "max_tokens": 3}, timeout=60)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
    stats = ray.get(engine.stats.remote())
    assert stats.num_rebuilds == 1
    assert stats.num_free_blocks == stats.num_kv_blocks
