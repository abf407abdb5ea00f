"""The engine on a CUDA GPU (compiled Triton kernels, decode CUDA graphs) against HF transformers on the same GPU.

CPU runs skip this module: it needs CUDA and compiled Triton kernels (not TRITON_INTERPRET=1).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import HFReference, assert_no_leaked_blocks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available on this machine")

CUDA = torch.device("cuda")
# A bf16 engine may flip a greedy choice only where fp32 logits are this close (HF bf16 against fp32 on the
# tiny model, teacher-forced, differs by up to 0.22; the tiny model's logits have a std of 1.6).
BF16_LOGIT_SLACK = 0.5


@pytest.fixture(autouse=True)
def compiled_triton() -> None:
    from cuda_ext.kernels import unified_attention

    if unified_attention.INTERPRETED:
        pytest.skip("this process interprets Triton kernels (TRITON_INTERPRET=1); the GPU needs compiled ones")


@pytest.fixture(scope="module")
def cuda_hf() -> HFReference:
    return HFReference("cuda")


def random_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1, *(rng.randrange(3, 49152) for _ in range(rng.randrange(4, 90)))] for _ in range(count)]


def greedy_tokens(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from executor import SamplingParams

    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


def cuda_llm(model_dir: Path, **engine_args: Any) -> Any:
    from executor import LLM

    engine_args.setdefault("num_kv_blocks", 256)
    engine_args.setdefault("dtype", "float32")
    return LLM(model=str(model_dir), device="cuda", show_progress=False, **engine_args)


def runner_of(llm: Any) -> Any:
    return llm.engine.core.executor.worker.runner


def test_fp32_engine_on_cuda_matches_hf_batched_and_alone(tiny_model_dir: Path, cuda_hf: HFReference) -> None:
    prompts = random_prompts(6, seed=1)
    expected = [cuda_hf.greedy(tiny_model_dir, ids, 40) for ids in prompts]
    llm = cuda_llm(tiny_model_dir)
    runner = runner_of(llm)
    assert runner.attention_backend.name == "triton" and runner.device.type == "cuda"
    assert greedy_tokens(llm, prompts, 40) == expected
    assert [greedy_tokens(llm, [ids], 40)[0] for ids in prompts] == expected
    # Decode steps replayed captured graphs (auto mode on CUDA), not the eager path.
    assert runner.decode_graphs.graphs and runner.decode_graphs.num_replays >= 40
    assert_no_leaked_blocks(llm)


def test_cuda_chunked_prefill_of_a_long_prompt_matches_hf(tiny_model_dir: Path, cuda_hf: HFReference) -> None:
    long_prompt = [random.Random(4).randrange(3, 49152) for _ in range(1000)]
    prompts = [long_prompt, *random_prompts(3, seed=5)]
    expected = [cuda_hf.greedy(tiny_model_dir, ids, 32) for ids in prompts]
    llm = cuda_llm(tiny_model_dir, max_num_batched_tokens=128)
    assert greedy_tokens(llm, prompts, 32) == expected
    assert_no_leaked_blocks(llm)


def test_cuda_prefix_cache_hits_keep_hf_tokens(tiny_model_dir: Path, cuda_hf: HFReference) -> None:
    shared_prefix = [1, *(random.Random(2).randrange(3, 49152) for _ in range(59))]  # three full blocks and more
    prompts = [shared_prefix + tail for tail in random_prompts(4, seed=3)]
    expected = [cuda_hf.greedy(tiny_model_dir, ids, 24) for ids in prompts]
    llm = cuda_llm(tiny_model_dir, enable_prefix_caching=True)
    first = greedy_tokens(llm, prompts[:1], 24)
    rest = greedy_tokens(llm, prompts[1:], 24)
    assert first + rest == expected
    assert llm.engine.scheduler.kv_cache.prefix_cache_hits >= 3 * 16 * 3
    assert_no_leaked_blocks(llm)


def test_cuda_preemption_keeps_hf_tokens(tiny_model_dir: Path, cuda_hf: HFReference) -> None:
    prompts = random_prompts(8, seed=6)
    expected = [cuda_hf.greedy(tiny_model_dir, ids, 48) for ids in prompts]
    llm = cuda_llm(tiny_model_dir, num_kv_blocks=12)
    assert greedy_tokens(llm, prompts, 48) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaked_blocks(llm)


def test_bf16_engine_on_cuda_picks_fp32_argmax_up_to_rounding(tiny_model_dir: Path, cuda_hf: HFReference) -> None:
    """The default dtype on CUDA: every greedy pick is fp32's best or within bf16 rounding of it."""
    prompts = random_prompts(6, seed=7)
    llm = cuda_llm(tiny_model_dir, dtype="auto")
    assert runner_of(llm).model_info.dtype == torch.bfloat16
    completions = greedy_tokens(llm, prompts, 32)
    exact = total = 0
    for prompt, completion in zip(prompts, completions):
        logits = cuda_hf.logits_after(tiny_model_dir, prompt, completion)
        chosen = logits.gather(1, torch.tensor(completion, device=CUDA)[:, None])[:, 0]
        gaps = logits.max(-1).values - chosen
        assert gaps.max().item() <= BF16_LOGIT_SLACK, (prompt, completion, gaps.tolist())
        exact += int((gaps == 0).sum())
        total += len(completion)
    assert exact >= 0.9 * total
    assert_no_leaked_blocks(llm)
