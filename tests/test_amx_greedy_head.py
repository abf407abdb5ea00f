"""Greedy tokens of a bf16 LM head without its logits (cuda_ext.cpu_ops amx_greedy_tokens, and AmxGreedyHead in
the model runner): the token the sampler takes from amx_linear's bf16 logits, the first of equal maxima, among the
tokens a structured-output bitmask allows. Run where the CPU has AMX tiles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from configs.sampling_params import SamplingParams, StructuredOutputsParams
from cuda_ext.cpu_ops import load_cpu_ops
from model_executor.structured_output import allocate_bitmask, apply_bitmask

OPS = load_cpu_ops()
pytestmark = pytest.mark.skipif(
    OPS is None or not getattr(OPS, "has_amx", False) or not OPS.amx_usable(),
    reason="the fused greedy head needs the C++ CPU kernels built for, and run on, a CPU with AMX-BF16",
)


def sampler_tokens(x: torch.Tensor, weight: torch.Tensor, vocab_size: int, bitmask: Any = None) -> torch.Tensor:
    """What the logits path picks: amx_linear's bf16 logits of the first vocab_size rows, widened, masked, argmax."""
    logits = torch.empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16)
    OPS.amx_linear(logits, x, OPS.pack_amx_weight(weight))
    logits = logits[:, :vocab_size].float()
    if bitmask is not None:
        apply_bitmask(logits, bitmask, list(range(x.shape[0])))
    return logits.max(dim=1).indices


@pytest.mark.parametrize(
    ("vocab_size", "weight_rows", "columns"),
    # A vocabulary not a multiple of 16 or 32 (partial output blocks), padding rows past it, a depth not a multiple
    # of 32, SmolLM2's hidden size over a vocabulary the pool threads split.
    [(1000, 1000, 64), (49, 64, 7), (33, 40, 577), (4099, 4112, 576)],
)
@pytest.mark.parametrize("num_tokens", [1, 13, 33, 97])
def test_greedy_tokens_are_the_argmax_of_the_bf16_logits(
    vocab_size: int, weight_rows: int, columns: int, num_tokens: int
) -> None:
    generator = torch.Generator().manual_seed(vocab_size + num_tokens)
    weight = torch.randn(weight_rows, columns, generator=generator).bfloat16()
    # Padding rows that would win every row if the kernel looked past vocab_size.
    weight[vocab_size:] = 100.0
    x = torch.randn(num_tokens, columns, generator=generator).abs().bfloat16()
    packed = OPS.pack_amx_weight(weight)
    expected = sampler_tokens(x, weight, vocab_size)
    assert torch.equal(OPS.amx_greedy_tokens(x, packed, weight_rows, vocab_size), expected)
    # An fp32 x is rounded to bf16 first, as amx_linear rounds it.
    assert torch.equal(OPS.amx_greedy_tokens(x.float(), packed, weight_rows, vocab_size), expected)


@pytest.mark.parametrize("num_threads", [1, 2])
def test_equal_maxima_resolve_to_the_first_token_on_any_number_of_threads(num_threads: int) -> None:
    """Copies of one weight row tie exactly; the first wins even when the other thread scores the later copy (the
    vocabulary spans both threads' shares). Logits that differ in fp32 but round to one bf16 value tie too: the
    first of them wins, not the larger, as the sampler picks from bf16 logits."""
    generator = torch.Generator().manual_seed(5)
    vocab_size, columns = 4096, 576
    weight = torch.randn(vocab_size, columns, generator=generator).bfloat16() * 0.01
    x = torch.randn(3, columns, generator=generator).bfloat16()
    winner = (x.float() * 0.1).bfloat16()
    # Row 0's best: tokens 3000 and 4000 (equal); row 1's: 17 and 4001.
    weight[3000] = weight[4000] = winner[0]
    weight[17] = weight[4001] = winner[1]
    # Row 2's: token 2999, and token 5 one bf16 step lower in the column where x is largest.
    weight[2999] = weight[5] = winner[2]
    column = int(x[2].float().argmax())
    weight[5, column] = (weight[5, column].view(torch.int16) - 1).view(torch.bfloat16)
    fp32_logits = x[2].float() @ weight[[5, 2999]].float().T
    assert fp32_logits[0] < fp32_logits[1] and torch.equal(fp32_logits[0].bfloat16(), fp32_logits[1].bfloat16())
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        tokens = OPS.amx_greedy_tokens(x, OPS.pack_amx_weight(weight), vocab_size, vocab_size)
    finally:
        torch.set_num_threads(previous)
    assert tokens.tolist() == [3000, 17, 5]
    assert torch.equal(tokens, sampler_tokens(x, weight, vocab_size))


def test_nan_logits_win_as_with_torch_argmax() -> None:
    """A NaN logit is the max (torch's rule): the first NaN token; a NaN in x makes every logit NaN, so token 0."""
    weight = torch.randn(64, 32).bfloat16()
    weight[40, 0] = float("inf")
    weight[40, 1] = float("inf")
    x = torch.ones(2, 32).bfloat16()
    x[0, 1] = -1.0  # inf - inf: token 40's logit is NaN
    x[1, 7] = float("nan")
    expected = sampler_tokens(x, weight, 64)
    assert expected.tolist() == [40, 0]
    assert torch.equal(OPS.amx_greedy_tokens(x, OPS.pack_amx_weight(weight), 64, 64), expected)


def test_bitmask_limits_each_row_to_its_allowed_tokens() -> None:
    generator = torch.Generator().manual_seed(11)
    vocab_size, columns = 1000, 96
    weight = torch.randn(vocab_size, columns, generator=generator).bfloat16()
    x = torch.randn(5, columns, generator=generator).bfloat16()
    bitmask = allocate_bitmask(5, vocab_size)
    bitmask[1] = torch.randint(-(2**31), 2**31 - 1, (bitmask.shape[1],), generator=generator, dtype=torch.int32)
    bitmask[2] = 0
    bitmask[2, 999 // 32] = 1 << (999 % 32)  # only the last token
    bitmask[3, :16] = 0  # the first 512 tokens forbidden
    bitmask[4] = 0  # nothing allowed
    tokens = OPS.amx_greedy_tokens(x, OPS.pack_amx_weight(weight), vocab_size, vocab_size, bitmask)
    assert torch.equal(tokens[:4], sampler_tokens(x[:4], weight, vocab_size, bitmask[:4]))
    assert tokens[2].item() == 999 and tokens[3].item() >= 512
    assert tokens[4].item() == -1


def test_amx_greedy_tokens_refuses_what_it_cannot_take() -> None:
    weight = torch.randn(96, 64).bfloat16()
    packed = OPS.pack_amx_weight(weight)
    x = torch.randn(4, 64).bfloat16()
    with pytest.raises(RuntimeError, match="pack_amx_weight of a"):
        OPS.amx_greedy_tokens(x, packed, 112, 96)
    with pytest.raises(RuntimeError, match="vocab_size must be"):
        OPS.amx_greedy_tokens(x, packed, 96, 97)
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        OPS.amx_greedy_tokens(x.double(), packed, 96, 96)
    with pytest.raises(RuntimeError, match="bitmask must be"):
        OPS.amx_greedy_tokens(x, packed, 96, 96, torch.zeros(4, 2, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="bitmask must be"):
        OPS.amx_greedy_tokens(x, packed, 96, 96, torch.zeros(3, 3, dtype=torch.int32))


CODE = "[a-z]{3}-[0-9]{2}"
CHOICES = ["yes", "no"]


def token_ids_of(llm: Any, prompts: list[str], params: list[SamplingParams]) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]


def test_bf16_engine_takes_greedy_rows_through_the_fused_head(tiny_qwen2_dir: Path, make_llm: Any) -> None:
    """A bf16 model on AMX: plain greedy rows (structured ones too) get the fused head's tokens, equal to the
    sampler's over the head's logits; sampled rows and rows asking for logprobs still take the logits."""
    from model_executor.layers.greedy_head import AmxGreedyHead

    llm = make_llm(tiny_qwen2_dir, device="cpu", dtype="bfloat16")
    runner = llm.engine.core.executor.worker.runner
    head = runner.greedy_screen
    assert isinstance(head, AmxGreedyHead)
    prompts = [f"Entry {index} of the log says" for index in range(6)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=CODE)),
        SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=CHOICES)),
        SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=9, logprobs=2, ignore_eos=True),
    ]
    fused = token_ids_of(llm, prompts, params)
    screened_rows = head.num_screened_rows
    runner.greedy_screen = None  # the sampler over the head's bf16 logits, for every row
    assert token_ids_of(llm, prompts, params) == fused
    # Every plain greedy row's token (a constrained request may stop before its max_tokens), and no other row's.
    assert screened_rows == sum(len(tokens) for tokens in fused[:4])
    assert head.num_fallback_rows == 0
