"""The offline `LLM` as vLLM's: its keyword arguments, prompt forms, vLLM-shaped logprobs, the model's generation
defaults, and TP offline on a Ray it starts itself."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from configs.sampling_params import SamplingParams
from tests.helpers import assert_no_leaked_blocks
from tests.test_parity import random_prompts

TEXT = "The capital of France is"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    from executor import LLM

    return LLM(model=str(tiny_model_dir), show_progress=False, num_kv_blocks=256)


def test_every_prompt_form_gives_the_tokens_of_the_string_prompt(tiny_llm):
    token_ids = tiny_llm.get_tokenizer().encode(TEXT)
    (expected,) = tiny_llm.generate(TEXT, GREEDY, use_tqdm=False)
    assert expected.prompt_token_ids == token_ids
    forms = [{"prompt": TEXT}, {"prompt_token_ids": token_ids}, token_ids]
    singles = [tiny_llm.generate(form, GREEDY, use_tqdm=False) for form in forms]
    assert [len(outputs) for outputs in singles] == [1, 1, 1]
    batched = tiny_llm.generate([TEXT, *forms], GREEDY, use_tqdm=False)
    for output in [outputs[0] for outputs in singles] + batched:
        assert output.prompt_token_ids == token_ids
        assert output.outputs[0].token_ids == expected.outputs[0].token_ids
    # Text forms report their text, token forms none (as vLLM).
    assert [output.prompt for output in batched] == [TEXT, TEXT, None, None]
    assert_no_leaked_blocks(tiny_llm)


@pytest.mark.parametrize(
    ("prompts", "error", "match"),
    [
        (42, TypeError, "prompts must be a string"),
        ([TEXT, 3.5], TypeError, "each prompt must be .* got float"),
        ({"prompt": 5}, TypeError, "'prompt' must be a string"),
        ({"prompt_token_ids": "1 2 3"}, TypeError, "'prompt_token_ids' must be a list of ints"),
        ({"prompt_token_ids": [1, "2"]}, TypeError, "prompt token ids must be ints, got '2'"),
        ({"prompt": TEXT, "prompt_token_ids": [1, 2]}, ValueError, "exactly one of 'prompt'"),
        ({"multi_modal_data": {}}, ValueError, "'multi_modal_data' is not supported"),
        ([[5, 6], [10**9]], ValueError, "out of the vocabulary"),
        ({"prompt_token_ids": []}, ValueError, "prompt must not be empty"),
    ],
)
def test_bad_prompts_fail_before_any_prompt_runs(tiny_llm, prompts, error, match):
    with pytest.raises(error, match=match):
        tiny_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()
    assert_no_leaked_blocks(tiny_llm)


def test_sampling_params_of_another_type_fail(tiny_llm):
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        tiny_llm.generate(TEXT, {"temperature": 0}, use_tqdm=False)
    with pytest.raises(ValueError, match="got 1 sampling params for 2 prompts"):
        tiny_llm.generate([TEXT, TEXT], [GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs must be at most 20"):
        tiny_llm.generate(TEXT, SamplingParams(logprobs=21), use_tqdm=False)


def test_unknown_keyword_arguments_are_named(tiny_model_dir):
    from executor import LLM

    with pytest.raises(TypeError, match="'tensor_parallel_sizes'; did you mean 'tensor_parallel_size'"):
        LLM(model=str(tiny_model_dir), tensor_parallel_sizes=2)
    with pytest.raises(TypeError, match="'trust_remote_code'"):
        LLM(model=str(tiny_model_dir), trust_remote_code=True)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(model=str(tiny_model_dir), tensor_parallel_size=0)
    with pytest.raises(ValueError, match="enforce_eager must be one of"):
        LLM(model=str(tiny_model_dir), enforce_eager="yes")


def test_vllm_keyword_arguments_apply(tiny_model_dir):
    from executor import LLM

    def build(seed: int) -> LLM:
        return LLM(
            model=str(tiny_model_dir),
            show_progress=False,
            dtype="float",
            max_model_len=64,
            gpu_memory_utilization=0.5,
            enforce_eager=True,
            seed=seed,
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            num_kv_blocks=32,
        )

    llm = build(seed=3)
    config = llm.config
    assert (config.model.dtype, config.model.seed, config.runtime.cuda_graphs) == ("float32", 3, "off")
    assert config.cache.gpu_memory_utilization == 0.5
    assert llm.engine.model_info.dtype == torch.float32
    with pytest.raises(ValueError, match="maximum context length is 64 tokens"):
        llm.generate([[5] * 60], SamplingParams(max_tokens=8), use_tqdm=False)
    # The engine's seed (set as it loads, as vLLM's) drives the requests that bring none.
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    first = llm.generate(TEXT, unseeded, use_tqdm=False)[0].outputs[0].token_ids
    again, other = (build(seed).generate(TEXT, unseeded, use_tqdm=False)[0].outputs[0].token_ids for seed in (3, 4))
    assert first == again != other


def test_logprobs_are_vllm_shaped_and_add_up_to_cumulative_logprob(tiny_llm, tiny_model_dir, hf_reference):
    from executor import Logprob

    params = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, logprobs=3, n=2)
    output = tiny_llm.generate(TEXT, params, use_tqdm=False)[0]
    tokenizer = tiny_llm.get_tokenizer()
    for completion in output.outputs:
        assert len(completion.logprobs) == len(completion.token_ids) == 8
        reference = torch.log_softmax(
            hf_reference.logits_after(tiny_model_dir, output.prompt_token_ids, completion.token_ids), dim=-1
        )
        for token_id, position, expected in zip(completion.token_ids, completion.logprobs, reference):
            assert next(iter(position)) == token_id  # the sampled token first, then the top 3
            assert all(isinstance(entry, Logprob) for entry in position.values())
            sampled = position[token_id]
            ranks = sorted(entry.rank for entry in position.values())
            assert ranks == ([1, 2, 3] if sampled.rank <= 3 else [1, 2, 3, sampled.rank])
            top = sorted((entry.rank, token) for token, entry in position.items() if entry.rank <= 3)
            assert [token for _, token in top] == expected.topk(3).indices.tolist()
            for token, entry in position.items():
                assert entry.decoded_token == tokenizer.decode([token])
                assert entry.logprob == pytest.approx(expected[token].item(), abs=1e-3)
            # Rank as vLLM counts it: the tokens at least as likely as the sampled one.
            at_least = int((expected >= expected[token_id] - 1e-4).sum())
            above = int((expected > expected[token_id] + 1e-4).sum())
            assert above < sampled.rank <= at_least
        sampled_logprobs = [
            position[token_id].logprob for token_id, position in zip(completion.token_ids, completion.logprobs)
        ]
        assert completion.cumulative_logprob == pytest.approx(math.fsum(sampled_logprobs), abs=1e-6)
    assert output.outputs[0].token_ids != output.outputs[1].token_ids


def test_logprobs_zero_and_none(tiny_llm):
    sampled_only = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    completion = tiny_llm.generate(TEXT, sampled_only, use_tqdm=False)[0].outputs[0]
    assert [list(position) for position in completion.logprobs] == [[token] for token in completion.token_ids]
    assert all(position[token].rank == 1 for token, position in zip(completion.token_ids, completion.logprobs))
    assert completion.cumulative_logprob == pytest.approx(
        sum(position[token].logprob for token, position in zip(completion.token_ids, completion.logprobs))
    )
    completion = tiny_llm.generate(TEXT, GREEDY, use_tqdm=False)[0].outputs[0]
    assert completion.logprobs is None and completion.cumulative_logprob is None


def test_get_tokenizer_encodes_prompts_and_decodes_outputs(tiny_llm):
    tokenizer = tiny_llm.get_tokenizer()
    output = tiny_llm.generate(TEXT, GREEDY, use_tqdm=False)[0]
    assert output.prompt_token_ids == tokenizer.encode(TEXT)
    assert output.outputs[0].text == tokenizer.decode(output.outputs[0].token_ids, skip_special_tokens=True)


def test_more_prompts_than_the_waiting_queue_holds(tiny_llm, tiny_model_dir):
    from executor import LLM

    prompts = random_prompts(9, seed=41)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, n=2)
    expected = [[c.token_ids for c in o.outputs] for o in tiny_llm.generate(prompts, params, use_tqdm=False)]
    small_queue = LLM(model=str(tiny_model_dir), show_progress=False, num_kv_blocks=64, max_waiting_requests=3)
    outputs = small_queue.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == expected
    assert [output.prompt_token_ids for output in outputs] == prompts
    with pytest.raises(ValueError, match="n must be at most max_waiting_requests"):
        small_queue.generate(prompts[:1], SamplingParams(n=4), use_tqdm=False)
    assert_no_leaked_blocks(small_queue)


def model_copy(source: Path, target: Path, generation_defaults: dict) -> Path:
    """The tiny model's files linked into `target`, with `generation_defaults` added to its generation_config."""
    target.mkdir()
    for item in source.iterdir():
        if item.name != "generation_config.json":
            (target / item.name).symlink_to(item)
    generation = json.loads((source / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps({**generation, **generation_defaults}))
    return target


@pytest.fixture(scope="module")
def defaults_model_dir(tmp_path_factory, tiny_model_dir) -> Path:
    # top_k 1 makes the shipped defaults deterministic; the penalty makes them differ from plain greedy.
    defaults = {"temperature": 0.7, "top_k": 1, "repetition_penalty": 1.3, "max_new_tokens": 6, "do_sample": True}
    return model_copy(tiny_model_dir, tmp_path_factory.mktemp("defaults") / "model", defaults)


def test_generation_config_supplies_the_defaults(defaults_model_dir):
    from executor import LLM

    llm = LLM(model=str(defaults_model_dir), show_progress=False, num_kv_blocks=64)
    shipped = SamplingParams(temperature=0.7, top_k=1, repetition_penalty=1.3, max_tokens=6)
    assert llm.get_default_sampling_params() == shipped
    (output,) = llm.generate(TEXT, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 6
    assert output.outputs[0].token_ids == llm.generate(TEXT, shipped, use_tqdm=False)[0].outputs[0].token_ids
    (chat,) = llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)
    assert len(chat.outputs[0].token_ids) == 6
    # Given SamplingParams win entirely, as in vLLM.
    assert len(llm.generate(TEXT, SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_generation_config_vllm_ignores_the_model_defaults(defaults_model_dir):
    from executor import LLM

    llm = LLM(model=str(defaults_model_dir), show_progress=False, num_kv_blocks=64, generation_config="vllm")
    assert llm.get_default_sampling_params() == SamplingParams()
    (output,) = llm.generate(TEXT, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == SamplingParams().max_tokens == 16


def test_default_max_tokens_is_capped_at_the_context_left(tmp_path, tiny_model_dir):
    from executor import LLM

    model_dir = model_copy(tiny_model_dir, tmp_path / "model", {"max_new_tokens": 100, "temperature": 0.0})
    llm = LLM(model=str(model_dir), show_progress=False, num_kv_blocks=64, max_model_len=32)
    prompt = [5] * 28
    completion = llm.generate([prompt], use_tqdm=False)[0].outputs[0]
    assert (len(completion.token_ids), completion.finish_reason) == (4, "length")
    # A max_tokens the caller chose is not cut down: it is refused.
    with pytest.raises(ValueError, match="maximum context length is 32"):
        llm.generate([prompt], SamplingParams(max_tokens=100), use_tqdm=False)


def test_bad_generation_config_values_are_ignored(tmp_path, tiny_model_dir):
    from executor import LLM

    model_dir = model_copy(tiny_model_dir, tmp_path / "model", {"top_p": 7.0, "max_new_tokens": 5})
    llm = LLM(model=str(model_dir), show_progress=False, num_kv_blocks=64)
    assert llm.get_default_sampling_params() == SamplingParams(max_tokens=5)


# Runs in a fresh Python: no Ray is up, so LLM starts its own, sized for the workers and not for the machine's cores.
TP_SCRIPT = """
import json, sys
import ray
from executor import LLM, SamplingParams

model_dir, prompts, out_path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
assert not ray.is_initialized()
llm = LLM(model=model_dir, tensor_parallel_size=3, num_kv_blocks=64, show_progress=False)
outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
with open(out_path, "w") as out:
    json.dump({
        "tokens": [output.outputs[0].token_ids for output in outputs],
        "num_workers": len(llm.engine.core.executor.workers),
        "cluster_cpus": ray.cluster_resources()["CPU"],
    }, out)
"""


@pytest.mark.subprocess
def test_tp3_offline_starts_a_ray_that_fits_its_workers(tmp_path, smollm2_dir):
    """TP=3 needs 3 worker bundles of 1 CPU: on a 2-core machine a Ray sized by the cores could never place them."""
    from executor import LLM
    from model_executor.tiny_model import write_tiny_llama

    # 6 heads and 3 KV heads, MLP and vocab all split three ways.
    model_dir = write_tiny_llama(
        tmp_path / "tiny-tp3",
        smollm2_dir,
        hidden_size=96,
        intermediate_size=192,
        num_attention_heads=6,
        num_key_value_heads=3,
    )
    prompts = random_prompts(3, seed=51)
    one_rank = LLM(model=str(model_dir), show_progress=False, num_kv_blocks=64)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [output.outputs[0].token_ids for output in one_rank.generate(prompts, greedy, use_tqdm=False)]

    out_path = tmp_path / "result.json"
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    completed = subprocess.run(
        [sys.executable, "-c", TP_SCRIPT, str(model_dir), json.dumps(prompts), str(out_path)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    result = json.loads(out_path.read_text())
    assert result["num_workers"] == 3
    assert result["cluster_cpus"] >= 3
    assert result["tokens"] == expected
