"""Correctness anchor: our greedy tokens equal HF transformers' greedy tokens on the same weights."""

from __future__ import annotations

import random

import pytest

from configs.sampling_params import SamplingParams
from tests.helpers import assert_no_leaked_blocks

MAX_NEW_TOKENS = 32
SMOLLM2_PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a little robot who",
    "def fibonacci(n):",
    "List three facts about the ocean:\n1.",
    "Translate to French: Good morning, how are you today? I hope the weather is nice where you live.",
]


def random_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(1, 60))] for _ in range(count)]


def greedy(max_tokens: int = MAX_NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


@pytest.mark.slow
def test_smollm2_matches_hf_alone_and_batched(smollm2_llm, smollm2_dir, hf_reference):
    tokenizer = smollm2_llm.tokenizer
    prompt_ids = [tokenizer.encode(prompt) for prompt in SMOLLM2_PROMPTS]
    expected = [hf_reference.greedy(smollm2_dir, ids, MAX_NEW_TOKENS) for ids in prompt_ids]
    batched = smollm2_llm.generate(prompt_ids, greedy(), use_tqdm=False)
    assert [output.outputs[0].token_ids for output in batched] == expected
    for ids, want in zip(prompt_ids, expected):
        alone = smollm2_llm.generate([ids], greedy(), use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == want
    assert_no_leaked_blocks(smollm2_llm)


@pytest.mark.slow
def test_smollm2_batch_of_fourteen_matches_hf(smollm2_llm, smollm2_dir, hf_reference):
    """Fourteen decodes a step: two full register blocks of the CPU linear kernel and decoder stack, and a remainder."""
    tokenizer = smollm2_llm.tokenizer
    subjects = ["rivers", "volcanoes", "bees", "trains", "libraries", "glaciers", "chess", "bread", "comets"]
    prompts = [*SMOLLM2_PROMPTS, *(f"Here is a short paragraph about {subject}:" for subject in subjects)]
    prompt_ids = [tokenizer.encode(prompt) for prompt in prompts]
    expected = [hf_reference.greedy(smollm2_dir, ids, 16) for ids in prompt_ids]
    batched = smollm2_llm.generate(prompt_ids, greedy(16), use_tqdm=False)
    assert [output.outputs[0].token_ids for output in batched] == expected
    assert_no_leaked_blocks(smollm2_llm)


@pytest.mark.slow
def test_smollm2_chat_matches_hf(smollm2_llm, smollm2_dir, hf_reference):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    output = smollm2_llm.chat(messages, greedy(48), use_tqdm=False)[0]
    expected = hf_reference.greedy(smollm2_dir, output.prompt_token_ids, 48)
    assert output.outputs[0].token_ids == expected
    assert "Paris" in output.outputs[0].text
    assert output.outputs[0].finish_reason == "stop"  # the instruct model ends its turn with <|im_end|>


@pytest.mark.parametrize("model_fixture", ["tiny_model_dir", "tiny_llama3_rope_model_dir"])
def test_tiny_llama_matches_hf(request, model_fixture, make_llm, hf_reference):
    model_dir = request.getfixturevalue(model_fixture)
    prompts = random_prompts(6, seed=1)
    expected = [hf_reference.greedy(model_dir, ids, 40) for ids in prompts]
    llm = make_llm(model_dir)
    batched = llm.generate(prompts, greedy(40), use_tqdm=False)
    assert [output.outputs[0].token_ids for output in batched] == expected
    alone = [llm.generate([ids], greedy(40), use_tqdm=False)[0].outputs[0].token_ids for ids in prompts]
    assert alone == expected
    assert_no_leaked_blocks(llm)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_same_tokens_with_and_without_prefix_caching(tiny_model_dir, make_llm, hf_reference, enable_prefix_caching):
    shared_prefix = random_prompts(1, seed=2)[0] * 3  # > 3 blocks shared by every prompt
    prompts = [shared_prefix + tail for tail in random_prompts(4, seed=3)]
    expected = [hf_reference.greedy(tiny_model_dir, ids, 24) for ids in prompts]
    llm = make_llm(tiny_model_dir, enable_prefix_caching=enable_prefix_caching)
    first = llm.generate(prompts[:1], greedy(24), use_tqdm=False)
    rest = llm.generate(prompts[1:], greedy(24), use_tqdm=False)
    assert [output.outputs[0].token_ids for output in first + rest] == expected
    kv_cache = llm.engine.scheduler.kv_cache
    if enable_prefix_caching:
        assert kv_cache.prefix_cache_hits >= 3 * 16 * 3  # the three later prompts reused the shared blocks
    else:
        assert kv_cache.prefix_cache_hits == 0
    assert_no_leaked_blocks(llm)


@pytest.mark.parametrize("prioritize_prefill", [False, True])
def test_long_prompt_chunked_prefill_matches_hf(tiny_model_dir, make_llm, hf_reference, prioritize_prefill):
    long_prompt = [random.Random(4).randrange(3, 49152) for _ in range(1000)]
    short_prompts = random_prompts(3, seed=5)
    expected = [hf_reference.greedy(tiny_model_dir, ids, 32) for ids in [long_prompt, *short_prompts]]
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=128, prioritize_prefill=prioritize_prefill)
    outputs = llm.generate([long_prompt, *short_prompts], greedy(32), use_tqdm=False)
    assert [output.outputs[0].token_ids for output in outputs] == expected
    assert_no_leaked_blocks(llm)


@pytest.mark.slow
def test_smollm2_long_prompt_chunked_prefill_matches_hf(smollm2_dir, make_llm, hf_reference, smollm2_llm):
    text = " ".join(SMOLLM2_PROMPTS) * 20
    prompt_ids = smollm2_llm.tokenizer.encode(text)[:1000]
    expected = hf_reference.greedy(smollm2_dir, prompt_ids, 32)
    llm = make_llm(smollm2_dir, max_num_batched_tokens=128, num_kv_blocks=128)
    assert llm.generate([prompt_ids], greedy(32), use_tqdm=False)[0].outputs[0].token_ids == expected


def test_preemption_keeps_greedy_tokens(tiny_model_dir, make_llm, hf_reference):
    prompts = random_prompts(8, seed=6)
    expected = [hf_reference.greedy(tiny_model_dir, ids, 48) for ids in prompts]
    # 12 blocks of 16 tokens cannot hold 8 requests of up to ~100 tokens: the newest get preempted.
    llm = make_llm(tiny_model_dir, num_kv_blocks=12)
    outputs = llm.generate(prompts, greedy(48), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [output.outputs[0].token_ids for output in outputs] == expected
    assert_no_leaked_blocks(llm)
