"""Async scheduling in the scheduler: step N+1 is planned before step N's result is back, with placeholders for the
tokens step N samples. Driven by a runner that keeps its own tokens, as a single-rank model runner does; no model."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import pytest

from configs.sampling_params import SamplingParams
from executor.request import Request
from executor.scheduler import RequestUpdate, Scheduler
from model_executor.step_plan import StepPlan, StepResult
from tests.scheduler_fakes import (
    EOS,
    TOKEN,
    RandomWorkload,
    assert_all_blocks_free,
    make_request,
    make_scheduler,
    prompt_of,
)


class SingleRankRunner:
    """What a single-rank model runner keeps from the plans: its own tokens (it appends the ones it samples, the
    plans never carry them), block tables and progress. A shadow KV cache records the token written at each slot:
    every request must read back its own tokens at every position it attends to."""

    def __init__(self, block_size: int, sample: Callable[[str], int] = lambda _: TOKEN):
        self.block_size = block_size
        self.sample = sample
        self.tokens: dict[str, list[int]] = {}
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.kv: dict[tuple[int, int], int] = {}
        self.sampled: dict[str, list[int]] = {}  # every token sampled per request, preemptions included

    def execute(self, plan: StepPlan) -> StepResult:
        for request_id in plan.finished_request_ids + plan.preempted_request_ids:
            for state in (self.tokens, self.block_tables, self.num_computed):
                state.pop(request_id, None)
        for new in plan.new_requests:
            assert new.request_id not in self.tokens, f"{new.request_id} sent as new twice"
            self.tokens[new.request_id] = new.prompt_token_ids + new.output_token_ids
            self.block_tables[new.request_id] = list(new.block_ids)
            self.num_computed[new.request_id] = new.num_computed_tokens
        for cached in plan.cached_requests:
            assert cached.request_id in self.tokens, f"{cached.request_id} sent as cached before new"
            assert cached.new_token_ids == [], "a single-rank runner already holds every token it sampled"
            assert cached.num_computed_tokens == self.num_computed[cached.request_id]
            self.block_tables[cached.request_id].extend(cached.new_block_ids)
        block_size = self.block_size
        written: dict[tuple[int, int], int] = {}
        for request_id, num in plan.num_scheduled_tokens.items():
            table, tokens, start = self.block_tables[request_id], self.tokens[request_id], self.num_computed[request_id]
            assert start + num <= len(table) * block_size
            assert start + num <= len(tokens), f"{request_id} scheduled past the tokens the runner holds"
            for position in range(start, start + num):
                slot = (table[position // block_size], position % block_size)
                assert written.setdefault(slot, tokens[position]) == tokens[position], "two tokens in one slot"
                self.kv[slot] = tokens[position]
        result = StepResult()
        for request_id, num in plan.num_scheduled_tokens.items():
            table, tokens = self.block_tables[request_id], self.tokens[request_id]
            self.num_computed[request_id] += num
            computed = self.num_computed[request_id]
            read = [self.kv.get((table[p // block_size], p % block_size)) for p in range(computed)]
            assert read == tokens[:computed], f"{request_id} attends to wrong KV"
            if computed == len(tokens):
                token_id = self.sample(request_id)
                tokens.append(token_id)
                self.sampled.setdefault(request_id, []).append(token_id)
                result.request_ids.append(request_id)
                result.sampled_token_ids.append([token_id])
        return result


def run_pipelined(
    scheduler: Scheduler,
    runner: SingleRankRunner,
    depth: int = 2,
    max_steps: int = 2000,
    between_steps: Callable[[], None] = lambda: None,
    arrivals_done: Callable[[], bool] = lambda: True,
) -> tuple[dict[str, list[int]], list[StepPlan]]:
    """The scheduler actor's loop without Ray: up to `depth` plans made before the oldest result is collected.
    A plan runs on the runner when it is made, as it would queued behind the running step on a worker."""
    outputs: dict[str, list[int]] = {}
    plans: list[StepPlan] = []
    in_flight: deque[tuple[StepPlan, StepResult]] = deque()
    for _ in range(max_steps):
        has_work = scheduler.has_unfinished_requests()
        if not has_work and not in_flight and arrivals_done():
            return outputs, plans
        between_steps()
        has_work = scheduler.has_unfinished_requests()
        if has_work and len(in_flight) < depth:
            plan = scheduler.schedule()
            assert plan.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
            if in_flight and not (plan.num_scheduled_tokens or plan.preempted_request_ids):
                scheduler.defer_runner_news(plan)
            else:
                plans.append(plan)
                in_flight.append((plan, runner.execute(plan)))
                if len(in_flight) < depth:
                    continue
        if not in_flight:
            continue  # idle until the next arrival
        plan, result = in_flight.popleft()
        updates: list[RequestUpdate] = scheduler.update_from_output(plan, result)
        for update in updates:
            outputs.setdefault(update.request.request_id, []).extend(update.new_token_ids)
        for request in scheduler.requests.values():
            if request.request_id in runner.tokens:
                assert runner.tokens[request.request_id][: request.num_tokens] == request.token_ids
    raise AssertionError(f"requests still unfinished after {max_steps} steps: {list(scheduler.requests)}")


def test_the_next_step_is_planned_before_the_running_one_returns() -> None:
    scheduler = make_scheduler()
    runner = SingleRankRunner(scheduler.kv_cache.block_size, sample=lambda _: 7)
    request = make_request("a", prompt_of(6), max_tokens=3)
    scheduler.add_request(request)
    first = scheduler.schedule()
    first_result = runner.execute(first)
    assert first.num_scheduled_tokens == {"a": 6} and request.num_output_placeholders == 1
    second = scheduler.schedule()  # the first step's token is not back yet
    (cached,) = second.cached_requests
    assert second.num_scheduled_tokens == {"a": 1}
    assert cached.num_computed_tokens == 6 and cached.new_token_ids == []
    second_result = runner.execute(second)
    assert request.num_output_placeholders == 2 and request.output_token_ids == []
    (update,) = scheduler.update_from_output(first, first_result)
    assert update.new_token_ids == [7] and not update.finished
    third = scheduler.schedule()
    assert third.num_scheduled_tokens == {"a": 1}
    third_result = runner.execute(third)
    scheduler.update_from_output(second, second_result)
    # The third token (max_tokens) is being sampled: nothing is left to plan for "a".
    assert scheduler.schedule().num_scheduled_tokens == {}
    (update,) = scheduler.update_from_output(third, third_result)
    assert update.finished and request.finish_reason == "length"
    assert request.output_token_ids == [7, 7, 7] and runner.sampled["a"] == [7, 7, 7]
    assert_all_blocks_free(scheduler)


def test_a_stop_token_found_late_costs_one_step_and_nothing_else() -> None:
    scheduler = make_scheduler()
    sampled_so_far: dict[str, int] = {}

    def sample(request_id: str) -> int:
        sampled_so_far[request_id] = sampled_so_far.get(request_id, 0) + 1
        return EOS if sampled_so_far[request_id] == 2 else TOKEN

    runner = SingleRankRunner(scheduler.kv_cache.block_size, sample)
    scheduler.add_request(make_request("a", prompt_of(6), max_tokens=10))
    outputs, plans = run_pipelined(scheduler, runner)
    assert outputs == {"a": [TOKEN, EOS]}
    # Prefill, the step that samples EOS, and the one planned behind it before EOS was seen.
    assert [plan.num_scheduled_tokens for plan in plans] == [{"a": 6}, {"a": 1}, {"a": 1}]
    assert runner.sampled["a"] == [TOKEN, EOS, TOKEN]
    assert_all_blocks_free(scheduler)
    runner.execute(scheduler.schedule())  # the finish reaches the runner with the next plan
    assert runner.tokens == {}


def test_preemption_with_steps_in_flight_keeps_their_tokens() -> None:
    scheduler = make_scheduler(num_blocks=12, max_num_batched_tokens=16)
    runner = SingleRankRunner(scheduler.kv_cache.block_size)
    expected = {}
    for index in range(8):
        request_id = f"r{index}"
        expected[request_id] = 3 + 2 * index
        scheduler.add_request(make_request(request_id, prompt_of(5 + index, 100 * index), max_tokens=3 + 2 * index))
    resent: dict[str, list[int]] = {}
    outputs, plans = run_pipelined(scheduler, runner)
    for plan in plans:
        for new in plan.new_requests:
            if new.output_token_ids:
                resent[new.request_id] = new.output_token_ids
    assert scheduler.num_preemptions > 0 and resent
    assert {request_id: len(tokens) for request_id, tokens in outputs.items()} == expected
    # A request resumes with every token sampled before, including the one its last step had in flight.
    for request_id, tokens in resent.items():
        assert tokens == runner.sampled[request_id][: len(tokens)]
    # Length limits are known ahead: no step runs past max_tokens.
    assert {request_id: len(tokens) for request_id, tokens in runner.sampled.items()} == expected
    assert_all_blocks_free(scheduler)


def test_blocks_of_generated_tokens_are_cached_once_their_tokens_are_known() -> None:
    scheduler = make_scheduler()
    counter = iter(range(100, 200))
    runner = SingleRankRunner(scheduler.kv_cache.block_size, sample=lambda _: next(counter))
    first = make_request("a", prompt_of(6), max_tokens=10)
    scheduler.add_request(first)
    run_pipelined(scheduler, runner)
    assert first.output_token_ids == list(range(100, 110))
    # 16 tokens, the last never fed back: blocks 0-2 hold computed KV, prompt and generated tokens alike.
    scheduler.add_request(make_request("b", [*first.token_ids, 7], max_tokens=1))
    plan = scheduler.schedule()
    (new,) = plan.new_requests
    assert new.num_computed_tokens == 12
    runner.execute(plan)  # reads its first 12 tokens' KV from the blocks "a" wrote


def test_a_sibling_waits_for_a_plan_after_the_one_that_schedules_the_shared_prompt() -> None:
    scheduler = make_scheduler(num_blocks=300, max_num_batched_tokens=64)
    runner = SingleRankRunner(scheduler.kv_cache.block_size)
    prompt = prompt_of(40)
    params = SamplingParams(max_tokens=3, n=2)
    scheduler.add_request(Request("p#0", prompt, params, 3))
    scheduler.add_request(Request("p#1", prompt, params, 3, "p#0"))
    outputs, plans = run_pipelined(scheduler, runner)
    assert [n.request_id for n in plans[0].new_requests] == ["p#0"]
    (sibling,) = plans[1].new_requests
    assert sibling.request_id == "p#1" and sibling.num_computed_tokens == 36  # 9 full blocks shared
    assert outputs == {"p#0": [TOKEN] * 3, "p#1": [TOKEN] * 3}
    assert_all_blocks_free(scheduler)


@pytest.mark.parametrize(("depth", "prioritize_prefill"), [(2, False), (2, True), (3, False)])
@pytest.mark.parametrize("seed", range(10))
def test_random_workload_pipelined_keeps_every_invariant(seed: int, depth: int, prioritize_prefill: bool) -> None:
    """Shared prefixes, n > 1 siblings, aborts, EOS, chunked prefill and preemption with two (or three) plans in
    flight."""
    workload = RandomWorkload(seed, prioritize_prefill)
    scheduler = workload.scheduler
    runner = SingleRankRunner(workload.block_size, sample=workload.sample)

    def between_steps() -> None:
        if workload.num_parents < 12:
            workload.maybe_add_parent()
        workload.maybe_abort()
        workload.assert_blocks_accounted()

    outputs, _ = run_pipelined(
        scheduler, runner, depth, between_steps=between_steps, arrivals_done=lambda: workload.num_parents >= 12
    )
    assert not scheduler.has_unfinished_requests() and workload.requests
    assert_all_blocks_free(scheduler)
    for request_id, request in workload.requests.items():
        delivered = outputs.get(request_id, [])
        assert delivered == request.output_token_ids
        sampled = runner.sampled.get(request_id, [])
        assert delivered == sampled[: len(delivered)]
        if request_id in workload.aborted:
            continue
        assert request.status.is_finished and len(delivered) <= request.max_tokens
        # At most the steps planned behind a stop token run for nothing; a length limit costs none.
        assert len(sampled) - len(delivered) <= (0 if request.finish_reason == "length" else depth - 1)
