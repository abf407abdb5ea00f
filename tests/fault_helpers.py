"""Helpers the fault tests share (`from tests.fault_helpers import ...`): the app they deploy, its engine actor
seen through Ray, and the waits and HTTP checks every fault ends with. Fixtures stay in the test modules."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import ray

from configs.app_config import AppConfig
from serve_app.engines import ENGINE_NAMESPACE, engine_actor_name

APP = "faults2"
# TP=2, so "one rank" fails while the other waits in its all-reduce; few sequences run at once, so most of a storm
# waits in the queue.
CONFIG = AppConfig.model_validate(
    {
        "model": {"name": "tiny-random-llama"},
        "cache": {"num_kv_blocks": 256},
        "scheduler": {"max_num_seqs": 16},
        "parallel": {"tensor_parallel_size": 2, "worker_num_cpus": 0.5, "num_threads": 1},
        "serve": {"app_name": APP, "route_prefix": f"/{APP}", "ingress_num_cpus": 0.1},
    }
)
LONG = {"prompt": [5, 6, 7], "max_tokens": 1800, "ignore_eos": True}
FAIL_FAST_S = 30.0


def engine() -> Any:
    return ray.get_actor(engine_actor_name(APP), namespace=ENGINE_NAMESPACE)


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = predicate()
        except Exception as error:
            result, last_error = None, error
        else:
            last_error = None
        if result:
            return result
        assert time.monotonic() < deadline, f"{what} not within {timeout_s}s (last error: {last_error!r})"
        time.sleep(0.2)


def idle_stats() -> Any:
    """The engine's stats when nothing runs or waits and every KV block is free, else None."""
    stats = ray.get(engine().stats.remote(), timeout=10)
    idle = stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_kv_blocks
    return stats if idle else None


def aborted_requests(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line
    )


def completes(base: str, max_tokens: int = 3) -> bool:
    response = httpx.post(f"{base}/v1/completions", json={"prompt": [5, 6], "max_tokens": max_tokens}, timeout=60)
    return response.status_code == 200 and response.json()["usage"]["completion_tokens"] == max_tokens


def stream_events(base: str, body: dict, on_event: Callable[[int], None] | None = None) -> list[str]:
    """The `data:` payloads of one streamed completion; on_event(count) runs after each."""
    events: list[str] = []
    with httpx.Client(timeout=120) as http, http.stream("POST", f"{base}/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                if on_event is not None:
                    on_event(len(events))
    return events


def assert_ends_with_error(events: list[str], status: int, words: str) -> dict:
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == status and words in error["message"], error
    assert all("choices" in json.loads(event) for event in events[:-2])
    return error


def health_until_ok(base: str, timeout_s: float = 180) -> list[int]:
    statuses = [httpx.get(f"{base}/health", timeout=30).status_code]
    deadline = time.monotonic() + timeout_s
    while statuses[-1] != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
        statuses.append(httpx.get(f"{base}/health", timeout=30).status_code)
    return statuses


def actor_state(actor_id: str) -> str:
    return ray._private.state.actors(actor_id)["State"]


def placement_group_state(placement_group_id: str) -> str:
    from ray.util.placement_group import placement_group_table

    return placement_group_table()[placement_group_id]["state"]


def engine_parts(handle: Any) -> dict[str, Any]:
    """Actor ids of a scheduler actor and its workers, and its placement group id."""
    topology = ray.get(handle.topology.remote(), timeout=30)
    workers = ray.get(handle.worker_handles.remote(), timeout=30)
    return {
        "engine": handle._actor_id.hex(),
        "workers": [worker._actor_id.hex() for worker in workers],
        "placement_group": topology.placement_group_id,
    }


def assert_all_gone(parts: dict[str, Any], timeout_s: float = 60) -> None:
    ids = [parts["engine"], *parts["workers"]]
    wait_until(lambda: all(actor_state(actor_id) == "DEAD" for actor_id in ids), timeout_s, "old actors dead")
    wait_until(lambda: placement_group_state(parts["placement_group"]) == "REMOVED", timeout_s, "old PG removed")
