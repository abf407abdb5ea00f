"""Faults on one real Ray + Serve app over HTTP, deployed once for the module: a storm of disconnecting clients, a
forward pass that raises on one rank, the scheduler actor killed, an ingress replica killed, and last, graceful
shutdown in-process. Every fault ends in a fast error for the requests it hit, nothing leaks, and the same endpoint
serves again."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
import time
from typing import Any

import httpx
import pytest
import ray

from executor.engine_actor import REQUEST_LEASE_S
from serve_app.engines import engine_actor_name
from tests.fault_helpers import (
    APP,
    CONFIG,
    FAIL_FAST_S,
    LONG,
    aborted_requests,
    assert_all_gone,
    assert_ends_with_error,
    completes,
    engine,
    engine_parts,
    health_until_ok,
    idle_stats,
    stream_events,
    wait_until,
)
from tests.helpers import ray_actors

pytestmark = [pytest.mark.serve, pytest.mark.alone]

# Graceful shutdown: the long request needs ten times the short one's decode steps (and fits the 2048-token context).
SHORT_TOKENS, LONG_TOKENS = 200, 2000
# Time to refuse a request and read /health while draining, before the grace period runs out.
MIN_GRACE_S = 3.0


@pytest.fixture(scope="module")
def base(deploy_module_app) -> str:
    return deploy_module_app(CONFIG)


# ---------------------------------------------------------------------------------------------------------------------
# Disconnects


async def disconnecting_client(client: httpx.AsyncClient, base: str, index: int, rng: random.Random) -> str:
    """One request, dropped while submitting, while queued, or mid-stream. Non-streaming requests and one streaming
    request in five leave after a random delay, and say "left mid-stream" where a token had come first (the engine
    was running it), "left" otherwise. The other streaming requests leave right after their k-th token (k random):
    "left after tokens", whatever the machine's speed."""
    stream = index % 4 != 0
    body = {**LONG, "prompt": [5, 6, 7 + index % 50], "stream": stream}
    leave_after_tokens = rng.randint(1, 20) if stream and index % 5 != 0 else None
    leave_after_s = rng.uniform(0, 0.3) if index % 5 == 0 else rng.uniform(0.3, 3.0)
    num_tokens = 0

    async def request() -> str:
        nonlocal num_tokens
        async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
            async for chunk in response.aiter_raw():
                num_tokens += chunk.count(b'"text"')
                if leave_after_tokens is not None and num_tokens >= leave_after_tokens:
                    return "left after tokens"  # leaving the block closes the connection
        return "finished"

    try:
        # The token-counting clients wait their turn behind the 16 running requests: they get a long bound.
        return await asyncio.wait_for(request(), 120 if leave_after_tokens is not None else leave_after_s)
    except TimeoutError:
        return "left mid-stream" if num_tokens else "left"


def test_disconnect_storm_frees_every_block_and_the_server_still_serves(base):
    baseline = wait_until(idle_stats, 60, "idle engine")
    aborted_before = aborted_requests(base)

    async def storm() -> list[str]:
        rng = random.Random(8)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*(disconnecting_client(client, base, index, rng) for index in range(200)))

    outcomes = asyncio.run(storm())
    assert "finished" not in outcomes
    # 1800 tokens each, 16 at a time: only aborts can empty the engine this fast.
    after = wait_until(idle_stats, 20, "engine idle after the storm")
    assert after.num_free_blocks == baseline.num_free_blocks == baseline.num_kv_blocks
    # The 120 streaming clients that count tokens all left a running request; so did any other that got a token.
    assert outcomes.count("left after tokens") == 120, outcomes
    left_running = outcomes.count("left after tokens") + outcomes.count("left mid-stream")
    assert aborted_requests(base) - aborted_before >= left_running
    assert all(completes(base) for _ in range(3))


# ---------------------------------------------------------------------------------------------------------------------
# Failures inside the engine


def test_exception_in_the_forward_pass_on_one_rank_fails_fast_and_the_engine_recovers(base):
    def break_forward(worker: Any) -> None:
        """Runs inside one model worker (via __ray_call__; nested, so it travels by value): its next forward
        pass raises."""

        def fail(plan: Any) -> Any:
            raise RuntimeError("injected fault in the forward pass")

        worker.runner.execute = fail

    wait_until(idle_stats, 60, "idle engine")
    rebuilds_before = ray.get(engine().stats.remote(), timeout=30).num_rebuilds
    workers = ray.get(engine().worker_handles.remote(), timeout=30)
    assert len(workers) == 2

    def inject(count: int) -> None:
        if count == 3:
            ray.get(workers[1].__ray_call__.remote(break_forward), timeout=30)

    started = time.monotonic()
    events = stream_events(base, {**LONG, "stream": True}, inject)
    assert time.monotonic() - started < FAIL_FAST_S
    assert_ends_with_error(events, 503, "injected fault in the forward pass")
    assert health_until_ok(base)[-1] == 200
    assert completes(base)
    stats = wait_until(idle_stats, 30, "idle engine")
    assert stats.num_rebuilds == rebuilds_before + 1
    # Rank 0 was stuck in its all-reduce: the rebuild replaced both workers.
    assert not {worker._actor_id.hex() for worker in workers} & {
        worker._actor_id.hex() for worker in ray.get(engine().worker_handles.remote(), timeout=30)
    }


def test_scheduler_actor_death_fails_fast_and_the_ingress_recreates_it(base):
    wait_until(idle_stats, 60, "idle engine")
    old = engine_parts(engine())
    non_streamed: dict[str, Any] = {}

    def post_non_streamed() -> None:
        response = httpx.post(f"{base}/v1/completions", json=LONG, timeout=120)
        non_streamed.update(status=response.status_code, body=response.json())

    thread = threading.Thread(target=post_non_streamed)

    def kill(count: int) -> None:
        if count == 1:
            thread.start()
        if count == 5:
            ray.kill(engine())

    started = time.monotonic()
    events = stream_events(base, {**LONG, "stream": True}, kill)
    thread.join(timeout=FAIL_FAST_S)
    assert time.monotonic() - started < FAIL_FAST_S
    assert_ends_with_error(events, 503, "engine")
    assert non_streamed["status"] == 503, non_streamed
    assert non_streamed["body"]["error"]["type"] == "ServiceUnavailableError"
    # Down while the ingress starts a new scheduler actor (and its workers), then serving again on its own.
    statuses = health_until_ok(base)
    assert statuses[0] == 503 and statuses[-1] == 200, statuses
    assert completes(base)
    new = engine_parts(engine())
    assert new["engine"] != old["engine"]
    assert_all_gone(old)
    assert wait_until(idle_stats, 30, "idle engine")


def test_ingress_replica_death_the_new_replica_readopts_the_engine(base):
    wait_until(idle_stats, 60, "idle engine")
    before = engine_parts(engine())
    (replica,) = ray_actors(f"ServeReplica:{APP}:")
    outcome: dict[str, Any] = {}

    def kill_replica(count: int) -> None:
        if count == 3:
            ray.kill(ray.get_actor(replica["Name"], namespace="serve"))

    started = time.monotonic()
    try:
        outcome["events"] = stream_events(base, {**LONG, "stream": True}, kill_replica)
    except httpx.HTTPError as error:
        outcome["error"] = error
    # The stream in flight on the dead replica ends at once, and not as a finished completion.
    assert time.monotonic() - started < FAIL_FAST_S
    assert "error" in outcome or "error" in outcome["events"][-2], outcome
    # Serve starts a new replica, which adopts the running engine by name: same actor, same workers.
    wait_until(lambda: completes(base), 180, "a completion after the replica died")
    (new_replica,) = ray_actors(f"ServeReplica:{APP}:")
    assert new_replica["ActorID"] != replica["ActorID"]
    assert engine_parts(engine()) == before
    engines = [actor for actor in ray_actors("EngineActor") if actor["Name"] == engine_actor_name(APP)]
    assert len(engines) == 1
    # The dead replica's output connection closed with its process: the engine forgot it then, aborting its request
    # and freeing its blocks, so the new replica is the one ingress still attached.
    assert wait_until(idle_stats, REQUEST_LEASE_S, "the dead replica's request aborted")
    assert ray.get(engine().stats.remote(), timeout=10).num_clients == 1


# ---------------------------------------------------------------------------------------------------------------------
# Graceful shutdown


def test_graceful_shutdown_refuses_new_requests_finishes_or_ends_the_rest_and_leaves_nothing(base):
    from ray import serve

    from cluster.serve import app_exists, shutdown

    wait_until(idle_stats, 60, "idle engine")
    assert app_exists(CONFIG)
    parts = engine_parts(engine())
    # The grace period comes from this machine's speed: three times what the short request takes alone, well under
    # what the long one (ten times the tokens) needs, whatever the CPU.
    started = time.monotonic()
    stream_events(base, {**LONG, "max_tokens": SHORT_TOKENS, "stream": True})
    grace_s = max(3 * (time.monotonic() - started), MIN_GRACE_S)
    logging.getLogger(__name__).info("grace period %.1f s", grace_s)
    results: dict[str, list[str]] = {}
    streaming = {name: threading.Event() for name in ("short", "long")}

    def run(name: str, max_tokens: int) -> None:
        body = {**LONG, "max_tokens": max_tokens, "stream": True}
        results[name] = stream_events(base, body, on_event=lambda _: streaming[name].set())

    short = threading.Thread(target=run, args=("short", SHORT_TOKENS))
    long = threading.Thread(target=run, args=("long", LONG_TOKENS))
    short.start()
    long.start()
    # Both admitted before the drain starts (a token streamed each); the short one may already be done.
    assert all(event.wait(30) for event in streaming.values()), "both streaming"
    stopper = threading.Thread(target=shutdown, args=(CONFIG, grace_s, False))
    stopper.start()
    wait_until(lambda: ray.get(engine().stats.remote(), timeout=10).draining, 30, "draining")
    refused = httpx.post(f"{base}/v1/completions", json={"prompt": [5], "max_tokens": 2}, timeout=30)
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    assert httpx.get(f"{base}/health", timeout=30).status_code == 503
    for thread in (short, long, stopper):
        thread.join(timeout=90)
        assert not thread.is_alive()
    # The short request finished normally; the long one was ended when the grace period ran out.
    assert results["short"][-1] == "[DONE]" and "error" not in results["short"][-2]
    assert json.loads(results["short"][-2])["choices"][0]["finish_reason"] == "length"
    assert_ends_with_error(results["long"], 503, "shut down before this request finished")
    assert APP not in serve.status().applications and not app_exists(CONFIG)
    # The last ingress's detach ends the engine at once, not an orphan timeout later: a replica that died in an
    # earlier test no longer counts as attached.
    assert_all_gone(parts, FAIL_FAST_S)
    assert not ray_actors(f"ServeReplica:{APP}:")
