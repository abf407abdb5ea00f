"""Scheduler: token budget and chunked prefill, prioritize_prefill, max_num_seqs, and step plans (new then cached
request data). Driven by hand-made StepResults: no model runs."""

from __future__ import annotations

from configs.sampling_params import SamplingParams
from executor.request import Request
from tests.scheduler_fakes import (
    TOKEN,
    FakeRunner,
    assert_all_blocks_free,
    make_request,
    make_scheduler,
    prompt_of,
    run_to_completion,
    step,
)

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
