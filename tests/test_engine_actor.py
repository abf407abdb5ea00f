"""The scheduler actor on its own: outputs batched per client, health, and a dead worker surfacing fast."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from configs.engine_config import EngineConfig
from configs.sampling_params import SamplingParams
from executor.engine_actor import EngineActor
from executor.executors import EngineDeadError


@pytest.fixture
def engine(ray_cluster, tiny_model_dir):
    actor = (
        ray.remote(EngineActor)
        .options(num_cpus=0)
        .remote(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, worker_num_cpus=0.5, num_threads=1))
    )
    ray.get(actor.engine_info.remote(), timeout=120)
    yield actor
    ray.kill(actor)


def collect(engine, client_id: str, request_ids: set[str], timeout_s: float = 60) -> dict:
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    calls = 0
    deadline = time.monotonic() + timeout_s
    while finished != request_ids:
        assert time.monotonic() < deadline, f"unfinished: {request_ids - finished}"
        for output in ray.get(engine.get_outputs.remote(client_id), timeout=30):
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finish_reason is not None:
                finished.add(output.request_id)
        calls += 1
    return {"tokens": tokens, "calls": calls}


def test_outputs_come_batched_per_client(engine):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    request_ids = {f"r{index}" for index in range(6)}
    ray.get([engine.add_request.remote("client-a", rid, [5, 6, 7 + i], params) for i, rid in enumerate(request_ids)])
    result = collect(engine, "client-a", request_ids)
    assert all(len(tokens) == 8 for tokens in result["tokens"].values())
    # Six requests of eight tokens: one Ray call carries every request's tokens of a step, not one per token.
    assert result["calls"] < 6 * 8 / 2


def test_bad_request_raises_value_error_and_queues_nothing(engine):
    with pytest.raises(ValueError, match="out of the vocabulary"):
        ray.get(engine.add_request.remote("client-a", "bad", [10**6], SamplingParams()))
    stats = ray.get(engine.stats.remote())
    assert stats["num_waiting"] == 0 and stats["num_running"] == 0


def test_dead_worker_fails_requests_fast_and_health_says_so(engine):
    ray.get(engine.check_health.remote(), timeout=30)
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    ray.get(engine.add_request.remote("client-b", "long", [5, 6, 7], params))
    ray.get(engine.get_outputs.remote("client-b"), timeout=30)
    (worker_identity,) = ray.get(engine.topology.remote())["workers"]
    assert worker_identity["pp_rank"] == 0
    start = time.monotonic()
    ray.kill(_worker_handle(engine))
    with pytest.raises(ray.exceptions.RayTaskError) as failure:
        for _ in range(100):
            ray.get(engine.get_outputs.remote("client-b"), timeout=30)
    assert isinstance(failure.value.as_instanceof_cause(), EngineDeadError)
    with pytest.raises(ray.exceptions.RayTaskError):
        ray.get(engine.check_health.remote(), timeout=60)
    assert time.monotonic() - start < 30


def _worker_handle(engine):
    return ray.get(engine.worker_handles.remote())[0]


def test_a_reader_that_falls_behind_gets_the_piled_up_steps_as_one_output(engine):
    """Steps produced while nobody read come as one output per completion, the same tokens in the same order."""
    from serve_app.engine_client import EngineClient

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def read(client: EngineClient, request_id: str, wait_for_finish: bool) -> list[list]:
        await client.submit(request_id, [5, 6, 7], params)
        deadline = time.monotonic() + 60
        while wait_for_finish:
            assert time.monotonic() < deadline, "the request did not finish"
            stats = await engine.stats.remote()
            if stats["num_running"] == 0 and stats["num_waiting"] == 0:
                break
            await asyncio.sleep(0.05)
        if wait_for_finish:
            await asyncio.sleep(0.2)  # the pump's last poll lands in the queue
        return [list(outputs) async for outputs in client.outputs(request_id, 1)]

    async def scenario() -> tuple[list, list]:
        client = EngineClient(engine)
        lagging = await asyncio.wait_for(read(client, "lagging", wait_for_finish=True), 120)
        keeping_up = await asyncio.wait_for(read(client, "kept-up", wait_for_finish=False), 120)
        return lagging, keeping_up

    lagging, keeping_up = asyncio.run(scenario())
    assert len(lagging) == 1 and len(lagging[0]) == 1
    (merged,) = lagging[0]
    assert merged.finish_reason == "length" and len(merged.new_token_ids) == 12
    step_tokens = [token for outputs in keeping_up for output in outputs for token in output.new_token_ids]
    assert merged.new_token_ids == step_tokens  # the same greedy tokens as a reader that kept up


def test_merge_outputs_keeps_each_completions_tokens_in_order():
    from executor.engine_core import EngineOutput
    from serve_app.engine_client import merge_outputs

    steps = [
        [EngineOutput("r", 0, [1], []), EngineOutput("r", 1, [10], [])],
        [EngineOutput("r", 0, [2], []), EngineOutput("r", 1, [11], [], "stop", 7)],
        [EngineOutput("r", 0, [3], [], "length")],
    ]
    first, second = merge_outputs(steps)
    assert (first.index, first.new_token_ids, first.finish_reason) == (0, [1, 2, 3], "length")
    assert (second.index, second.new_token_ids, second.finish_reason, second.stop_reason) == (1, [10, 11], "stop", 7)
    assert steps[0][0].new_token_ids == [1]  # the engine's outputs are not modified
