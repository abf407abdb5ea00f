"""Scheduler: recompute preemption under memory pressure, requests outgrowing the cache, aborts, n > 1 siblings,
random-workload invariants and admission checks. Driven by hand-made StepResults: no model runs."""

from __future__ import annotations

import pytest

from configs.engine_config import EngineConfig
from executor.request import RequestStatus
from executor.scheduler import Scheduler
from model_executor.step_plan import StepResult
from tests.scheduler_fakes import (
    BLOCK_SIZE,
    EOS,
    TOKEN,
    FakeRunner,
    RandomWorkload,
    assert_all_blocks_free,
    make_request,
    make_scheduler,
    prompt_of,
    run_to_completion,
    sampling_ids,
    step,
)

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
