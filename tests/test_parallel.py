"""Tensor and pipeline parallelism on Ray worker actors (gloo on CPU): same greedy tokens as one rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from configs.sampling_params import SamplingParams
from tests.helpers import assert_no_leaked_blocks
from tests.test_parity import SMOLLM2_PROMPTS, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def tiny_reference(tiny_model_dir):
    from executor import LLM

    prompts = random_prompts(5, seed=21)
    llm = LLM(model=str(tiny_model_dir), show_progress=False, num_kv_blocks=128)
    return prompts, [output.outputs[0].token_ids for output in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize(("tensor_parallel_size", "pipeline_parallel_size"), [(2, 1), (1, 2), (2, 2)])
def test_tiny_tp_pp_equals_single_rank(
    ray_cluster, tiny_model_dir, tiny_reference, tensor_parallel_size, pipeline_parallel_size, monkeypatch
):
    import os

    import ray

    from executor import LLM

    prompts, expected = tiny_reference
    # An OpenMP setting of the launching process (the ranks' raylet started without it) goes along to the ranks.
    monkeypatch.setenv("GOMP_SPINCOUNT", "20000")
    llm = LLM(
        model=str(tiny_model_dir),
        show_progress=False,
        num_kv_blocks=128,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        worker_num_cpus=0.5,
        num_threads=1,
    )
    try:
        workers = llm.engine.core.executor.workers
        assert len(workers) == tensor_parallel_size * pipeline_parallel_size
        identities = ray.get([worker.identity.remote() for worker in workers])
        # One process per rank, none of them this one.
        assert len({identity["pid"] for identity in identities} | {os.getpid()}) == len(workers) + 1
        ranks = {(identity["pp_rank"], identity["tp_rank"]) for identity in identities}
        assert ranks == {(pp, tp) for pp in range(pipeline_parallel_size) for tp in range(tensor_parallel_size)}
        # The OpenMP spin setting chosen where the engine was launched reached every rank; no wait policy was
        # imposed on them where none was chosen (libgomp's default: spin, then sleep).
        for identity in identities:
            environment = Path(f"/proc/{identity['pid']}/environ").read_bytes().split(b"\0")
            assert b"GOMP_SPINCOUNT=20000" in environment
            policies = [entry for entry in environment if entry.startswith(b"OMP_WAIT_POLICY=")]
            assert policies == (
                [f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}".encode()] if "OMP_WAIT_POLICY" in os.environ else []
            )
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [output.outputs[0].token_ids for output in outputs] == expected
        assert_no_leaked_blocks(llm)
    finally:
        llm.engine.shutdown()


def test_tiny_tp_pp_with_drafts_equals_single_rank(ray_cluster, tiny_model_dir, tiny_reference):
    """Speculative decoding over TP=2 x PP=2: every rank runs the plan's drafts, the last stage's driver verifies
    them, the other ranks learn the accepted tokens and the rolled-back progress from the next plan."""
    from executor import LLM

    prompts, expected = tiny_reference
    biased = SamplingParams(temperature=0.0, max_tokens=24, logit_bias={77: 100.0, 78: 100.0, 79: 100.0})
    one_rank = LLM(model=str(tiny_model_dir), show_progress=False, num_kv_blocks=128)
    expected_biased = [output.outputs[0].token_ids for output in one_rank.generate(prompts, biased, use_tqdm=False)]
    llm = LLM(
        model=str(tiny_model_dir),
        show_progress=False,
        num_kv_blocks=128,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        worker_num_cpus=0.5,
        num_threads=1,
        speculative_config={"num_speculative_tokens": 3, "disable_by_batch_size": None},
    )
    try:
        for params, tokens in ((GREEDY, expected), (biased, expected_biased)):
            outputs = llm.generate(prompts, params, use_tqdm=False)
            assert [output.outputs[0].token_ids for output in outputs] == tokens
        assert llm.engine.scheduler.num_accepted_draft_tokens > 10
        assert_no_leaked_blocks(llm)
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_smollm2_tp3_matches_hf(ray_cluster, smollm2_dir, hf_reference):
    """9 heads and 3 KV heads split three ways: each rank holds 3 query heads and 1 KV head."""
    from executor import LLM

    llm = LLM(
        model="smollm2-135m-instruct",
        show_progress=False,
        num_kv_blocks=256,
        tensor_parallel_size=3,
        worker_num_cpus=0.5,
        num_threads=1,
    )
    try:
        prompt_ids = [llm.tokenizer.encode(prompt) for prompt in SMOLLM2_PROMPTS[:3]]
        expected = [hf_reference.greedy(smollm2_dir, ids, 24) for ids in prompt_ids]
        outputs = llm.generate(prompt_ids, GREEDY, use_tqdm=False)
        assert [output.outputs[0].token_ids for output in outputs] == expected
    finally:
        llm.engine.shutdown()
