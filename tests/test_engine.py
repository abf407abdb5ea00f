"""The offline engine as a user sees it: sampling options, n > 1, stops, aborts, bad input."""

from __future__ import annotations

import math

import pytest

from configs.sampling_params import SamplingParams
from tests.helpers import assert_no_leaked_blocks
from tests.test_parity import random_prompts


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    from executor import LLM

    return LLM(model=str(tiny_model_dir), show_progress=False, num_kv_blocks=256)


def test_outputs_in_prompt_order_with_ids_and_finish_reasons(tiny_llm):
    prompts = random_prompts(5, seed=10)
    outputs = tiny_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)
    assert [output.prompt_token_ids for output in outputs] == prompts
    for output in outputs:
        (completion,) = output.outputs
        assert len(completion.token_ids) == 7
        assert completion.finish_reason == "length"
        assert completion.text == tiny_llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert_no_leaked_blocks(tiny_llm)


def test_string_prompts_are_tokenized(tiny_llm):
    output = tiny_llm.generate("Hello world", SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert output.prompt == "Hello world"
    assert output.prompt_token_ids == tiny_llm.tokenizer.encode("Hello world")


def test_seed_reproducible_and_distinct(tiny_llm):
    prompt = random_prompts(1, seed=11)
    params = SamplingParams(temperature=1.5, max_tokens=16, seed=1234, ignore_eos=True)
    first = tiny_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    # Same seed inside a different batch: same tokens.
    mixed = (
        tiny_llm.generate(
            prompt + random_prompts(3, seed=12),
            [params] + [SamplingParams(temperature=1.0, max_tokens=16)] * 3,
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    other_seed = SamplingParams(temperature=1.5, max_tokens=16, seed=4321, ignore_eos=True)
    different = tiny_llm.generate(prompt, other_seed, use_tqdm=False)[0].outputs[0].token_ids
    assert first == mixed
    assert first != different


def test_n_completions_share_prompt_blocks(tiny_llm):
    prompt = random_prompts(1, seed=13)[0] * 2  # several full blocks
    kv_cache = tiny_llm.engine.scheduler.kv_cache
    hits_before = kv_cache.prefix_cache_hits
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    (output,) = tiny_llm.generate([prompt], params, use_tqdm=False)
    assert [completion.index for completion in output.outputs] == [0, 1, 2, 3]
    assert all(len(completion.token_ids) == 12 for completion in output.outputs)
    assert len({tuple(completion.token_ids) for completion in output.outputs}) > 1
    full_blocks = (len(prompt) - 1) // 16
    # Siblings 1..3 reused every full prompt block of sibling 0.
    assert kv_cache.prefix_cache_hits - hits_before >= 3 * full_blocks * 16
    assert_no_leaked_blocks(tiny_llm)


def test_reset_prefix_cache_forgets_cached_prompts(tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir)
    prompt = random_prompts(1, seed=15)[0] * 2
    params = SamplingParams(temperature=0, max_tokens=3)
    kv_cache = llm.engine.scheduler.kv_cache
    first = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    hits = kv_cache.prefix_cache_hits
    llm.generate([prompt], params, use_tqdm=False)
    assert kv_cache.prefix_cache_hits > hits  # cached: the second run reuses the prompt's blocks
    assert llm.reset_prefix_cache()
    hits = kv_cache.prefix_cache_hits
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == first
    assert kv_cache.prefix_cache_hits == hits
    assert_no_leaked_blocks(llm)


def test_n_completions_share_prompt_without_prefix_caching(tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir, enable_prefix_caching=False)
    prompt = random_prompts(1, seed=14)[0] * 2
    llm.generate([prompt], SamplingParams(n=3, max_tokens=4), use_tqdm=False)
    assert llm.engine.scheduler.kv_cache.prefix_cache_hits >= 2 * ((len(prompt) - 1) // 16) * 16
    # An unrelated later request with the same prompt gets no hits: caching is off.
    hits = llm.engine.scheduler.kv_cache.prefix_cache_hits
    llm.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    assert llm.engine.scheduler.kv_cache.prefix_cache_hits == hits


def test_stop_token_ids_and_min_tokens(tiny_llm):
    prompt = random_prompts(1, seed=15)
    free_run = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    tokens = free_run[0].outputs[0].token_ids
    stop_token = tokens[5]
    first_index = tokens.index(stop_token)
    stopped = tiny_llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_token]), use_tqdm=False
    )[0].outputs[0]
    assert stopped.token_ids == tokens[: first_index + 1]
    assert stopped.finish_reason == "stop"
    assert stopped.stop_reason == stop_token


@pytest.mark.slow
def test_stop_string_cuts_text(smollm2_llm):
    params = SamplingParams(temperature=0, max_tokens=40, stop=["Paris"])
    completion = smollm2_llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == "Paris"
    assert "Paris" not in completion.text
    kept = SamplingParams(temperature=0, max_tokens=40, stop=["Paris"], include_stop_str_in_output=True)
    completion = smollm2_llm.generate(["The capital of France is"], kept, use_tqdm=False)[0].outputs[0]
    assert completion.text.endswith("Paris")
    assert_no_leaked_blocks(smollm2_llm)


def test_logprobs_are_consistent(tiny_llm):
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3)
    completion = tiny_llm.generate(random_prompts(1, seed=16), params, use_tqdm=False)[0].outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids)
    for token_id, position in zip(completion.token_ids, completion.logprobs):
        assert next(iter(position)) == token_id  # the sampled token first, as vLLM
        assert position[token_id].rank == 1  # greedy picks the most likely token
        assert sorted(entry.rank for entry in position.values()) == [1, 2, 3]
        assert sum(math.exp(entry.logprob) for entry in position.values()) <= 1.0 + 1e-5


def test_abort_frees_blocks_and_others_finish(tiny_llm):
    engine = tiny_llm.engine
    prompts = random_prompts(3, seed=17)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"abort-test-{index}", prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request(["abort-test-1"])
    finished = {}
    for _ in range(200):
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        if not engine.has_unfinished_requests():
            break
    assert set(finished) == {"abort-test-0", "abort-test-2"}
    assert all(len(output.outputs[0].token_ids) == 50 for output in finished.values())
    assert_no_leaked_blocks(tiny_llm)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "prompt must not be empty"),
        ("", SamplingParams(), "prompt must not be empty"),
        ([5, 49152], SamplingParams(), "out of the vocabulary"),
        ([-1], SamplingParams(), "out of the vocabulary"),
        ([5] * 2048, SamplingParams(), "maximum context length is 2048 tokens"),
        ([5] * 2000, SamplingParams(max_tokens=100), "maximum context length is 2048 tokens"),
        ([5], SamplingParams(logit_bias={60000: 1.0}), "logit_bias"),
        ([5], SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(tiny_llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        tiny_llm.generate([[7, 8, 9], prompt], params, use_tqdm=False)
    assert_no_leaked_blocks(tiny_llm)
    output = tiny_llm.generate([[7, 8, 9]], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert output.finished


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.5, "temperature must be non-negative"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
        ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
        ("n", 0, "n must be an integer >= 1"),
        ("top_k", -5, "top_k"),
        ("min_p", 1.5, "min_p"),
        ("max_tokens", 0, "max_tokens must be an integer >= 1"),
        ("presence_penalty", 3.0, r"presence_penalty must be in \[-2, 2\]"),
        ("repetition_penalty", 0.0, "repetition_penalty"),
        ("logprobs", -1, "logprobs"),
        ("stop", [""], "stop"),
        ("logit_bias", {5: 500.0}, "logit_bias"),
    ],
)
def test_invalid_sampling_params_name_the_parameter(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_max_tokens_none_runs_to_context_limit(tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir, max_model_len=40)
    output = llm.generate([[5] * 30], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 10
    assert output.outputs[0].finish_reason == "length"


def test_a_new_engine_warms_up_on_dummy_prompts_and_forgets_them(tiny_model_dir, make_llm):
    """One step budget of dummy prompts and two decode steps before serving; nothing of them stays behind, and a
    KV cache too small for one dummy prompt skips the warm-up."""
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=256)
    runner = llm.engine.core.executor.worker.runner
    assert runner.num_warm_up_prompts == 4  # 256 tokens in prompts of 64
    assert runner.requests == {} and runner.generators == {}
    assert_no_leaked_blocks(llm)
    tiny_cache = make_llm(tiny_model_dir, num_kv_blocks=4)
    assert tiny_cache.engine.core.executor.worker.runner.num_warm_up_prompts == 0
    assert len(tiny_cache.generate(["hello"], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids)
