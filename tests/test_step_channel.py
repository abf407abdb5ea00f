"""Steps from the scheduler actor to the model workers: over a socket per worker (the default) or as Ray actor calls.

The channel itself is tested on real sockets in this process; both transports through a real scheduler actor and
worker actor on the session's Ray cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import socket
import threading
import time

import pytest
import ray

from configs.sampling_params import SamplingParams
from executor.errors import EngineDeadError
from executor.step_channel import StepChannel, StepChannelClosedError, frame, open_step_listener
from model_executor.step_plan import StepPlan
from tests.test_engine_actor import collect, start_engine


class WorkerGone(BaseException):
    """Not an Exception: the step server does not reply to it, its loop ends and its socket closes, as when the
    worker's process dies."""


def start_on_a_thread(loop) -> None:
    def run() -> None:
        with contextlib.suppress(WorkerGone):
            loop()

    threading.Thread(target=run, daemon=True).start()


def double_or_fail(value: int) -> int:
    if value == GONE:
        raise WorkerGone
    if value < 0:
        raise ValueError(f"negative step {value}")
    return 2 * value


GONE = 99


def test_the_channel_runs_steps_in_order_reports_failures_and_refuses_strangers():
    host, port, secret = open_step_listener("127.0.0.1", double_or_fail, start_on_a_thread)

    async def drive() -> None:
        # A connection without the secret is closed, and the real one still gets in after it.
        stranger = socket.create_connection((host, port), timeout=10)
        stranger.sendall(frame(b"x" * len(secret)))
        assert stranger.recv(1) == b""
        stranger.close()
        channel = await StepChannel.connect(host, port, secret, "test worker")
        replies = [channel.send(pickle.dumps(value)) for value in (1, 2, -3, 4, GONE, 5)]
        assert await replies[0] == 2 and await replies[1] == 4
        with pytest.raises(RuntimeError, match="test worker failed a step") as failure:
            await replies[2]
        assert "ValueError: negative step -3" in str(failure.value)
        assert await replies[3] == 8  # a failed step does not end the channel; the engine decides that
        # The worker's end going away fails what is pending at once, and every later send.
        for reply in replies[4:]:
            with pytest.raises(StepChannelClosedError, match="the worker is gone"):
                await asyncio.wait_for(reply, 10)
        with pytest.raises(StepChannelClosedError):
            await channel.send(pickle.dumps(6))

    asyncio.run(asyncio.wait_for(drive(), 30))


@pytest.fixture(params=["socket", "ray"])
def engine_on(request, ray_cluster, tiny_model_dir):
    actor = start_engine(tiny_model_dir, transport=request.param)
    yield request.param, actor
    ray.kill(actor)


def test_both_transports_give_the_offline_engines_greedy_tokens(engine_on, make_llm, tiny_model_dir):
    transport, engine = engine_on
    prompts = {"a": [5, 6, 7], "b": [9, 10, 11, 12, 13], "c": [3] * 20}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for request_id, prompt in prompts.items():
        ray.get(engine.add_request.remote("client", request_id, prompt, params), timeout=30)
    served = collect(engine, "client", set(prompts))["tokens"]
    offline = make_llm(tiny_model_dir, num_kv_blocks=64, num_threads=1).generate(
        list(prompts.values()), params, use_tqdm=False
    )
    assert served == {rid: out.outputs[0].token_ids for rid, out in zip(prompts, offline, strict=True)}
    worker = ray.get(engine.worker_handles.remote(), timeout=30)[0]
    if transport == "socket":
        # Steps run only where the channel sends them: an actor call must not start a second one beside it.
        with pytest.raises(ray.exceptions.RayTaskError, match="serves its step channel"):
            ray.get(worker.execute.remote(StepPlan()), timeout=30)
    else:
        assert ray.get(worker.execute.remote(StepPlan()), timeout=30).request_ids == []


def test_a_killed_worker_fails_the_running_request_fast_on_either_transport(engine_on):
    _, engine = engine_on
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    ray.get(engine.add_request.remote("client", "long", [5, 6, 7], params), timeout=30)
    ray.get(engine.get_outputs.remote("client"), timeout=30)
    started = time.monotonic()
    ray.kill(ray.get(engine.worker_handles.remote(), timeout=30)[0])
    with pytest.raises(ray.exceptions.RayTaskError) as failure:
        for _ in range(100):
            ray.get(engine.get_outputs.remote("client"), timeout=30)
    assert isinstance(failure.value.as_instanceof_cause(), EngineDeadError)
    assert time.monotonic() - started < 30
    # The engine rebuilds itself (a new worker, a new channel) and serves again.
    deadline = time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline, "no rebuild"
        with contextlib.suppress(ray.exceptions.RayTaskError):
            if ray.get(engine.stats.remote(), timeout=30).num_rebuilds == 1:
                break
        time.sleep(0.5)
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ray.get(engine.add_request.remote("client-2", "after", [5, 6, 7], short), timeout=30)
    assert len(collect(engine, "client-2", {"after"})["tokens"]["after"]) == 4


def test_the_ingress_reads_outputs_over_either_transport_and_the_output_channel_refuses_strangers(engine_on):
    from serve_app.engine_client import EngineClient

    transport, engine = engine_on
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    async def read_all() -> dict[str, list[int]]:
        client = EngineClient(engine, transport=transport)
        for request_id in ("x", "y"):
            await client.submit(request_id, [5, 6, 7], params)
        tokens = {}
        for request_id in ("x", "y"):
            chunks = [output async for outputs in client.outputs(request_id, 1) for output in outputs]
            tokens[request_id] = [token for output in chunks for token in output.new_token_ids]
            assert chunks[-1].finish_reason == "length"
        # Over sockets the client holds one connection to the engine's output server, kept for the next request.
        assert (client.output_channel is not None) == (transport == "socket")
        return tokens

    tokens = asyncio.run(asyncio.wait_for(read_all(), 120))
    assert len(tokens["x"]) == 10 and tokens["x"] == tokens["y"]  # the same prompt, greedy
    if transport == "socket":
        host, port, _ = ray.get(engine.open_output_channel.remote(), timeout=30)
        stranger = socket.create_connection((host, port), timeout=10)
        stranger.sendall(frame(b"x" * 16 + b"someone-else"))
        assert stranger.recv(1) == b""  # hung up on, nothing sent
        stranger.close()


def test_an_ingress_whose_output_connection_closes_is_forgotten_at_once(ray_cluster, tiny_model_dir):
    from executor.engine_actor import REQUEST_LEASE_S
    from executor.step_channel import HEADER_BYTES

    engine = start_engine(tiny_model_dir)
    try:
        ray.get(engine.attach.remote("survivor"), timeout=60)
        ray.get(engine.attach.remote("crashed"), timeout=60)
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        ray.get(engine.add_request.remote("crashed", "doomed", [5, 6, 7], long), timeout=30)
        host, port, secret = ray.get(engine.open_output_channel.remote(), timeout=30)
        connection = socket.create_connection((host, port), timeout=10)
        connection.sendall(frame(secret + b"crashed"))
        assert len(connection.recv(HEADER_BYTES)) == HEADER_BYTES  # outputs were streaming to it
        # The ingress's process dies: its kernel closes the socket with unread outputs in it (a reset).
        connection.close()
        # Forgotten well before its lease would run out: its request aborted, its blocks free, and only the live
        # ingress left attached, so that one's detach alone ends a shared engine.
        deadline = time.monotonic() + REQUEST_LEASE_S / 2
        while True:
            stats = ray.get(engine.stats.remote(), timeout=10)
            idle = stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_kv_blocks
            if idle and stats.num_clients == 1:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.2)
        assert ray.get(engine.detach.remote("survivor"), timeout=30) == 0
    finally:
        ray.kill(engine)
