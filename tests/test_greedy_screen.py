"""The screened greedy LM head: bf16 logits, fp32 only for the tokens that can still win; the same tokens as the
full fp32 head (the argmax, the first of equal maxima), on random heads, tied rows, flat rows and SmolLM2."""

from __future__ import annotations

import pytest
import torch

from model_executor.cpu_features import cpu_has_bf16_dot_products
from model_executor.layers.greedy_screen import MAX_CANDIDATES, GreedyScreen
from tests.test_parity import SMOLLM2_PROMPTS, greedy

cpu_ops = pytest.importorskip("cuda_ext.cpu_ops")
OPS = cpu_ops.load_cpu_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason="the CPU kernels did not build (no C++ compiler)")


def full_head_tokens(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    logits = torch.empty(hidden.shape[0], weight.shape[0])
    OPS.linear_tokens(logits, hidden.contiguous(), weight)
    return logits.max(dim=-1).indices


def random_head(vocab: int, hidden: int, seed: int) -> torch.Tensor:
    return torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("scale", [0.1, 2.0, 40.0])
@pytest.mark.parametrize("num_rows", [1, 7, 64])
def test_screened_tokens_equal_the_fp32_heads(scale, num_rows):
    weight = random_head(3000, 96, seed=1)
    hidden = torch.randn(num_rows, 96, generator=torch.Generator().manual_seed(2)) * scale
    screen = GreedyScreen(weight, OPS)
    assert torch.equal(screen.token_ids(hidden), full_head_tokens(hidden, weight))
    assert screen.num_screened_rows == num_rows and screen.num_fallback_rows == 0


def test_equal_maxima_resolve_to_the_first_token():
    weight = random_head(2000, 64, seed=3)
    hidden = torch.randn(4, 64, generator=torch.Generator().manual_seed(4))
    # Rows 1500 and 37 and 901 the same vector, far ahead of the rest for every hidden row: exact ties.
    winner = hidden.sum(dim=0)
    for token in (1500, 37, 901):
        weight[token] = winner
    tokens = GreedyScreen(weight, OPS).token_ids(hidden)
    assert tokens.tolist() == [37] * 4 == full_head_tokens(hidden, weight).tolist()


def test_a_flat_row_falls_back_to_full_logits():
    # Every token within the bf16 error of the best: more candidates than the screen takes.
    base = torch.randn(64, generator=torch.Generator().manual_seed(5))
    weight = base.repeat(MAX_CANDIDATES * 4, 1) + torch.randn(MAX_CANDIDATES * 4, 64) * 1e-4
    hidden = torch.stack([base, torch.randn(64)])
    screen = GreedyScreen(weight, OPS)
    assert torch.equal(screen.token_ids(hidden), full_head_tokens(hidden, weight))
    assert screen.num_fallback_rows >= 1


def test_non_finite_hidden_states_give_what_the_fp32_head_gives():
    weight = random_head(500, 32, seed=6)
    hidden = torch.randn(3, 32)
    hidden[1, 5] = float("inf")
    hidden[2, 0] = float("nan")
    screen = GreedyScreen(weight, OPS)
    assert torch.equal(screen.token_ids(hidden), full_head_tokens(hidden, weight))
    assert screen.num_fallback_rows == 2


def test_modes_pick_where_the_screen_runs():
    weight = random_head(300, 32, seed=7)
    assert GreedyScreen.build(weight, OPS, "off") is None
    assert GreedyScreen.build(weight, None, "on") is None
    assert GreedyScreen.build(weight.double(), OPS, "on") is None
    assert GreedyScreen.build(weight, OPS, "on") is not None
    assert (GreedyScreen.build(weight, OPS, "auto") is not None) == cpu_has_bf16_dot_products()


@pytest.mark.slow
def test_the_bound_holds_on_this_machine_for_smollm2_head(smollm2_llm):
    weight = smollm2_llm.engine.core.executor.worker.runner.model.lm_head.weight
    assert GreedyScreen(weight, OPS).bound_holds()


@pytest.mark.slow
def test_smollm2_screened_matches_hf_and_the_fp32_head(smollm2_dir, hf_reference, make_llm):
    """Forced on (as on CPUs without bf16 dot products, where oneDNN emulates them): HF's tokens, every step's
    rows through the screen."""
    screened = make_llm(smollm2_dir, greedy_screening="on", num_kv_blocks=512)
    tokenizer = screened.tokenizer
    prompt_ids = [tokenizer.encode(prompt) for prompt in SMOLLM2_PROMPTS]
    expected = [hf_reference.greedy(smollm2_dir, ids, 24) for ids in prompt_ids]
    outputs = screened.generate(prompt_ids, greedy(24), use_tqdm=False)
    assert [output.outputs[0].token_ids for output in outputs] == expected
    screen = screened.engine.core.executor.worker.runner.greedy_screen
    assert screen.num_screened_rows >= 24 * len(prompt_ids) - len(prompt_ids)
    plain = make_llm(smollm2_dir, greedy_screening="off", num_kv_blocks=512)
    assert plain.engine.core.executor.worker.runner.greedy_screen is None
    assert [output.outputs[0].token_ids for output in plain.generate(prompt_ids, greedy(24), use_tqdm=False)] == (
        expected
    )


def test_a_mixed_batch_screens_its_greedy_rows_only(tiny_model_dir, make_llm):
    """Greedy, seeded-sampled and logprob requests in the same steps: each gets the tokens it gets without the
    screen, and only the plain greedy rows go through it."""
    from configs.sampling_params import SamplingParams

    prompts = ["hello there", "the sea is", "one two three"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6),
        SamplingParams(temperature=0.8, max_tokens=6, seed=1),
        SamplingParams(temperature=0.0, max_tokens=6, logprobs=2),
    ]
    results = {}
    for mode in ("on", "off"):
        llm = make_llm(tiny_model_dir, greedy_screening=mode)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results[mode] = [(output.outputs[0].token_ids, output.outputs[0].logprobs) for output in outputs]
        screen = llm.engine.core.executor.worker.runner.greedy_screen
        if mode == "on":
            assert screen.num_screened_rows == 6  # the greedy request's six tokens, nobody else's
        else:
            assert screen is None
    assert results["on"] == results["off"]
