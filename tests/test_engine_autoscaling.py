"""Engine replicas that follow load (`serve.engine_autoscaling`): the policy alone, then a load ramp on a real
Serve app that scales the engines up and back down with every request succeeding, and scale to zero."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest
import ray

from configs.app_config import AppConfig, EngineAutoscalingConfig
from serve_app.engine_autoscaler import ScalingDecider
from serve_app.engine_router import prefix_key, prefix_owner
from serve_app.engines import existing_engines

# Scaling waits on the autoscaler's wall-clock windows.
pytestmark = pytest.mark.alone


def decider(**overrides) -> ScalingDecider:
    values = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2, "upscale_delay_s": 1}
    return ScalingDecider(EngineAutoscalingConfig(**{"downscale_delay_s": 5, **values, **overrides}))


def test_policy_waits_out_the_delays_and_keeps_the_bounds():
    policy = decider()
    assert policy.desired(0) == 1 and policy.desired(3) == 2 and policy.desired(100) == 4
    assert policy.target(7, current=1, now=0.0) == 1  # asked for 4: not yet
    assert policy.target(7, current=1, now=0.5) == 1
    assert policy.target(7, current=1, now=1.0) == 4
    assert policy.target(1, current=4, now=2.0) == 4  # asked for 1: not before the downscale delay
    assert policy.target(8, current=4, now=3.0) == 4  # the load came back: the downscale timer starts over
    assert policy.target(1, current=4, now=4.0) == 4
    assert policy.target(1, current=4, now=8.9) == 4
    assert policy.target(1, current=4, now=9.0) == 1


def test_policy_starts_from_zero_at_once_and_idles_down_to_zero():
    policy = decider(min_replicas=0, downscale_to_zero_delay_s=2)
    assert policy.target(1, current=0, now=0.0) == 1  # a request waits: no delay
    assert policy.target(0, current=1, now=1.0) == 1
    assert policy.target(0, current=1, now=3.0) == 0
    with pytest.raises(ValueError, match="min_replicas 3 is above max_replicas 2"):
        EngineAutoscalingConfig(min_replicas=3, max_replicas=2)


def test_prefix_owners_move_only_to_a_new_replica_or_off_a_stopped_one():
    keys = [prefix_key([index, index + 1, index + 2], 3) for index in range(2000)]
    two = {key: prefix_owner(key, [0, 1]) for key in keys}
    three = {key: prefix_owner(key, [0, 1, 2]) for key in keys}
    moved = [key for key in keys if two[key] != three[key]]
    # A third replica takes about a third of the prefixes, all from the others; none move between the old two.
    assert all(three[key] == 2 for key in moved) and 500 < len(moved) < 830
    assert {key: prefix_owner(key, [0, 2]) for key in keys if three[key] != 1} == {
        key: owner for key, owner in three.items() if owner != 1
    }


def autoscaled_config(app_name: str, **autoscaling) -> AppConfig:
    return AppConfig.model_validate(
        {
            "model": {"name": "tiny-random-llama"},
            "cache": {"num_kv_blocks": 256},
            "parallel": {"worker_num_cpus": 0.5, "num_threads": 1},
            "serve": {
                "app_name": app_name,
                "route_prefix": f"/{app_name}",
                "ingress_num_cpus": 0.1,
                "engine_autoscaling": autoscaling,
            },
        }
    )


def replica_gauges(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    gauges = dict(re.findall(r'^pagedserve:engine_replicas\{[^}]*state="(\w+)"[^}]*\} ([0-9.]+)$', text, re.M))
    target = re.search(r"^pagedserve:engine_replicas_target\{[^}]*\} ([0-9.]+)$", text, re.M)
    return {**{state: float(value) for state, value in gauges.items()}, "target": float(target.group(1))}


def wait_for_gauges(base: str, timeout_s: float, **expected: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        gauges = replica_gauges(base)
        if all(gauges.get(key) == value for key, value in expected.items()):
            return gauges
        assert time.monotonic() < deadline, f"replica gauges {gauges}, waited for {expected}"
        time.sleep(0.25)


async def completion(client: httpx.AsyncClient, url: str, max_tokens: int) -> dict:
    response = await client.post(
        f"{url}/completions", json={"prompt": [7, 8, 9, 10], "max_tokens": max_tokens, "ignore_eos": True}
    )
    assert response.status_code == 200, response.text
    return response.json()


async def ramp(base: str, streams: int, until_running: int, timeout_s: float) -> tuple[list[dict], float]:
    """Keeps `streams` requests in flight until the gauges show `until_running` engines, then lets them finish.
    Returns every response and the most engines seen running."""
    url = f"{base}/v1"
    results: list[dict] = []
    most_running = 0.0
    stop = asyncio.Event()

    async def stream(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            results.append(await completion(client, url, 64))
        # A long last request: it is still running on its engine when scale-down picks that engine.
        results.append(await completion(client, url, 256))

    async with httpx.AsyncClient(timeout=300) as client:
        tasks = [asyncio.create_task(stream(client)) for _ in range(streams)]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and most_running < until_running:
            most_running = max(most_running, (await asyncio.to_thread(replica_gauges, base)).get("running", 0))
            await asyncio.sleep(0.25)
        stop.set()
        await asyncio.gather(*tasks)
    return results, most_running


@pytest.mark.serve
def test_a_load_ramp_scales_engines_up_and_back_down(deploy_app):
    config = autoscaled_config(
        "autoscale-ramp",
        min_replicas=1,
        max_replicas=3,
        target_ongoing_requests=2,
        upscale_delay_s=0.5,
        downscale_delay_s=1,
    )
    base = deploy_app(config)
    assert wait_for_gauges(base, 30, running=1, target=1)
    results, most_running = asyncio.run(ramp(base, streams=8, until_running=3, timeout_s=180))
    assert most_running == 3
    assert all(result["usage"]["completion_tokens"] in (64, 256) for result in results)
    assert sum(result["usage"]["completion_tokens"] == 256 for result in results) == 8
    # Idle again: back to the minimum, the stopped engines' actors (and their workers) gone.
    wait_for_gauges(base, 90, running=1, draining=0, starting=0, target=1)
    deadline = time.monotonic() + 30
    while len(existing_engines(config, "autoscale-ramp")) != 1:
        assert time.monotonic() < deadline, "stopped engine actors are still alive"
        time.sleep(0.25)


@pytest.mark.serve
def test_scale_to_zero_and_back(deploy_app):
    config = autoscaled_config(
        "autoscale-zero", min_replicas=0, max_replicas=1, downscale_delay_s=1, downscale_to_zero_delay_s=1
    )
    base = deploy_app(config)
    # One replica starts to learn the engine's limits, then idles down to none.
    wait_for_gauges(base, 60, running=0, target=0, draining=0)
    deadline = time.monotonic() + 30
    while existing_engines(config, "autoscale-zero"):
        assert time.monotonic() < deadline, "the idle engine actor is still alive"
        time.sleep(0.25)
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200

    async def two_requests() -> list[dict]:
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(completion(client, f"{base}/v1", 8) for _ in range(2)))

    # The first requests wait for a replica to start, then run.
    results = asyncio.run(two_requests())
    assert [result["usage"]["completion_tokens"] for result in results] == [8, 8]
    assert replica_gauges(base)["running"] == 1
    engines = existing_engines(config, "autoscale-zero")
    assert len(engines) == 1 and ray.get(engines[0].stats.remote(), timeout=30).num_tracked_requests == 0
