"""The scheduler actor on its own: outputs batched per client, health, and a dead worker surfacing fast."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import ray

from configs.engine_config import EngineConfig
from configs.sampling_params import SamplingParams
from executor.engine_actor import OUTPUT_STREAM_AHEAD, EngineActor, open_output_stream
from executor.errors import EngineDeadError


def start_engine(model_dir, **config):
    actor = (
        ray.remote(EngineActor)
        .options(num_cpus=0)
        .remote(EngineConfig(model=str(model_dir), num_kv_blocks=64, worker_num_cpus=0.5, num_threads=1, **config))
    )
    ray.get(actor.engine_info.remote(), timeout=120)
    return actor


@pytest.fixture
def engine(ray_cluster, tiny_model_dir):
    actor = start_engine(tiny_model_dir)
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
    assert stats.num_waiting == 0 and stats.num_running == 0


def test_dead_worker_fails_requests_fast_and_health_says_so(engine):
    ray.get(engine.check_health.remote(), timeout=30)
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    ray.get(engine.add_request.remote("client-b", "long", [5, 6, 7], params))
    ray.get(engine.get_outputs.remote("client-b"), timeout=30)
    (worker_identity,) = ray.get(engine.topology.remote()).workers
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


def _kill_and_wait(actor, timeout_s: float = 30) -> None:
    """ray.kill returns before the process is gone: a call in between can still be answered."""
    ray.kill(actor)
    deadline = time.monotonic() + timeout_s
    while True:
        assert time.monotonic() < deadline, "the killed actor still answers"
        try:
            ray.get(actor.__ray_call__.remote(lambda _actor: None), timeout=10)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            continue  # dying: its death is not known yet
        time.sleep(0.1)


def test_start_up_heap_is_frozen_and_a_rebuild_lets_the_failed_engine_go(engine):
    """What the scheduler actor and its worker load at start-up is out of the cyclic GC's full collections (each
    rescan of it stalled every stream); after a rebuild the failed engine is gone, not kept, and the new one frozen.

    The core itself is freed by reference counting, so this passes with or without the thaw before the rebuild;
    the thaw is for whatever of the old engine only the cyclic GC can free."""

    # Nested, so they travel to the actors by value.
    def _frozen_objects(_actor) -> int:
        import gc

        return gc.get_freeze_count()

    assert ray.get(engine.__ray_call__.remote(_frozen_objects), timeout=30) > 10_000
    assert ray.get(_worker_handle(engine).__ray_call__.remote(_frozen_objects), timeout=30) > 1_000

    def watch_core(actor) -> None:
        import weakref

        actor.watched_core = weakref.ref(actor.core)

    ray.get(engine.__ray_call__.remote(watch_core), timeout=30)
    _kill_and_wait(_worker_handle(engine))  # an idle engine learns of it from the health check below
    with pytest.raises(ray.exceptions.RayTaskError):
        ray.get(engine.check_health.remote(), timeout=60)
    deadline = time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline, "no rebuild"
        with contextlib.suppress(ray.exceptions.RayTaskError):  # down until rebuilt
            if ray.get(engine.stats.remote(), timeout=30).num_rebuilds == 1:
                break
        time.sleep(0.5)
    assert ray.get(engine.__ray_call__.remote(lambda actor: actor.watched_core() is None), timeout=30)
    assert ray.get(engine.__ray_call__.remote(_frozen_objects), timeout=30) > 10_000
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ray.get(engine.add_request.remote("client-c", "after", [5, 6, 7], params), timeout=30)
    assert len(collect(engine, "client-c", {"after"})["tokens"]["after"]) == 4


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
            if stats.num_running == 0 and stats.num_waiting == 0:
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


def test_stream_interval_buffer_holds_tokens_until_the_interval_and_flushes_first_and_last():
    from executor.engine_core import EngineOutput
    from executor.output_router import StreamIntervalBuffer

    buffer = StreamIntervalBuffer(3)
    steps = [
        [EngineOutput("r", 0, [token], [float(token)]), EngineOutput("r", 1, [10 + token], [])] for token in range(6)
    ]
    steps.append([EngineOutput("r", 0, [6], [6.0], "length"), EngineOutput("r", 1, [16], [], "stop", 99)])
    delivered = [output for step in steps for output in map(buffer.push, step) if output is not None]
    by_index = {index: [o for o in delivered if o.index == index] for index in (0, 1)}
    assert [o.new_token_ids for o in by_index[0]] == [[0], [1, 2, 3], [4, 5, 6]]
    assert [o.new_logprobs for o in by_index[0]] == [[0.0], [1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    assert [o.new_token_ids for o in by_index[1]] == [[10], [11, 12, 13], [14, 15, 16]]
    assert (by_index[1][-1].finish_reason, by_index[1][-1].stop_reason) == ("stop", 99)
    assert steps[1][0].new_token_ids == [1]  # the engine's outputs are not modified
    assert len(buffer) == 0  # finished completions leave nothing behind

    assert buffer.push(EngineOutput("s", 0, [1], [])) is not None
    assert buffer.push(EngineOutput("s", 0, [2], [])) is None
    buffer.drop("s", 0)
    assert len(buffer) == 0
    assert StreamIntervalBuffer(1).push(steps[0][0]) is steps[0][0]


def test_stream_interval_sends_tokens_in_chunks_with_the_same_tokens(ray_cluster, tiny_model_dir, engine):
    """stream_interval=4: the first token alone, then chunks of four, the rest with the finish; nothing lingers."""
    chunked = start_engine(tiny_model_dir, stream_interval=4)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def read(actor, request_id: str) -> list[list[int]]:
        """Each output as the scheduler actor handed it on (an ingress reader that falls behind merges them)."""
        client_id = f"client-{request_id}"
        ray.get(actor.add_request.remote(client_id, request_id, [5, 6, 7], params), timeout=30)
        chunks: list[list[int]] = []
        finished = False
        deadline = time.monotonic() + 120
        while not finished:
            assert time.monotonic() < deadline, "the stream did not finish"
            for output in ray.get(actor.get_outputs.remote(client_id), timeout=30):
                chunks.append(output.new_token_ids)
                finished = output.finish_reason is not None
        return chunks

    try:
        chunks = read(chunked, "chunked")
        every_step = read(engine, "every-step")
        assert [len(chunk) for chunk in chunks] == [1, 4, 4, 1]
        assert [token for chunk in chunks for token in chunk] == [token for chunk in every_step for token in chunk]

        # A stream aborted while tokens are held leaves nothing behind in the scheduler actor.
        long_params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
        ray.get(chunked.add_request.remote("client-c", "aborted", [5, 6, 7], long_params), timeout=30)
        ray.get(chunked.get_outputs.remote("client-c"), timeout=30)
        time.sleep(0.3)
        ray.get(chunked.abort.remote(["aborted"]), timeout=30)
        stats = ray.get(chunked.stats.remote(), timeout=30)
        assert stats.num_tracked_requests == 0 and stats.num_free_blocks == stats.num_kv_blocks
    finally:
        ray.kill(chunked)


def test_async_scheduling_gives_the_same_tokens_as_one_step_at_a_time(ray_cluster, tiny_model_dir, engine):
    """An engine that plans each step while the previous one runs (the default with one worker) gives the tokens,
    finishes and logprobs of one that waits for every step, and no block stays taken."""
    async_engine, sync_engine = engine, start_engine(tiny_model_dir, async_scheduling=False)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    requests = {
        "greedy": ([5, 6, 7], greedy),
        "one-token": ([8, 9], SamplingParams(temperature=0, max_tokens=1)),
        "seeded-n2": ([5, 6, 7, 8], SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=9, ignore_eos=True)),
        "logprobs": ([11, 12, 13] * 7, SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True)),
    }
    # Greedy's third token as a stop token: the request ends there, with steps already planned behind it.
    probe = "probe"
    ray.get(sync_engine.add_request.remote("client-p", probe, [5, 6, 7], greedy), timeout=30)
    third_token = collect_completions(sync_engine, "client-p", {(probe, 0)})[(probe, 0)]["tokens"][2]
    requests["stop-token"] = ([5, 6, 7], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[third_token]))

    def run(actor, client_id: str) -> dict:
        for request_id, (prompt, params) in requests.items():
            ray.get(actor.add_request.remote(client_id, request_id, prompt, params), timeout=30)
        keys = {(request_id, index) for request_id, (_, params) in requests.items() for index in range(params.n)}
        return collect_completions(actor, client_id, keys)

    try:
        pipelined, stepwise = run(async_engine, "client-async"), run(sync_engine, "client-sync")
        # Batches may group differently, so float sums may round differently: logprobs match closely, tokens exactly.
        for key, completion in pipelined.items():
            assert (completion["tokens"], completion["finish"]) == (stepwise[key]["tokens"], stepwise[key]["finish"])
            logprobs = [entry.logprob for entry in completion["logprobs"]]
            assert logprobs == pytest.approx([entry.logprob for entry in stepwise[key]["logprobs"]], abs=1e-4)
        assert len(pipelined[("greedy", 0)]["tokens"]) == 12 and len(pipelined[("seeded-n2", 1)]["tokens"]) == 9
        assert pipelined[("stop-token", 0)]["tokens"][-1] == third_token
        assert pipelined[("stop-token", 0)]["finish"] == ("stop", third_token)
        assert [len(entry.top_logprobs) for entry in pipelined[("logprobs", 0)]["logprobs"]] == [2] * 5
        for actor, pipelines in ((async_engine, True), (sync_engine, False)):
            stats = ray.get(actor.stats.remote(), timeout=30)
            assert stats.num_running == 0 and stats.num_free_blocks == stats.num_kv_blocks
            assert (stats.num_steps_planned_ahead > stats.num_steps / 2) == pipelines
    finally:
        ray.kill(sync_engine)  # the async one is the fixture's


def collect_completions(engine, client_id: str, keys: set[tuple[str, int]], timeout_s: float = 60) -> dict:
    """(request id, index) -> its tokens, logprobs and (finish_reason, stop_reason), read until all finished."""
    completions = {key: {"tokens": [], "logprobs": [], "finish": None} for key in keys}
    deadline = time.monotonic() + timeout_s
    while any(completion["finish"] is None for completion in completions.values()):
        assert time.monotonic() < deadline, f"unfinished: {[k for k, c in completions.items() if c['finish'] is None]}"
        for output in ray.get(engine.get_outputs.remote(client_id), timeout=30):
            completion = completions[(output.request_id, output.index)]
            completion["tokens"].extend(output.new_token_ids)
            completion["logprobs"].extend(output.new_logprobs)
            if output.finish_reason is not None:
                completion["finish"] = (output.finish_reason, output.stop_reason)
    return completions


def test_output_stream_carries_every_token_and_ends_when_nothing_is_left(engine):
    """The ingress's stream: every token of every request of the client, a batch per step, and the stream ends by
    itself once the client has nothing in flight; another client's requests are not in it."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ray.get([engine.add_request.remote("client-s", f"s{i}", [5, 6, 7 + i], params) for i in range(3)])
    ray.get(engine.add_request.remote("client-other", "o0", [5, 6, 9], params))
    tokens: dict[str, list[int]] = {}
    num_batches = 0
    deadline = time.monotonic() + 60
    for batch_ref in open_output_stream(engine, "client-s"):
        assert time.monotonic() < deadline, "the stream did not end"
        num_batches += 1
        for output in ray.get(batch_ref, timeout=30):
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert {request_id: len(ids) for request_id, ids in tokens.items()} == {"s0": 8, "s1": 8, "s2": 8}
    assert num_batches < 3 * 8 / 2  # a batch holds every request's tokens of a step
    # The other client's request is still there for its own reader, whole.
    assert sum(len(output.new_token_ids) for output in collect_all(engine, "client-other", {"o0"})) == 8
    assert ray.get(engine.stats.remote()).num_tracked_requests == 0


def collect_all(engine, client_id: str, request_ids: set[str]) -> list:
    outputs, finished = [], set()
    deadline = time.monotonic() + 60
    while finished != request_ids:
        assert time.monotonic() < deadline
        for output in ray.get(engine.get_outputs.remote(client_id), timeout=30):
            outputs.append(output)
            finished |= {output.request_id} if output.finish_reason is not None else set()
    return outputs


def test_a_lagging_stream_reader_gets_the_steps_it_missed_in_one_batch(engine):
    """Backpressure holds the stream while its reader lags; what the steps made meanwhile arrives merged into the
    next batch, in order, nothing lost."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ray.get(engine.add_request.remote("client-l", "lag", [5, 6, 7], params))
    stream = open_output_stream(engine, "client-l", ahead=1)
    first = ray.get(next(stream), timeout=30)
    time.sleep(2.0)  # the engine runs on: ~40 tiny-model steps
    batch_sizes = [sum(len(output.new_token_ids) for output in first)]
    for batch_ref in stream:
        batch_sizes.append(sum(len(output.new_token_ids) for output in ray.get(batch_ref, timeout=30)))
    assert sum(batch_sizes) == 40
    assert max(batch_sizes[1:4]) > 5, batch_sizes  # the missed steps came together, not one per step


def test_a_newer_stream_of_the_same_client_supersedes_the_older(engine):
    """An ingress that starts a new stream (its pump restarted) gets everything from then on; the older stream ends
    at its next wake-up without taking anything, so every token reaches exactly one of them."""
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    ray.get(engine.add_request.remote("client-n", "n0", [5, 6, 7], params))

    def num_tokens(batch_ref) -> int:
        return sum(len(output.new_token_ids) for output in ray.get(batch_ref, timeout=30))

    older = open_output_stream(engine, "client-n")
    older_tokens = num_tokens(next(older))
    newer = open_output_stream(engine, "client-n")
    newer_tokens = num_tokens(next(newer))
    older_rest = list(older)
    assert len(older_rest) <= OUTPUT_STREAM_AHEAD  # only what it had yielded before the newer one started
    older_tokens += sum(map(num_tokens, older_rest))
    newer_tokens += sum(map(num_tokens, newer))
    assert older_tokens + newer_tokens == 200 and newer_tokens > 150


def test_a_burst_of_requests_is_queued_in_one_call_and_a_bad_one_is_refused_alone(engine):
    """add_requests (what an ingress sends for requests that arrive together): each bad request comes back as its
    own refusal, the others run to the end, nothing of the refused one is left behind."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    refusals = ray.get(
        engine.add_requests.remote(
            "client-burst",
            [("b0", [5, 6, 7], params), ("b-bad", [10**6], params), ("b1", [5, 6, 8], params)],
        ),
        timeout=30,
    )
    assert refusals[0] is None and refusals[2] is None
    assert isinstance(refusals[1], ValueError) and "out of the vocabulary" in str(refusals[1])
    result = collect(engine, "client-burst", {"b0", "b1"})
    assert {request_id: len(ids) for request_id, ids in result["tokens"].items()} == {"b0": 6, "b1": 6}
    stats = ray.get(engine.stats.remote())
    assert stats.num_tracked_requests == 0 and stats.num_free_blocks == stats.num_kv_blocks
