"""scheduler.enable_chunked_prefill=False: a prompt (or a preempted request's tokens) is prefilled whole in one step,
never split; the step must hold max_model_len; greedy tokens are those of chunked prefill; no block leaks."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from configs.engine_config import check_chunked_prefill_budget
from configs.sampling_params import SamplingParams
from model_executor.step_plan import StepPlan
from tests.helpers import assert_no_leaked_blocks
from tests.scheduler_fakes import (
    FakeRunner,
    assert_all_blocks_free,
    make_request,
    make_scheduler,
    prompt_of,
    run_to_completion,
    step,
)

# --- the budget check ------------------------------------------------------------------------------------------------


def test_a_step_smaller_than_the_context_is_refused_naming_both_numbers() -> None:
    with pytest.raises(ValueError) as error:
        check_chunked_prefill_budget(False, 512, 2048)
    message = str(error.value)
    assert "max_num_batched_tokens 512 is smaller than max_model_len 2048" in message
    assert "raise max_num_batched_tokens to at least 2048" in message and "enable_chunked_prefill on" in message
    check_chunked_prefill_budget(False, 2048, 2048)
    check_chunked_prefill_budget(True, 512, 2048)
    with pytest.raises(ValueError, match="max_num_batched_tokens 32 is smaller than max_model_len 64"):
        make_scheduler(64, max_model_len=64, max_num_batched_tokens=32, enable_chunked_prefill=False)


def test_the_engine_refuses_it_at_start(tiny_model_dir: Path, make_llm: Any) -> None:
    # The tiny model's own context is 2048 tokens; the default step is 512.
    with pytest.raises(ValueError, match="max_num_batched_tokens 512 is smaller than max_model_len 2048"):
        make_llm(tiny_model_dir, enable_chunked_prefill=False)


# --- the scheduler ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("chunked", "first_step"), [(True, {"a": 40, "b": 24}), (False, {"a": 40})])
def test_a_prompt_that_does_not_fit_the_rest_of_the_step_waits_whole(chunked: bool, first_step: dict) -> None:
    scheduler = make_scheduler(64, max_model_len=64, max_num_batched_tokens=64, enable_chunked_prefill=chunked)
    scheduler.add_request(make_request("a", prompt_of(40, 1000), max_tokens=4))
    scheduler.add_request(make_request("b", prompt_of(30, 2000), max_tokens=4))
    plan, _ = step(scheduler)
    assert plan.num_scheduled_tokens == first_step
    if not chunked:
        plan, _ = step(scheduler)
        assert plan.num_scheduled_tokens == {"a": 1, "b": 30}


def assert_never_split(plans: list[StepPlan]) -> None:
    """An admitted (or resumed) request computes every token it knows at once; afterwards it runs one a step."""
    for plan in plans:
        new_ids = {new.request_id: new for new in plan.new_requests}
        for request_id, num in plan.num_scheduled_tokens.items():
            if request_id in new_ids:
                new = new_ids[request_id]
                known = len(new.prompt_token_ids) + len(new.output_token_ids)
                assert new.num_computed_tokens + num == known, f"{request_id} was split: {num} of {known}"
            else:
                assert num == 1, f"{request_id} ran {num} tokens after its prefill"


def random_workload(seed: int) -> Any:
    """A scheduler with chunked prefill off, a cache that holds one or two full contexts and a step just over one,
    and twelve prompts of up to a context each: steps fill up and requests get preempted."""
    rng = random.Random(seed)
    block_size, num_blocks = rng.choice([2, 4]), rng.randint(16, 40)
    max_model_len = num_blocks * block_size // rng.choice([1, 2])
    scheduler = make_scheduler(
        num_blocks,
        max_model_len=max_model_len,
        block_size=block_size,
        max_num_batched_tokens=max_model_len + rng.randint(0, 8),
        max_num_seqs=rng.choice([2, 4, 64]),
        enable_prefix_caching=rng.random() < 0.5,
        enable_chunked_prefill=False,
    )
    for index in range(12):
        prompt = [rng.randrange(3, 50) for _ in range(rng.randint(1, max_model_len - 1))]
        max_tokens = rng.randint(1, min(16, max_model_len - len(prompt)))
        scheduler.add_request(make_request(f"r{index}", prompt, max_tokens, ignore_eos=True))
    return scheduler


def test_random_workloads_with_preemption_never_split_and_free_every_block() -> None:
    num_preemptions = 0
    for seed in range(16):  # with chunked prefill on, 6 of these 16 workloads split a prompt
        scheduler = random_workload(seed)
        max_tokens = {request_id: request.max_tokens for request_id, request in scheduler.requests.items()}
        outputs, plans = run_to_completion(scheduler, runner=FakeRunner())
        assert_never_split(plans)
        assert {request_id: len(tokens) for request_id, tokens in outputs.items()} == max_tokens
        assert_all_blocks_free(scheduler)
        num_preemptions += scheduler.num_preemptions
    assert num_preemptions > 0  # resumed requests were recomputed whole too


# --- the engine on the tiny model ---------------------------------------------------------------------------------


def greedy_with_plans(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[StepPlan]]:
    """Greedy tokens per prompt, and every plan the engine's scheduler made for them."""
    scheduler = llm.engine.scheduler
    plans: list[StepPlan] = []
    schedule = scheduler.schedule

    def recording_schedule() -> StepPlan:
        plans.append(schedule())
        return plans[-1]

    scheduler.schedule = recording_schedule
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs], plans


@pytest.mark.parametrize("num_kv_blocks", [256, 32])  # room for every prompt; for one or two (preemption)
def test_greedy_tokens_match_chunked_prefill(tiny_model_dir: Path, make_llm: Any, num_kv_blocks: int) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(150, 400))] for _ in range(5)]
    chunked = make_llm(tiny_model_dir, max_model_len=512, max_num_batched_tokens=128)
    expected, chunked_plans = greedy_with_plans(chunked, prompts, 24)
    with pytest.raises(AssertionError, match="was split"):
        assert_never_split(chunked_plans)  # the default engine chunks these prompts
    whole = make_llm(
        tiny_model_dir,
        max_model_len=512,
        max_num_batched_tokens=512,
        enable_chunked_prefill=False,
        num_kv_blocks=num_kv_blocks,
    )
    tokens, plans = greedy_with_plans(whole, prompts, 24)
    assert tokens == expected
    assert_never_split(plans)
    assert (whole.engine.scheduler.num_preemptions > 0) == (num_kv_blocks == 32)
    assert_no_leaked_blocks(whole)
