"""The one-kernel draw of random rows on CPU (cuda_ext.cpu_ops sample_from_logits, and the Sampler and engine on it):
the sampler's two-level inverse CDF of exp((logit - max) / temperature) from the same uniforms, on fp32 or bf16
logits as they are."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from configs.sampling_params import SamplingParams
from cuda_ext.cpu_ops import load_cpu_ops
from model_executor.sampler import Sampler, SamplingRow, _inverse_cdf_sample

OPS = load_cpu_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason="the one-kernel draw is one of the C++ CPU kernels")
EOS = 3


def torch_draw(logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The torch composition the kernel replaces: weights exp((l - max) / T), then the two-level inverse CDF."""
    weights = logits.float()
    weights = ((weights - weights.amax(dim=-1, keepdim=True)) / temperatures.unsqueeze(1)).exp()
    return _inverse_cdf_sample(weights, uniforms)


@pytest.mark.parametrize("vocab", [49152, 1000, 256, 7])
def test_kernel_draws_what_the_torch_composition_draws(vocab: int) -> None:
    """Same logits, temperatures and uniforms: the same tokens (the exponentials differ by an ulp at most, which moves
    a draw only within about 1e-7 of a boundary)."""
    generator = torch.Generator().manual_seed(vocab)
    rows = 256
    logits = torch.randn(rows, vocab, generator=generator) * 4.0
    logits[::7, : vocab // 2] = float("-inf")  # masked tokens (structured outputs, min_tokens) weigh nothing
    temperatures = torch.rand(rows, generator=generator) * 1.5 + 0.1
    uniforms = torch.rand(rows, generator=generator, dtype=torch.float64)
    tokens = OPS.sample_from_logits(logits, temperatures, uniforms)
    assert torch.equal(tokens, torch_draw(logits, temperatures, uniforms))
    assert bool(((tokens >= 0) & (tokens < vocab)).all())
    # bf16 logits are read as they are: the draw of their fp32 values.
    bf16 = logits.bfloat16()
    assert torch.equal(
        OPS.sample_from_logits(bf16, temperatures, uniforms),
        OPS.sample_from_logits(bf16.float(), temperatures, uniforms),
    )


def test_uniforms_on_a_grid_land_on_each_token_in_proportion_to_its_probability() -> None:
    """The inverse CDF is exact: N evenly spaced uniforms pick each token about N * p times (within one draw and the
    float32 weights' rounding), across block boundaries and a partial last block."""
    vocab, draws = 700, 200_000
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(vocab, generator=generator) * 2.0
    logits[300:420] = float("-inf")
    temperature = 0.7
    uniforms = (torch.arange(draws, dtype=torch.float64) + 0.5) / draws
    tokens = OPS.sample_from_logits(logits.expand(draws, -1).contiguous(), torch.full((draws,), temperature), uniforms)
    counts = torch.bincount(tokens, minlength=vocab).double()
    probabilities = torch.softmax(logits.double() / temperature, dim=0)
    assert float((counts - draws * probabilities).abs().max()) <= 1.0 + draws * 1e-6
    assert counts[300:420].sum() == 0


def test_rows_without_mass_and_single_tokens() -> None:
    logits = torch.full((3, 600), float("-inf"))
    logits[1, 517] = 2.0  # the only token a row allows
    logits[2, :] = 0.0
    logits[2, 599] = float("nan")  # a NaN weighs nothing
    uniforms = torch.tensor([0.3, 0.99, 0.999999], dtype=torch.float64)
    tokens = OPS.sample_from_logits(logits, torch.ones(3), uniforms).tolist()
    assert tokens[0] == 0  # no mass: token 0, as the torch draw gives
    assert tokens[1] == 517
    assert tokens[2] == 598


def test_sample_from_logits_refuses_what_it_cannot_take() -> None:
    logits = torch.randn(2, 10)
    uniforms = torch.rand(2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="temperatures must be positive"):
        OPS.sample_from_logits(logits, torch.tensor([1.0, 0.0]), uniforms)
    with pytest.raises(RuntimeError, match="temperatures must be"):
        OPS.sample_from_logits(logits, torch.ones(3), uniforms)
    with pytest.raises(RuntimeError, match="uniforms must be"):
        OPS.sample_from_logits(logits, torch.ones(2), uniforms.float())
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        OPS.sample_from_logits(logits.double(), torch.ones(2), uniforms)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        OPS.sample_from_logits(logits.t(), torch.ones(10), torch.rand(10, dtype=torch.float64))


def make_row(params: SamplingParams, output: tuple[int, ...] = ()) -> SamplingRow:
    generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    return SamplingRow(params=params, prompt_token_ids=[1, 2], output_token_ids=list(output), generator=generator)


def test_sampler_draws_plain_rows_in_the_kernel_and_filtered_rows_in_torch() -> None:
    """With the kernel: plain random rows (fp32 or bf16 logits) draw what the torch sampler draws from the same seeds;
    rows with top_p, penalties or logprobs, and mixed batches, give what the torch sampler gives."""
    generator = torch.Generator().manual_seed(8)
    logits = torch.randn(6, 5000, generator=generator) * 3.0
    plain = [make_row(SamplingParams(temperature=0.8, seed=seed)) for seed in range(6)]
    with_kernel, torch_only = Sampler([EOS], OPS), Sampler([EOS])
    assert with_kernel.draw_kernel is not None
    kernel_tokens = with_kernel(logits.clone(), plain).sampled_token_ids
    assert kernel_tokens == torch_only(logits.clone(), [make_row(row.params) for row in plain]).sampled_token_ids
    bf16 = logits.bfloat16()
    assert (
        with_kernel(bf16.clone(), [make_row(row.params) for row in plain]).sampled_token_ids
        == torch_only(bf16.clone(), [make_row(row.params) for row in plain]).sampled_token_ids
    )
    mixed = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, seed=1, top_p=0.5),
        SamplingParams(temperature=1.1, seed=2, repetition_penalty=1.3),
        SamplingParams(temperature=0.7, seed=3, logprobs=2),
        SamplingParams(temperature=0.6, seed=4, min_p=0.1),
        SamplingParams(temperature=1.0, seed=5),
    ]
    ours = with_kernel(logits.clone(), [make_row(params, (5, 9)) for params in mixed])
    reference = torch_only(logits.clone(), [make_row(params, (5, 9)) for params in mixed])
    assert ours.sampled_token_ids == reference.sampled_token_ids
    assert [entry is None for entry in ours.logprobs] == [True, True, True, False, True, True]


def test_kernel_draws_follow_the_tempered_softmax() -> None:
    """Unseeded rows through the kernel: token frequencies within 4 standard deviations of softmax(l / T)."""
    probabilities = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.full((300,), float("-inf"))
    positions = [2, 77, 256, 299]
    logits[positions] = probabilities.log()
    temperature, draws = 0.5, 20_000
    rows = [make_row(SamplingParams(temperature=temperature)) for _ in range(draws)]
    counts = Counter(Sampler([EOS], OPS)(logits.expand(draws, -1).clone(), rows).sampled_token_ids)
    tempered = torch.softmax(probabilities.log() / temperature, dim=0)
    assert set(counts) <= set(positions)
    for position, p in zip(positions, tempered.tolist(), strict=True):
        spread = (draws * p * (1 - p)) ** 0.5
        assert abs(counts[position] - draws * p) <= 4 * spread + 1


def test_seeded_bf16_requests_draw_the_same_tokens_alone_and_in_a_batch(tiny_qwen2_dir: Path, make_llm: Any) -> None:
    """A bf16 engine on CPU: seeded sampled requests (the kernel's rows) repeat alone what they drew in a batch."""
    llm = make_llm(tiny_qwen2_dir, device="cpu", dtype="bfloat16")
    assert llm.engine.core.executor.worker.runner.sampler.draw_kernel is not None
    prompts = [f"Item {index} reads" for index in range(5)]
    params = [SamplingParams(temperature=0.9, seed=40 + index, max_tokens=16, ignore_eos=True) for index in range(5)]
    batch = [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]
    alone = [
        llm.generate([prompt], [param], use_tqdm=False)[0].outputs[0].token_ids
        for prompt, param in zip(prompts, params, strict=True)
    ]
    assert batch == alone
    assert len({tuple(tokens) for tokens in batch}) > 1
