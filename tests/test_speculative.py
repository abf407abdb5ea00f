"""Speculative decoding with n-gram drafts: the proposer, the scheduler's drafts and rollback (hand-made results and a
shadow KV cache, no model), and the engine's tokens with drafts against its tokens without (tiny random Llama and
SmolLM2, whose greedy output loops, so most drafts are accepted) and against HF transformers."""

from __future__ import annotations

import random

import pytest

from configs.engine_config import EngineConfig
from configs.sampling_params import SamplingParams
from executor.ngram_proposer import propose_ngram_drafts
from executor.request import Request, RequestStatus
from executor.scheduler import Scheduler
from model_executor.step_plan import StepPlan, StepResult
from tests.helpers import assert_no_leaked_blocks

EOS = 2
BLOCK_SIZE = 4


# ---------------------------------------------------------------------------------------------------------------
# The proposer


def test_drafts_follow_the_latest_earlier_occurrence_of_the_longest_recurring_suffix():
    # "7 8" recurs at 0 (then 1) and at 4 (then 3): the latest wins; "6 7 8" recurs nowhere, so two tokens match.
    assert propose_ngram_drafts([7, 8, 1, 5, 7, 8, 3, 4, 6, 7, 8], 3, max_ngram=3, min_ngram=2) == [3, 4, 6]
    # A longer suffix that recurs beats a shorter one that recurs later.
    assert propose_ngram_drafts([1, 2, 3, 9, 5, 3, 8, 1, 2, 3], 2, max_ngram=3, min_ngram=1) == [9, 5]
    assert propose_ngram_drafts([1, 2, 3, 9, 5, 3, 8, 1, 2, 3], 2, max_ngram=1, min_ngram=1) == [8, 1]


def test_a_loop_continues_past_its_last_tokens_and_nothing_is_proposed_without_a_match():
    assert propose_ngram_drafts([5, 1, 2, 1, 2], 5, max_ngram=2, min_ngram=1) == [1, 2, 1, 2, 1]
    assert propose_ngram_drafts([4, 4], 3, max_ngram=4, min_ngram=1) == [4, 4, 4]
    assert propose_ngram_drafts([1, 2, 3, 4], 3, max_ngram=4, min_ngram=1) == []
    assert propose_ngram_drafts([1, 2, 3, 2], 3, max_ngram=4, min_ngram=2) == []  # "2" recurs, but too short
    assert propose_ngram_drafts([1, 2, 1], 0, max_ngram=2, min_ngram=1) == []


def test_only_whole_tokens_match():
    # As int32 bytes, 256 (00 01 00 00) sits across the first two tokens (01 00 00 00 | 01 00 00 00) but is no token.
    assert propose_ngram_drafts([1, 1, 7, 256], 2, max_ngram=1, min_ngram=1) == []
    assert propose_ngram_drafts([1, 1, 7, 256, 9, 256], 2, max_ngram=1, min_ngram=1) == [9, 256]


# ---------------------------------------------------------------------------------------------------------------
# The scheduler, driven by a fake model whose next token is a function of the tokens before it


def next_token(tokens: list[int]) -> int:
    """A fake model that mostly repeats its period-3 loop (n-gram drafts often right), sometimes not (rejections),
    and sometimes ends (EOS inside an accepted run)."""
    digest = (sum(tokens[-5:]) * 31 + len(tokens)) % 97
    if digest == 0:
        return EOS
    if digest < 12:
        return 10 + digest
    return tokens[-3]


def make_scheduler(num_blocks: int = 256, **config: object) -> Scheduler:
    speculative = {"num_speculative_tokens": 3, "disable_by_batch_size": None, **config.pop("speculative", {})}
    engine_config = EngineConfig(block_size=BLOCK_SIZE, speculative_config=speculative, **config)
    return Scheduler(engine_config, num_blocks, num_blocks * BLOCK_SIZE, eos_token_ids={EOS})


def make_request(request_id: str, prompt: list[int], max_tokens: int = 16, **params: object) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params), max_tokens)


class ShadowRunner:
    """What the model runner does with a plan, on token ids: writes each input token (drafts included) into its KV
    slot, checks every position a request attends to holds its real token (or, within the step, the draft before
    it), samples `next_token` on every row from the last known token on, and accepts drafts as the runner does."""

    def __init__(self) -> None:
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.kv: dict[tuple[int, int], int] = {}

    def run(self, scheduler: Scheduler, plan: StepPlan) -> StepResult:
        for request_id in plan.finished_request_ids + plan.preempted_request_ids:
            self.block_tables.pop(request_id, None)
            self.num_computed.pop(request_id, None)
        for new in plan.new_requests:
            self.block_tables[new.request_id] = list(new.block_ids)
            self.num_computed[new.request_id] = new.num_computed_tokens
        for cached in plan.cached_requests:
            self.block_tables[cached.request_id].extend(cached.new_block_ids)
            assert cached.num_computed_tokens == self.num_computed[cached.request_id], "runner and scheduler disagree"
        result = StepResult()
        for request_id, num in plan.num_scheduled_tokens.items():
            request = scheduler.requests[request_id]
            drafts = plan.spec_token_ids.get(request_id, [])
            tokens = request.token_ids + drafts
            table, start = self.block_tables[request_id], self.num_computed[request_id]
            assert table == scheduler.kv_cache.block_ids(request_id)
            assert start + num == len(tokens) or not drafts, "drafts run after the last known token"
            assert start + num <= len(table) * BLOCK_SIZE
            for position in range(start, start + num):
                self.kv[(table[position // BLOCK_SIZE], position % BLOCK_SIZE)] = tokens[position]
            read = [self.kv.get((table[p // BLOCK_SIZE], p % BLOCK_SIZE)) for p in range(start + num)]
            assert read == tokens[: start + num], f"{request_id} attends to wrong KV"
            self.num_computed[request_id] = start + num
            if start + num < len(tokens):
                continue  # a prompt chunk short of the end samples nothing
            known = request.token_ids
            sampled = [next_token(known + drafts[:row]) for row in range(len(drafts) + 1)]
            num_accepted = 0
            while num_accepted < len(drafts) and sampled[num_accepted] == drafts[num_accepted]:
                num_accepted += 1
            self.num_computed[request_id] -= len(drafts) - num_accepted
            result.request_ids.append(request_id)
            result.sampled_token_ids.append(sampled[: num_accepted + 1])
        return result


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    while len(tokens) - len(prompt) < max_tokens:
        tokens.append(next_token(tokens))
        if tokens[-1] == EOS:
            break
    return tokens[len(prompt) :]


def run_workload(scheduler: Scheduler, prompts: dict[str, list[int]], max_tokens: dict[str, int]) -> dict:
    runner = ShadowRunner()
    outputs: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    for request_id, prompt in prompts.items():
        scheduler.add_request(make_request(request_id, prompt, max_tokens[request_id]))
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        plan = scheduler.schedule()
        assert plan.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
        for update in scheduler.update_from_output(plan, runner.run(scheduler, plan)):
            outputs[update.request.request_id].extend(update.new_token_ids)
    assert not scheduler.has_unfinished_requests()
    return outputs


@pytest.mark.parametrize("num_blocks", [256, 14], ids=["roomy", "preempting"])
def test_tokens_with_drafts_are_the_models_tokens_and_every_block_comes_back(num_blocks: int):
    rng = random.Random(num_blocks)
    prompts = {f"r{i}": [rng.randrange(10, 40) for _ in range(rng.randrange(3, 12))] for i in range(8)}
    max_tokens = {request_id: rng.randrange(1, 30) for request_id in prompts}
    scheduler = make_scheduler(num_blocks, max_num_batched_tokens=16, max_num_seqs=6)
    outputs = run_workload(scheduler, prompts, max_tokens)
    for request_id, prompt in prompts.items():
        assert outputs[request_id] == expected_output(prompt, max_tokens[request_id]), request_id
    assert scheduler.num_accepted_draft_tokens > 20
    assert scheduler.num_draft_tokens > scheduler.num_accepted_draft_tokens  # rejections happened too
    if num_blocks == 14:
        assert scheduler.num_preemptions > 0
    pool = scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks


def decode_plan(scheduler: Scheduler, request: Request) -> StepPlan:
    """Prefill the request (its first token sampled as `next_token` would), then plan its first decode step."""
    scheduler.add_request(request)
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, StepResult([request.request_id], [[next_token(request.token_ids)]]))
    return scheduler.schedule()


def test_a_decode_step_carries_drafts_and_the_rejected_ones_are_taken_back():
    scheduler = make_scheduler()
    request = make_request("r", [20, 21, 22, 20, 21], max_tokens=10)
    plan = decode_plan(scheduler, request)  # the prompt's loop predicts 22 first; its last token is 22
    assert request.token_ids[-1] == 22
    assert plan.spec_token_ids == {"r": [20, 21, 22]}
    assert plan.num_scheduled_tokens == {"r": 4}
    assert scheduler.schedule().num_scheduled_tokens == {}  # not planned again while its drafts are in flight
    # The model agrees with the first draft only, then samples 30.
    updates = scheduler.update_from_output(plan, StepResult(["r"], [[20, 30]]))
    assert updates[0].new_token_ids == [20, 30]
    assert request.output_token_ids == [22, 20, 30]
    assert request.num_computed_tokens == request.num_tokens - 1
    assert scheduler.num_draft_tokens == 3 and scheduler.num_accepted_draft_tokens == 1
    next_plan = scheduler.schedule()
    assert next_plan.cached_requests[0].num_computed_tokens == request.num_tokens - 1


def test_drafts_stop_at_the_length_limit_and_tokens_after_a_stop_are_dropped():
    scheduler = make_scheduler()
    request = make_request("r", [20, 21, 22, 20, 21], max_tokens=3)
    plan = decode_plan(scheduler, request)
    assert plan.spec_token_ids == {"r": [20]}  # one output so far, two to go: one draft and the token after it
    scheduler = make_scheduler()
    request = make_request("s", [20, 21, 22, 20, 21], max_tokens=10, stop_token_ids=[21])
    plan = decode_plan(scheduler, request)
    updates = scheduler.update_from_output(plan, StepResult(["s"], [[20, 21, 22, 5]]))
    assert updates[0].new_token_ids == [20, 21] and updates[0].finished
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.pool.num_blocks


def test_failed_drafts_back_off_and_accepted_ones_set_the_next_draft_count():
    scheduler = make_scheduler()
    request = make_request("r", [20, 21, 22, 20, 21], max_tokens=60)
    plan = decode_plan(scheduler, request)
    gaps = []
    for _ in range(3):  # all drafts rejected, three times: no drafts for 1, then 2, then 4 steps
        assert len(plan.spec_token_ids["r"]) >= 1
        scheduler.update_from_output(plan, StepResult(["r"], [[30]]))
        plan, gap = scheduler.schedule(), 0
        while not plan.spec_token_ids:
            assert plan.num_scheduled_tokens == {"r": 1}
            scheduler.update_from_output(plan, StepResult(["r"], [[21]]))  # keeps "21" recurring: drafts exist
            plan, gap = scheduler.schedule(), gap + 1
        gaps.append(gap)
    assert gaps == [1, 2, 4]
    # One accepted draft: the next step proposes two at most, and the back-off starts over.
    drafts = plan.spec_token_ids["r"]
    scheduler.update_from_output(plan, StepResult(["r"], [[drafts[0], 21]]))
    plan = scheduler.schedule()
    assert 1 <= len(plan.spec_token_ids["r"]) <= 2
    scheduler.update_from_output(plan, StepResult(["r"], [[30]]))
    plan = scheduler.schedule()
    assert plan.spec_token_ids == {}
    scheduler.update_from_output(plan, StepResult(["r"], [[21]]))
    assert scheduler.schedule().spec_token_ids  # a gap of one step again


def test_no_drafts_for_large_batches_or_penalties():
    scheduler = make_scheduler(speculative={"disable_by_batch_size": 1})
    for index in range(2):
        scheduler.add_request(make_request(f"r{index}", [20, 21, 22, 20, 21], max_tokens=10))
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, StepResult(["r0", "r1"], [[22], [22]]))
    plan = scheduler.schedule()
    assert plan.spec_token_ids == {} and plan.num_scheduled_tokens == {"r0": 1, "r1": 1}
    scheduler = make_scheduler()
    plan = decode_plan(scheduler, make_request("p", [20, 21, 22, 20, 21], max_tokens=10, presence_penalty=0.5))
    assert plan.spec_token_ids == {} and plan.num_scheduled_tokens == {"p": 1}


# ---------------------------------------------------------------------------------------------------------------
# The engine, on real weights

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SPECULATIVE = {"num_speculative_tokens": 3, "disable_by_batch_size": None}


def token_ids_of(llm, prompts, params) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]


def test_tiny_model_tokens_are_the_same_with_drafts_rejected_or_accepted(make_llm, tiny_model_dir):
    # Random weights rarely repeat themselves: drafts get rejected. A large logit bias makes one token win every
    # step: its drafts are accepted.
    prompts = ["The quick brown fox jumps", "one two one two one two", [5, 6, 7, 5, 6, 7, 5, 6]]
    biased = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logit_bias={77: 100.0}, logprobs=1)
    chunked = {"max_num_batched_tokens": 8, "max_num_seqs": 4}
    plain = make_llm(tiny_model_dir, **chunked)
    speculative = make_llm(tiny_model_dir, speculative_config=SPECULATIVE, **chunked)
    for params in (GREEDY, biased, SamplingParams(temperature=0.0, max_tokens=9, stop_token_ids=[77])):
        assert token_ids_of(speculative, prompts, params) == token_ids_of(plain, prompts, params)
    scheduler = speculative.engine.scheduler
    assert scheduler.num_draft_tokens > scheduler.num_accepted_draft_tokens > 40
    outputs = speculative.generate(prompts[:1], biased, use_tqdm=False)[0].outputs[0]
    assert len(outputs.logprobs) == len(outputs.token_ids) == 24
    assert_no_leaked_blocks(speculative)


def test_seeded_sampling_with_drafts_repeats_itself(make_llm, tiny_model_dir):
    llm = make_llm(tiny_model_dir, speculative_config=SPECULATIVE)
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True, logit_bias={77: 12.0})
    first = token_ids_of(llm, ["one two one two"], params)
    assert first == token_ids_of(llm, ["one two one two"], params)
    assert len(first[0]) == 20
    assert llm.engine.scheduler.num_accepted_draft_tokens > 0
    assert_no_leaked_blocks(llm)


@pytest.fixture(scope="module")
def smollm2_speculative():
    from executor import LLM

    return LLM(model="smollm2-135m-instruct", show_progress=False, num_kv_blocks=256, speculative_config=SPECULATIVE)


@pytest.mark.slow
def test_smollm2_greedy_tokens_with_drafts_equal_hf_transformers(smollm2_speculative, smollm2_dir, hf_reference):
    prompts = [
        "the island of the island of the island of",
        "Write a list: apples, pears, apples, pears, apples,",
    ]
    tokenizer = smollm2_speculative.tokenizer
    for prompt in prompts:
        prompt_ids = tokenizer.encode(prompt)
        ours = token_ids_of(smollm2_speculative, [prompt_ids], GREEDY)[0]
        assert ours == hf_reference.greedy(smollm2_dir, prompt_ids, GREEDY.max_tokens), prompt
    scheduler = smollm2_speculative.engine.scheduler
    # Drafts were accepted (19 of the 48 tokens came as drafts when this was written).
    assert scheduler.num_accepted_draft_tokens > GREEDY.max_tokens // 2
    assert_no_leaked_blocks(smollm2_speculative)


@pytest.mark.slow
def test_smollm2_logprobs_with_drafts_match_one_token_steps(smollm2_speculative, smollm2_llm):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    prompt = "the island of the island of the island of"
    ours = smollm2_speculative.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    plain = smollm2_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert ours.token_ids == plain.token_ids
    for token_id, with_drafts, one_step in zip(ours.token_ids, ours.logprobs, plain.logprobs, strict=True):
        assert list(with_drafts) == list(one_step)
        assert with_drafts[token_id].rank == one_step[token_id].rank
        assert with_drafts[token_id].logprob == pytest.approx(one_step[token_id].logprob, abs=1e-3)
