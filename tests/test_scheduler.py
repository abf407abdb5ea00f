"""Scheduler: token budget and chunked prefill, step plans, recompute preemption, stop conditions, aborts and
n > 1 siblings. Driven by hand-made StepResults: no model runs."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from configs.engine_config import EngineConfig
from configs.sampling_params import SamplingParams
from executor.request import Request, RequestStatus
from executor.scheduler import RequestUpdate, Scheduler
from model_executor.step_plan import StepPlan, StepResult

EOS = 2
TOKEN = 5  # what the fake model samples unless told otherwise
BLOCK_SIZE = 4


def make_scheduler(num_blocks: int = 256, max_model_len: int | None = None, **config: object) -> Scheduler:
    """max_model_len defaults to what the cache holds, so one request can always fit on its own."""
    engine_config = EngineConfig(**{"block_size": BLOCK_SIZE, **config})
    if max_model_len is None:
        max_model_len = num_blocks * engine_config.cache.block_size
    return Scheduler(engine_config, num_blocks, max_model_len, eos_token_ids={EOS})


def make_request(
    request_id: str, prompt: list[int], max_tokens: int = 16, gate: str | None = None, **params: object
) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params), max_tokens, gate)


def prompt_of(length: int, start: int = 1000) -> list[int]:
    """Distinct token ids per start, so different requests share no prefix."""
    return list(range(start, start + length))


def sampling_ids(scheduler: Scheduler, plan: StepPlan) -> list[str]:
    """Requests that reach the end of their known tokens this step, i.e. get a sampled token (one step in flight:
    every placeholder is this plan's)."""
    return [
        request_id for request_id in plan.num_scheduled_tokens if scheduler.requests[request_id].num_output_placeholders
    ]


class FakeRunner:
    """Mirrors what the model runner keeps from the plans alone, and checks it against the scheduler.

    It also keeps a shadow KV cache holding the token id written at each (block, slot): every request must read
    back exactly its own tokens at every position it attends to, including prefix-cache hits.
    """

    def __init__(self) -> None:
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.kv: dict[tuple[int, int], int] = {}

    def apply(self, scheduler: Scheduler, plan: StepPlan) -> None:
        block_size = scheduler.kv_cache.block_size
        for request_id in plan.finished_request_ids + plan.preempted_request_ids:
            self.block_tables.pop(request_id, None)
            self.num_computed.pop(request_id, None)
        for new in plan.new_requests:
            assert new.request_id not in self.block_tables, f"{new.request_id} sent as new twice"
            self.block_tables[new.request_id] = list(new.block_ids)
            self.num_computed[new.request_id] = new.num_computed_tokens
        for cached in plan.cached_requests:
            assert cached.request_id in self.block_tables, f"{cached.request_id} sent as cached before new"
            self.block_tables[cached.request_id].extend(cached.new_block_ids)
            assert cached.num_computed_tokens == self.num_computed[cached.request_id]
        assert set(plan.num_scheduled_tokens) == {r.request_id for r in plan.new_requests} | {
            r.request_id for r in plan.cached_requests
        }
        # Every token's KV is written before attention reads any (one flattened batch per layer).
        written: dict[tuple[int, int], int] = {}
        for request_id, num in plan.num_scheduled_tokens.items():
            table, tokens = self.block_tables[request_id], scheduler.requests[request_id].token_ids
            assert table == scheduler.kv_cache.block_ids(request_id)
            start = self.num_computed[request_id]
            assert start + num <= len(table) * block_size
            assert start + num <= len(tokens)
            for position in range(start, start + num):
                slot = (table[position // block_size], position % block_size)
                assert written.setdefault(slot, tokens[position]) == tokens[position], "two tokens in one slot"
                self.kv[slot] = tokens[position]
        for request_id, num in plan.num_scheduled_tokens.items():
            table, tokens = self.block_tables[request_id], scheduler.requests[request_id].token_ids
            self.num_computed[request_id] += num
            read = [self.kv.get((table[p // block_size], p % block_size)) for p in range(self.num_computed[request_id])]
            assert read == tokens[: self.num_computed[request_id]], f"{request_id} attends to wrong KV"


def step(
    scheduler: Scheduler, token_for: Callable[[str], int] = lambda _: TOKEN, runner: FakeRunner | None = None
) -> tuple[StepPlan, list[RequestUpdate]]:
    plan = scheduler.schedule()
    assert plan.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
    if runner is not None:
        runner.apply(scheduler, plan)
    ids = sampling_ids(scheduler, plan)
    return plan, scheduler.update_from_output(plan, StepResult(ids, [[token_for(i)] for i in ids]))


def run_to_completion(
    scheduler: Scheduler, max_steps: int = 1000, runner: FakeRunner | None = None
) -> tuple[dict[str, list[int]], list[StepPlan]]:
    outputs: dict[str, list[int]] = {}
    plans = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs, plans
        plan, updates = step(scheduler, runner=runner)
        plans.append(plan)
        for update in updates:
            outputs.setdefault(update.request.request_id, []).extend(update.new_token_ids)
    raise AssertionError(f"requests still unfinished after {max_steps} steps: {list(scheduler.requests)}")


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    pool = scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert scheduler.kv_cache.request_blocks == {}


# --- token budget and chunked prefill ---------------------------------------------------------------------------------


def test_long_prompt_is_prefilled_in_budget_sized_chunks() -> None:
    scheduler = make_scheduler(num_blocks=300, max_num_batched_tokens=128)
    scheduler.add_request(make_request("a", prompt_of(1000), max_tokens=2))
    runner = FakeRunner()
    chunks = []
    for index in range(8):
        plan, updates = step(scheduler, runner=runner)
        chunks.append(plan.num_scheduled_tokens["a"])
        assert updates == [] if index < 7 else len(updates) == 1
        assert scheduler.requests["a"].num_computed_tokens == sum(chunks)
    assert chunks == [128] * 7 + [1000 - 7 * 128]
    assert scheduler.requests["a"].output_token_ids == [TOKEN]
    plan, _ = step(scheduler, runner=runner)
    assert plan.num_scheduled_tokens == {"a": 1}
    assert not scheduler.has_unfinished_requests()


def test_decodes_go_first_and_prefill_gets_the_remaining_budget() -> None:
    scheduler = make_scheduler(num_blocks=300, max_num_batched_tokens=128)
    runner = FakeRunner()
    scheduler.add_request(make_request("d1", prompt_of(10, 1), max_tokens=50))
    scheduler.add_request(make_request("d2", prompt_of(10, 100), max_tokens=50))
    step(scheduler, runner=runner)  # both prefilled, both decoding from now on
    scheduler.add_request(make_request("long", prompt_of(1000, 5000), max_tokens=5))
    plan, updates = step(scheduler, runner=runner)
    assert plan.num_scheduled_tokens == {"d1": 1, "d2": 1, "long": 126}
    assert [c.request_id for c in plan.cached_requests] == ["d1", "d2"]
    assert [n.request_id for n in plan.new_requests] == ["long"]
    assert {u.request.request_id for u in updates} == {"d1", "d2"}
    total_prefilled = 126
    while total_prefilled < 1000:
        plan, _ = step(scheduler, runner=runner)
        assert plan.num_scheduled_tokens["d1"] == 1 and plan.num_scheduled_tokens["d2"] == 1
        assert plan.num_scheduled_tokens["long"] == min(126, 1000 - total_prefilled)
        total_prefilled += plan.num_scheduled_tokens["long"]
    assert scheduler.requests["long"].num_output_tokens == 1


def test_prioritize_prefill_runs_the_whole_prompt_before_running_decodes() -> None:
    scheduler = make_scheduler(num_blocks=300, max_num_batched_tokens=128, prioritize_prefill=True)
    runner = FakeRunner()
    scheduler.add_request(make_request("d1", prompt_of(10, 1), max_tokens=50))
    scheduler.add_request(make_request("d2", prompt_of(10, 100), max_tokens=50))
    step(scheduler, runner=runner)  # both prefilled, both decoding from now on
    scheduler.add_request(make_request("long", prompt_of(1000, 5000), max_tokens=5))
    for _ in range(7):
        plan, updates = step(scheduler, runner=runner)
        assert plan.num_scheduled_tokens == {"long": 128}
        assert updates == []
    # The last chunk leaves budget over: the paused decodes take it in the same step.
    plan, updates = step(scheduler, runner=runner)
    assert plan.num_scheduled_tokens == {"long": 1000 - 7 * 128, "d1": 1, "d2": 1}
    assert {u.request.request_id for u in updates} == {"long", "d1", "d2"}
    plan, _ = step(scheduler, runner=runner)
    assert plan.num_scheduled_tokens == {"d1": 1, "d2": 1, "long": 1}


def test_prioritize_prefill_admits_a_burst_before_decoding_it() -> None:
    scheduler = make_scheduler(num_blocks=300, max_num_batched_tokens=32, prioritize_prefill=True)
    runner = FakeRunner()
    for index in range(8):
        scheduler.add_request(make_request(f"r{index}", prompt_of(12, 100 * index), max_tokens=3))
    first_tokens = []
    while len(first_tokens) < 8:
        plan, updates = step(scheduler, runner=runner)
        # Nobody decodes while a prompt of the burst is still waiting or half done.
        assert all(num > 1 for num in plan.num_scheduled_tokens.values()) or not scheduler.waiting
        first_tokens += [u.request.request_id for u in updates if u.request.num_output_tokens == 1]
    outputs, _ = run_to_completion(scheduler, runner=runner)
    assert sorted(first_tokens) == [f"r{index}" for index in range(8)]
    assert all(len(tokens) == 2 for tokens in outputs.values())
    assert_all_blocks_free(scheduler)


def test_prioritize_prefill_is_decode_first_when_the_cache_is_short() -> None:
    # Two decodes hold 6 of 40 blocks: a 128-token step of new prompt blocks (32) plus theirs does not fit the rest.
    scheduler = make_scheduler(num_blocks=40, max_num_batched_tokens=128, prioritize_prefill=True)
    runner = FakeRunner()
    scheduler.add_request(make_request("d1", prompt_of(10, 1), max_tokens=50))
    scheduler.add_request(make_request("d2", prompt_of(10, 100), max_tokens=50))
    step(scheduler, runner=runner)
    scheduler.add_request(make_request("long", prompt_of(100, 5000), max_tokens=5))
    plan, _ = step(scheduler, runner=runner)
    assert plan.num_scheduled_tokens == {"d1": 1, "d2": 1, "long": 100}


def test_waiting_request_waits_while_running_prefill_uses_the_budget() -> None:
    scheduler = make_scheduler(num_blocks=300, max_num_batched_tokens=128)
    scheduler.add_request(make_request("first", prompt_of(300, 1), max_tokens=2))
    step(scheduler)
    scheduler.add_request(make_request("second", prompt_of(100, 900), max_tokens=2))
    plan, _ = step(scheduler)
    assert plan.num_scheduled_tokens == {"first": 128}
    plan, _ = step(scheduler)
    assert plan.num_scheduled_tokens == {"first": 300 - 256, "second": 128 - 44}


def test_max_num_seqs_caps_running_requests() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    scheduler.add_request(make_request("a", prompt_of(5, 1), max_tokens=2))
    scheduler.add_request(make_request("b", prompt_of(5, 100), max_tokens=5))
    scheduler.add_request(make_request("c", prompt_of(5, 200), max_tokens=2))
    plan, _ = step(scheduler)
    assert set(plan.num_scheduled_tokens) == {"a", "b"}
    assert [r.request_id for r in scheduler.running] == ["a", "b"]
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    plan, updates = step(scheduler)  # "a" finishes by length here
    assert set(plan.num_scheduled_tokens) == {"a", "b"}
    assert [u.request.request_id for u in updates if u.finished] == ["a"]
    plan, _ = step(scheduler)
    assert set(plan.num_scheduled_tokens) == {"b", "c"}
    assert [n.request_id for n in plan.new_requests] == ["c"]
    assert len(scheduler.running) == 2


# --- step plans -------------------------------------------------------------------------------------------------------


def test_request_is_sent_as_new_once_then_as_cached_with_new_block_ids_only() -> None:
    scheduler = make_scheduler()
    params = SamplingParams(max_tokens=8, temperature=0.5)
    scheduler.add_request(Request("a", [11, 12, 13, 14, 15, 16], params, 8))
    plan, _ = step(scheduler)
    assert plan.cached_requests == []
    (new,) = plan.new_requests
    assert new.request_id == "a"
    assert new.prompt_token_ids == [11, 12, 13, 14, 15, 16]
    assert new.output_token_ids == []
    assert new.sampling_params is params
    assert new.num_computed_tokens == 0
    assert len(new.block_ids) == 2
    assert plan.num_scheduled_tokens == {"a": 6}
    seen_blocks = list(new.block_ids)
    new_block_counts = []
    for expected_computed in (6, 7, 8):  # 7 and 8 tokens fit in 2 blocks; the 9th needs a third
        plan, _ = step(scheduler)
        assert plan.new_requests == []
        (cached,) = plan.cached_requests
        assert cached.request_id == "a"
        assert cached.num_computed_tokens == expected_computed
        assert not set(cached.new_block_ids) & set(seen_blocks)
        seen_blocks += cached.new_block_ids
        new_block_counts.append(len(cached.new_block_ids))
        assert plan.num_scheduled_tokens == {"a": 1}
    assert new_block_counts == [0, 0, 1]
    assert seen_blocks == scheduler.kv_cache.block_ids("a")


# --- preemption -------------------------------------------------------------------------------------------------------


def test_growing_decodes_preempt_the_newest_running_request() -> None:
    scheduler = make_scheduler(num_blocks=6)
    runner = FakeRunner()
    prompts = {"a": prompt_of(7, 1), "b": prompt_of(7, 100), "c": prompt_of(7, 200)}
    for request_id, prompt in prompts.items():
        scheduler.add_request(make_request(request_id, prompt, max_tokens=10))
    plan, _ = step(scheduler, runner=runner)  # 2 blocks each: the cache is full
    assert [n.request_id for n in plan.new_requests] == ["a", "b", "c"]
    assert scheduler.kv_cache.num_free_blocks == 0
    plan, _ = step(scheduler, runner=runner)  # 8 tokens each: still 2 blocks
    assert plan.preempted_request_ids == []
    victim = scheduler.requests["c"]
    outputs_before = list(victim.output_token_ids)
    assert outputs_before == [TOKEN, TOKEN]
    scheduler.add_request(make_request("late", prompt_of(3, 300), max_tokens=1))
    plan, _ = step(scheduler, runner=runner)  # 9th token of "a" and "b" needs a third block each
    assert plan.preempted_request_ids == ["c"]
    assert scheduler.num_preemptions == 1
    assert set(plan.num_scheduled_tokens) == {"a", "b"}  # nothing admitted in a step that preempted
    assert victim.status == RequestStatus.PREEMPTED
    assert victim.num_computed_tokens == 0
    assert scheduler.waiting[0] is victim
    assert [r.request_id for r in scheduler.waiting] == ["c", "late"]
    assert victim.output_token_ids == outputs_before  # recompute preemption keeps the tokens
    assert scheduler.kv_cache.block_ids("c") == []
    assert victim not in scheduler.running

    resent = None
    outputs, plans = {}, []
    while scheduler.has_unfinished_requests() and len(plans) < 200:
        plan, updates = step(scheduler, runner=runner)
        plans.append(plan)
        for update in updates:
            outputs.setdefault(update.request.request_id, []).extend(update.new_token_ids)
        for new in plan.new_requests:
            if new.request_id == "c" and resent is None:
                resent = new
    assert not scheduler.has_unfinished_requests()
    assert resent is not None
    assert resent.prompt_token_ids == prompts["c"]
    assert resent.output_token_ids == outputs_before
    assert len(outputs_before) + len(outputs["c"]) == 10
    assert len(outputs["late"]) == 1
    assert_all_blocks_free(scheduler)


def test_many_requests_under_memory_pressure_all_finish_without_leaks() -> None:
    scheduler = make_scheduler(num_blocks=12, max_num_batched_tokens=16)
    runner = FakeRunner()
    expected = {}
    for index in range(8):
        request_id = f"r{index}"
        expected[request_id] = 3 + 2 * index
        scheduler.add_request(make_request(request_id, prompt_of(5 + index, 100 * index), max_tokens=3 + 2 * index))
    outputs, _ = run_to_completion(scheduler, runner=runner)
    assert scheduler.num_preemptions > 0
    assert {request_id: len(tokens) for request_id, tokens in outputs.items()} == expected
    assert_all_blocks_free(scheduler)
    assert len(scheduler.waiting) == 0 and scheduler.running == []
    runner.apply(scheduler, scheduler.schedule())  # the last finished ids reach the runner
    assert runner.block_tables == {}


def test_preempted_request_resumes_with_all_its_tokens() -> None:
    scheduler = make_scheduler(num_blocks=6, enable_prefix_caching=False)
    runner = FakeRunner()
    token_counter = iter(range(10_000, 20_000))
    for request_id, start in (("a", 1), ("b", 100), ("c", 200)):
        scheduler.add_request(make_request(request_id, prompt_of(7, start), max_tokens=10))
    total: dict[str, list[int]] = {}
    resent_outputs = []
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        plan, updates = step(scheduler, token_for=lambda _: next(token_counter), runner=runner)
        for new in plan.new_requests:
            if new.request_id == "c":
                resent_outputs.append(list(new.output_token_ids))
                assert new.output_token_ids == total.get("c", [])
        for update in updates:
            total.setdefault(update.request.request_id, []).extend(update.new_token_ids)
    assert not scheduler.has_unfinished_requests()
    assert len(resent_outputs) >= 2  # first admission, then at least one resume
    assert resent_outputs[0] == [] and resent_outputs[-1] != []
    assert {request_id: len(tokens) for request_id, tokens in total.items()} == {"a": 10, "b": 10, "c": 10}
    all_tokens = [t for tokens in total.values() for t in tokens]
    assert len(all_tokens) == len(set(all_tokens))  # no token sampled twice into a request
    assert_all_blocks_free(scheduler)


def test_no_request_is_admitted_in_a_step_that_preempted() -> None:
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", prompt_of(6, 1), max_tokens=5))
    scheduler.add_request(make_request("c", prompt_of(12, 100), max_tokens=5))
    plan, _ = step(scheduler)
    assert plan.num_scheduled_tokens == {"a": 6, "c": 2}  # c's prefill is chunked
    # c's next chunk needs 2 more blocks with 1 free: c, the newest, preempts itself.
    plan, _ = step(scheduler)
    assert plan.preempted_request_ids == ["c"]
    # Two blocks are free now, enough for a chunk of c, yet c is not re-admitted in the same step.
    assert scheduler.kv_cache.num_free_blocks == 2
    assert plan.num_scheduled_tokens == {"a": 1}
    assert plan.new_requests == []
    plan, _ = step(scheduler)
    assert [n.request_id for n in plan.new_requests] == ["c"]
    assert plan.new_requests[0].num_computed_tokens == 0


def test_request_outgrowing_the_whole_cache_does_not_spin_forever() -> None:
    # max_model_len (64 tokens) is more than the cache holds (4 blocks of 4 = 16 tokens). The request is
    # accepted (its prompt fits), but once it alone needs more than every block, it can only be preempted and
    # re-queued: it must be refused up front or finish, never loop on empty steps.
    try:
        scheduler = Scheduler(EngineConfig(block_size=BLOCK_SIZE), 4, 64, eos_token_ids={EOS})
        scheduler.add_request(make_request("a", prompt_of(15), max_tokens=10))
    except ValueError:
        return  # refused at construction or admission
    run_to_completion(scheduler, max_steps=100)
    assert_all_blocks_free(scheduler)


# --- stop conditions --------------------------------------------------------------------------------------------------


def drive(scheduler: Scheduler, tokens: list[int]) -> list[RequestUpdate]:
    """Prefill then decode the single request, sampling the given tokens in order until it finishes."""
    remaining = iter(tokens)
    updates: list[RequestUpdate] = []
    while scheduler.has_unfinished_requests():
        _, step_updates = step(scheduler, token_for=lambda _: next(remaining))
        updates += step_updates
    return updates


def test_eos_finishes_with_stop() -> None:
    scheduler = make_scheduler()
    request = make_request("a", prompt_of(6), max_tokens=10)
    scheduler.add_request(request)
    updates = drive(scheduler, [7, 8, EOS, 9, 9])
    assert [u.new_token_ids for u in updates] == [[7], [8], [EOS]]
    assert [u.finished for u in updates] == [False, False, True]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.finish_reason == "stop"
    assert request.stop_reason is None
    assert request.output_token_ids == [7, 8, EOS]
    assert "a" not in scheduler.requests
    assert_all_blocks_free(scheduler)
    assert scheduler.schedule().finished_request_ids == ["a"]


def test_eos_is_ignored_with_ignore_eos() -> None:
    scheduler = make_scheduler()
    request = make_request("a", prompt_of(6), max_tokens=4, ignore_eos=True)
    scheduler.add_request(request)
    drive(scheduler, [EOS, EOS, EOS, EOS, EOS])
    assert request.output_token_ids == [EOS] * 4
    assert request.finish_reason == "length"


def test_eos_is_ignored_before_min_tokens() -> None:
    scheduler = make_scheduler()
    request = make_request("a", prompt_of(6), max_tokens=10, min_tokens=3)
    scheduler.add_request(request)
    drive(scheduler, [EOS, EOS, EOS, 9])
    assert request.output_token_ids == [EOS, EOS, EOS]
    assert request.finish_reason == "stop"


def test_stop_token_ids_set_stop_reason() -> None:
    scheduler = make_scheduler()
    request = make_request("a", prompt_of(6), max_tokens=10, stop_token_ids=[42, 43])
    scheduler.add_request(request)
    drive(scheduler, [7, 43, 9])
    assert request.output_token_ids == [7, 43]
    assert request.finish_reason == "stop"
    assert request.stop_reason == 43


def test_stop_token_ids_respect_min_tokens_but_not_ignore_eos() -> None:
    scheduler = make_scheduler()
    gated = make_request("a", prompt_of(6), max_tokens=10, stop_token_ids=[42], min_tokens=2)
    scheduler.add_request(gated)
    drive(scheduler, [42, 42, 9])
    assert gated.output_token_ids == [42, 42] and gated.stop_reason == 42
    other = make_request("b", prompt_of(6, 50), max_tokens=10, stop_token_ids=[42], ignore_eos=True)
    scheduler.add_request(other)
    drive(scheduler, [EOS, 42, 9])
    assert other.output_token_ids == [EOS, 42] and other.finish_reason == "stop" and other.stop_reason == 42


def test_max_tokens_finishes_with_length() -> None:
    scheduler = make_scheduler()
    request = make_request("a", prompt_of(6), max_tokens=3)
    scheduler.add_request(request)
    updates = drive(scheduler, [7, 8, 9, 10])
    assert request.output_token_ids == [7, 8, 9]
    assert request.finish_reason == "length" and request.stop_reason is None
    assert updates[-1].finished and not any(u.finished for u in updates[:-1])
    assert_all_blocks_free(scheduler)


def test_max_model_len_finishes_with_length() -> None:
    scheduler = make_scheduler(max_model_len=20)
    request = make_request("a", prompt_of(16), max_tokens=100)
    scheduler.add_request(request)
    drive(scheduler, [7] * 10)
    assert request.num_tokens == 20
    assert request.num_output_tokens == 4
    assert request.finish_reason == "length"


def test_eos_on_the_last_allowed_token_is_a_stop() -> None:
    scheduler = make_scheduler()
    request = make_request("a", prompt_of(6), max_tokens=2)
    scheduler.add_request(request)
    drive(scheduler, [7, EOS])
    assert request.finish_reason == "stop"


# --- aborts -----------------------------------------------------------------------------------------------------------


def test_abort_running_and_waiting_frees_blocks_and_is_reported_once() -> None:
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=1)
    running = make_request("run", prompt_of(10, 1), max_tokens=10)
    waiting = make_request("wait", prompt_of(10, 100), max_tokens=10)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    plan, _ = step(scheduler)
    assert set(plan.num_scheduled_tokens) == {"run"}
    assert scheduler.kv_cache.num_free_blocks == 8 - 3
    plan = scheduler.schedule()  # the runner is working on this step when the abort arrives
    scheduler.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache.num_free_blocks == 8
    assert_all_blocks_free(scheduler)
    assert not scheduler.has_unfinished_requests()
    assert len(scheduler.waiting) == 0 and scheduler.running == []
    assert running.finish_reason == "abort" and waiting.finish_reason == "abort"
    # The step in flight comes back with a token for the aborted request: it is dropped.
    updates = scheduler.update_from_output(plan, StepResult(["run"], [[TOKEN]]))
    assert updates == []
    assert running.output_token_ids == [TOKEN]
    next_plan = scheduler.schedule()
    assert sorted(next_plan.finished_request_ids) == ["run", "wait"]
    assert next_plan.num_scheduled_tokens == {}
    assert scheduler.schedule().finished_request_ids == []


def test_abort_of_preempted_request_removes_it_from_waiting() -> None:
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add_request(make_request("a", prompt_of(7, 1), max_tokens=10))
    scheduler.add_request(make_request("b", prompt_of(7, 100), max_tokens=10))
    preempted = None
    for _ in range(5):
        plan, _ = step(scheduler)
        if plan.preempted_request_ids:
            preempted = plan.preempted_request_ids
            break
    assert preempted == ["b"]
    scheduler.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert list(scheduler.waiting) == []
    plan, _ = step(scheduler)
    assert "b" in plan.finished_request_ids
    run_to_completion(scheduler)
    assert_all_blocks_free(scheduler)


def test_finish_with_stop_string_records_reason() -> None:
    scheduler = make_scheduler()
    request = make_request("a", prompt_of(6), max_tokens=10)
    scheduler.add_request(request)
    step(scheduler)
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_STOPPED, "###")
    assert request.finish_reason == "stop" and request.stop_reason == "###"
    assert_all_blocks_free(scheduler)


# --- n > 1 siblings ---------------------------------------------------------------------------------------------------


def test_sibling_waits_for_first_sibling_then_shares_its_prompt_blocks() -> None:
    scheduler = make_scheduler(enable_prefix_caching=False)
    runner = FakeRunner()
    prompt = prompt_of(10)  # 2 full blocks + 2 tokens
    scheduler.add_request(make_request("p#0", prompt, max_tokens=5))
    scheduler.add_request(make_request("p#1", prompt, max_tokens=5, gate="p#0"))
    scheduler.add_request(make_request("other", prompt_of(6, 500), max_tokens=5))
    plan, _ = step(scheduler, runner=runner)
    assert "p#1" not in plan.num_scheduled_tokens
    assert [n.request_id for n in plan.new_requests] == ["p#0", "other"]
    assert [r.request_id for r in scheduler.waiting] == ["p#1"]
    plan, _ = step(scheduler, runner=runner)
    (new,) = plan.new_requests
    assert new.request_id == "p#1"
    assert new.num_computed_tokens == 8
    assert plan.num_scheduled_tokens["p#1"] == 2
    first_blocks = scheduler.kv_cache.block_ids("p#0")
    assert new.block_ids[:2] == first_blocks[:2]
    assert new.block_ids[2] != first_blocks[2]
    pool = scheduler.kv_cache.pool
    assert [pool.blocks[i].ref_cnt for i in first_blocks[:2]] == [2, 2]
    # A non-sibling with the same prompt gets no hits: prefix caching is off.
    scheduler.add_request(make_request("stranger", prompt, max_tokens=5))
    plan, _ = step(scheduler, runner=runner)
    (stranger,) = plan.new_requests
    assert stranger.num_computed_tokens == 0
    assert not set(stranger.block_ids) & set(first_blocks)
    run_to_completion(scheduler, runner=runner)
    assert_all_blocks_free(scheduler)


def test_sibling_waits_through_a_chunked_prefill() -> None:
    scheduler = make_scheduler(num_blocks=300, max_num_batched_tokens=64, enable_prefix_caching=False)
    prompt = prompt_of(200)
    scheduler.add_request(make_request("p#0", prompt, max_tokens=3))
    scheduler.add_request(make_request("p#1", prompt, max_tokens=3, gate="p#0"))
    scheduler.add_request(make_request("p#2", prompt, max_tokens=3, gate="p#0"))
    for _ in range(4):  # 64 + 64 + 64 + 8 tokens
        plan, _ = step(scheduler)
        assert set(plan.num_scheduled_tokens) <= {"p#0"}
    plan, _ = step(scheduler)
    new_ids = {n.request_id: n for n in plan.new_requests}
    assert set(new_ids) == {"p#1", "p#2"}
    for sibling in new_ids.values():
        assert sibling.num_computed_tokens == 196  # 49 full blocks; the last token is recomputed
        assert plan.num_scheduled_tokens[sibling.request_id] == 4
    shared = scheduler.kv_cache.block_ids("p#0")[:49]
    assert all(scheduler.kv_cache.pool.blocks[i].ref_cnt == 3 for i in shared)
    run_to_completion(scheduler)
    assert_all_blocks_free(scheduler)


def test_gated_sibling_keeps_its_place_in_the_queue() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    prompt = prompt_of(10)
    scheduler.add_request(make_request("p#0", prompt, max_tokens=5))
    scheduler.add_request(make_request("p#1", prompt, max_tokens=5, gate="p#0"))
    scheduler.add_request(make_request("q", prompt_of(6, 300), max_tokens=1))
    scheduler.add_request(make_request("r", prompt_of(6, 400), max_tokens=5))
    plan, _ = step(scheduler)  # p#1 is skipped, q takes the second seat, r waits
    assert [n.request_id for n in plan.new_requests] == ["p#0", "q"]
    assert [r.request_id for r in scheduler.waiting] == ["p#1", "r"]
    plan, _ = step(scheduler)  # q finished last step: its seat goes to p#1, which arrived before r
    assert [n.request_id for n in plan.new_requests] == ["p#1"]
    assert [r.request_id for r in scheduler.waiting] == ["r"]


class RandomWorkload:
    """A seeded mix for the invariant tests: a scheduler of random shape and cache size; parents of 1-3 siblings
    whose prompts share prefixes, with random max_tokens and ignore_eos; random aborts and sampled tokens."""

    def __init__(self, seed: int, prioritize_prefill: bool):
        rng = self.rng = random.Random(seed)
        self.block_size = rng.choice([1, 2, 4, 16])
        self.num_blocks = rng.randint(4, 40)
        self.scheduler = make_scheduler(
            self.num_blocks,
            block_size=self.block_size,
            max_num_batched_tokens=rng.choice([1, 3, 8, 32, 128]),
            max_num_seqs=rng.choice([1, 2, 4, 64]),
            enable_prefix_caching=rng.random() < 0.7,
            prioritize_prefill=prioritize_prefill,
        )
        self.prefixes = [
            [rng.randrange(3, 50) for _ in range(rng.randint(1, 3 * self.block_size + 3))] for _ in range(3)
        ]
        self.requests: dict[str, Request] = {}
        self.num_parents = 0
        self.aborted: set[str] = set()

    def maybe_add_parent(self) -> None:
        rng = self.rng
        if rng.random() >= 0.3:
            return
        prompt = rng.choice(self.prefixes) + [rng.randrange(3, 50) for _ in range(rng.randint(0, 2 * self.block_size))]
        prompt = prompt[: self.num_blocks * self.block_size - 1]
        max_tokens, ignore_eos = rng.randint(1, 12), rng.random() < 0.5
        parent = self.num_parents
        for index in range(rng.choice([1, 1, 2, 3])):
            gate = f"p{parent}#0" if index else None
            request = make_request(f"p{parent}#{index}", prompt, max_tokens, gate, ignore_eos=ignore_eos)
            self.scheduler.add_request(request)
            self.requests[request.request_id] = request
        self.num_parents += 1

    def maybe_abort(self) -> None:
        scheduler = self.scheduler
        if scheduler.requests and self.rng.random() < 0.05:
            victim = self.rng.choice(list(scheduler.requests))
            scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            self.aborted.add(victim)

    def sample(self, _request_id: str = "") -> int:
        return EOS if self.rng.random() < 0.1 else self.rng.randrange(3, 50)

    def assert_blocks_accounted(self) -> None:
        """Every block's ref count is the number of requests holding it; the free queue is the unheld blocks."""
        scheduler, pool = self.scheduler, self.scheduler.kv_cache.pool
        holders: dict[int, int] = {}
        for blocks in scheduler.kv_cache.request_blocks.values():
            for block in blocks:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        assert [block.ref_cnt for block in pool.blocks] == [holders.get(i, 0) for i in range(self.num_blocks)]
        assert sorted(pool.free_queue.block_ids()) == [block.block_id for block in pool.blocks if block.ref_cnt == 0]
        assert len(scheduler.running) <= scheduler.max_num_seqs


@pytest.mark.parametrize("prioritize_prefill", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_random_workload_keeps_every_invariant(seed: int, prioritize_prefill: bool) -> None:
    """Shared prefixes, n > 1 siblings, aborts, EOS, chunked prefill and preemption mixed at random."""
    workload = RandomWorkload(seed, prioritize_prefill)
    scheduler = workload.scheduler
    runner = FakeRunner()
    for _ in range(1000):
        if workload.num_parents < 12:
            workload.maybe_add_parent()
        workload.maybe_abort()
        plan = scheduler.schedule()
        assert plan.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
        runner.apply(scheduler, plan)
        workload.assert_blocks_accounted()
        ids = sampling_ids(scheduler, plan)
        scheduler.update_from_output(plan, StepResult(ids, [[workload.sample()] for _ in ids]))
        if workload.num_parents == 12 and not scheduler.has_unfinished_requests():
            break
    assert not scheduler.has_unfinished_requests()
    assert_all_blocks_free(scheduler)


# --- admission --------------------------------------------------------------------------------------------------------


def test_duplicate_request_id_raises() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", prompt_of(5)))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("a", prompt_of(7, 50)))
    assert len(scheduler.waiting) == 1 and scheduler.requests["a"].num_prompt_tokens == 5
    step(scheduler)
    with pytest.raises(ValueError):
        scheduler.add_request(make_request("a", prompt_of(7, 50)))  # running counts too
    assert len(scheduler.running) == 1 and len(scheduler.waiting) == 0


def test_prompt_larger_than_the_cache_is_rejected() -> None:
    scheduler = make_scheduler(num_blocks=4)
    with pytest.raises(ValueError):
        scheduler.add_request(make_request("big", prompt_of(16)))  # 16 + 1 tokens need 5 blocks
    assert not scheduler.has_unfinished_requests()
    scheduler.add_request(make_request("fits", prompt_of(15)))
    assert scheduler.num_unfinished == 1
