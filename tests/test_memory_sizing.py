"""KV-cache sizing like vLLM: the GPU budget arithmetic, an explicit kv_cache_memory_gib, a max_model_len the cache
can never hold, the start-up capacity line, and (on CUDA only) gpu_memory_utilization over a profiled peak step."""

from __future__ import annotations

import gc
import logging
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from configs.engine_config import EngineConfig
from executor.scheduler import Scheduler
from executor.worker import kv_cache_memory_bytes
from model_executor.model_info import load_model_info
from model_executor.model_runner import ModelRunner

GIB = 2**30
# The tiny model's KV per 16-token block in fp32: K and V x 2 KV heads x head_dim 16 x 4 bytes x 2 layers x 16.
TINY_FP32_BLOCK_BYTES = 2 * 2 * 16 * 4 * 2 * 16


def gib_for_blocks(num_blocks: int) -> float:
    """A kv_cache_memory_gib that holds num_blocks of the tiny model's fp32 blocks and part of one more."""
    return (num_blocks * TINY_FP32_BLOCK_BYTES + TINY_FP32_BLOCK_BYTES // 2) / GIB


def engine_log(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [record.getMessage() for record in caplog.records if text in record.getMessage()]


# --- the budget arithmetic (bytes in, bytes out) ----------------------------------------------------------------------


def test_kv_budget_is_the_gpu_share_less_weights_peak_activations_and_memory_outside_torch() -> None:
    assert kv_cache_memory_bytes(80 * GIB, 0.5, 16 * GIB, 3 * GIB, 1 * GIB) == 20 * GIB
    assert kv_cache_memory_bytes(80 * GIB, 0.75, 16 * GIB, 3 * GIB, 1 * GIB) == 40 * GIB
    # Every term comes off one for one.
    assert kv_cache_memory_bytes(80 * GIB, 0.5, 16 * GIB + 5, 3 * GIB + 7, 1 * GIB + 11) == 20 * GIB - 23


@pytest.mark.parametrize("weights_gib", [3.0, 2.75])  # over the share, and exactly all of it
def test_no_kv_budget_left_is_an_error_naming_the_numbers_and_what_to_change(weights_gib: float) -> None:
    with pytest.raises(ValueError) as error:
        kv_cache_memory_bytes(8 * GIB, 0.5, int(weights_gib * GIB), int(0.75 * GIB), int(0.5 * GIB))
    message = str(error.value)
    assert "no GPU memory is left for the KV cache" in message
    assert "gpu_memory_utilization 0.5 of 8.00 GiB is 4.00 GiB" in message
    assert f"weights {weights_gib:.2f} GiB, peak activations 0.75 GiB, outside torch 0.50 GiB" in message
    for knob in ("raise gpu_memory_utilization", "max_num_batched_tokens", "max_num_seqs", "kv_cache_memory_gib"):
        assert knob in message


# --- explicit budgets and the context the cache can hold (CPU) --------------------------------------------------------


def test_explicit_kv_cache_memory_gib_sizes_the_cache_in_whole_blocks(tiny_model_dir: Path, make_llm: Any) -> None:
    llm = make_llm(tiny_model_dir, num_kv_blocks=None, kv_cache_memory_gib=gib_for_blocks(100), max_model_len=256)
    assert llm.engine.core.num_kv_blocks == 100
    assert llm.engine.core.executor.worker.runner.kv_cache_bytes_per_block() == TINY_FP32_BLOCK_BYTES


def test_max_model_len_the_cache_can_never_hold_fails_at_start_naming_both(tiny_model_dir: Path, make_llm: Any) -> None:
    with pytest.raises(ValueError) as error:
        make_llm(tiny_model_dir, num_kv_blocks=None, kv_cache_memory_gib=gib_for_blocks(64), max_model_len=2048)
    message = str(error.value)
    assert "max_model_len 2048 is larger than the KV cache can ever hold: 1024 tokens (64 blocks of 16)" in message
    assert "raise cache.kv_cache_memory_gib" in message and "gpu_memory_utilization" in message
    assert "lower max_model_len to at most 1024" in message


def test_unset_max_model_len_is_lowered_to_what_the_cache_holds(
    tiny_model_dir: Path, make_llm: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="executor.engine_core"):
        llm = make_llm(tiny_model_dir, num_kv_blocks=None, kv_cache_memory_gib=gib_for_blocks(64))
    assert llm.engine.model_info.max_model_len == 1024
    assert engine_log(caplog, "max_model_len lowered from 2048 to 1024 to fit the KV cache")


def test_scheduler_refuses_a_context_longer_than_its_cache() -> None:
    with pytest.raises(ValueError, match=r"max_model_len 200 is larger than .* 128 tokens \(8 blocks of 16\)"):
        Scheduler(EngineConfig(block_size=16), 8, 200, eos_token_ids={2})


def test_startup_logs_blocks_tokens_and_maximum_concurrency_once(
    tiny_model_dir: Path, make_llm: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="executor.engine_core"):
        make_llm(tiny_model_dir, distributed_executor="uniproc", num_kv_blocks=100, max_model_len=300)
    # 300 tokens take 19 blocks of 16: 100 blocks hold 5.26 such requests at once.
    assert engine_log(caplog, "KV cache size") == [
        "KV cache size: 100 blocks, 1600 tokens. Maximum concurrency for 300 tokens per request: 5.26x"
    ]


@pytest.mark.parametrize(
    ("max_num_batched_tokens", "max_num_seqs"),
    [(512, 128), (100, 7), (3, 64), (4096, 1)],  # the default; uneven split; fewer tokens than seqs; past the context
)
def test_profile_step_runs_on_cpu_and_leaves_the_runner_empty(
    tiny_model_dir: Path, max_num_batched_tokens: int, max_num_seqs: int
) -> None:
    from executor import SamplingParams
    from model_executor.step_plan import NewRequestData, StepPlan

    info = load_model_info(tiny_model_dir, EngineConfig(model=str(tiny_model_dir), max_model_len=2048))
    prompt = [random.Random(0).randrange(3, 49152) for _ in range(20)]

    def first_token(runner: ModelRunner) -> list[list[int]]:
        runner.allocate_kv_cache(8)
        new = NewRequestData("r", prompt, [], SamplingParams(temperature=0), [0, 1], 0)
        return runner.execute(StepPlan([new], num_scheduled_tokens={"r": len(prompt)})).sampled_token_ids

    runner = ModelRunner(info, 16, show_progress=False, cuda_graphs="off")
    assert runner.profile_run(max_num_batched_tokens, max_num_seqs, max_logprobs=20) == 0  # measured on CUDA only
    assert runner.requests == {} and runner.kv_caches == [] and runner.num_kv_blocks == 0
    # It serves afterwards exactly as a runner that never profiled.
    assert first_token(runner) == first_token(ModelRunner(info, 16, show_progress=False, cuda_graphs="off"))


# --- CUDA: gpu_memory_utilization over a profiled peak step -----------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available on this machine")


@pytest.fixture
def compiled_triton() -> None:
    from cuda_ext.kernels import unified_attention

    if unified_attention.INTERPRETED:
        pytest.skip("this process interprets Triton kernels (TRITON_INTERPRET=1); the GPU needs compiled ones")


def cuda_llm(model_dir: Path, **engine_args: Any) -> Any:
    from executor import LLM

    return LLM(model=str(model_dir), device="cuda", show_progress=False, max_model_len=512, **engine_args)


def release(llm: Any) -> None:
    llm.engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def gpu_used_bytes() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


@needs_cuda
def test_gpu_memory_utilization_gives_the_kv_cache_what_a_profiled_peak_step_leaves(
    tiny_model_dir: Path, compiled_triton: None, caplog: pytest.LogCaptureFixture
) -> None:
    from executor import SamplingParams

    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    # A share 2 GiB above what the GPU already holds keeps the tiny model's block pool small.
    utilization = round((gpu_used_bytes() + 2 * GIB) / total, 4)
    with caplog.at_level(logging.INFO):
        llm = cuda_llm(tiny_model_dir, gpu_memory_utilization=utilization)
    [profile] = engine_log(caplog, "memory profile:")
    assert f"gpu_memory_utilization {utilization}" in profile and "peak activations" in profile
    runner = llm.engine.core.executor.worker.runner
    kv_bytes = llm.engine.core.num_kv_blocks * runner.kv_cache_bytes_per_block()
    # The cache took most of the 2 GiB (the tiny model's weights and peak step are a few MB; the CUDA context and
    # torch's workspaces count against the share), and the engine stays within its share, graphs included.
    assert kv_bytes > 1 * GIB
    assert gpu_used_bytes() <= utilization * total + 512 * 2**20
    prompts = [[random.Random(seed).randrange(3, 49152) for _ in range(100 + 40 * seed)] for seed in range(4)]
    params = SamplingParams(temperature=0, max_tokens=16)
    tokens = [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]
    release(llm)
    reference = cuda_llm(tiny_model_dir, num_kv_blocks=256)
    assert [output.outputs[0].token_ids for output in reference.generate(prompts, params, use_tqdm=False)] == tokens
    release(reference)


@needs_cuda
def test_explicit_kv_cache_memory_gib_wins_on_cuda(
    tiny_model_dir: Path, compiled_triton: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        llm = cuda_llm(tiny_model_dir, kv_cache_memory_gib=0.25)
    runner = llm.engine.core.executor.worker.runner
    assert llm.engine.core.num_kv_blocks == int(0.25 * GIB) // runner.kv_cache_bytes_per_block()
    assert not engine_log(caplog, "memory profile:")
    release(llm)


@needs_cuda
def test_a_share_smaller_than_the_model_needs_fails_naming_the_numbers(
    tiny_model_dir: Path, compiled_triton: None
) -> None:
    # 0.1% of the GPU is less than the CUDA context alone takes.
    with pytest.raises(ValueError, match=r"no GPU memory is left for the KV cache: gpu_memory_utilization 0.001 of"):
        cuda_llm(tiny_model_dir, gpu_memory_utilization=0.001)
    gc.collect()
    torch.cuda.empty_cache()
