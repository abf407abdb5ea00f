"""Gemma 2 and Gemma 3 (text) on tiny random checkpoints: our fp32 greedy tokens equal HF transformers' (eager
attention, where Gemma 2's soft-capping lives) on the same weights, alone and batched, on the default backend and on
torch's.

The checkpoints set what makes Gemma Gemma to values a dropped feature would show: norm weights U(-0.5, 0.5) (HF
initialises the 1 + w norms to w = 0), `query_pre_attn_scalar` 24 while head_dim is 32, soft caps of 3 on the
attention scores and 10 on the logits (Gemma 2), a single KV head, q/k norms and two rope tables with linear scaling
on the global one (Gemma 3); the embedding is scaled down so that the sqrt(hidden) normalizer does not swamp the
layers. Layers alternate between a window of 20 tokens (not a multiple of the 16-token block) and global attention;
prompts up to 60 tokens plus 40 generated cross the window.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from configs.sampling_params import SamplingParams
from model_executor.tiny_model import TOKENIZER_FILES
from tests.helpers import assert_no_leaked_blocks
from tests.model_families import random_prompts

MAX_NEW_TOKENS = 40
SLIDING, GLOBAL = "sliding_attention", "full_attention"
COMMON_SETTINGS: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 32,
    "sliding_window": 20,
    "max_position_embeddings": 512,
    # std 0.02 gives near-ties in the logits that flip on rounding; 0.2 gives clear winners.
    "initializer_range": 0.2,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def family_configs() -> dict[str, Any]:
    from transformers import Gemma2Config, Gemma3TextConfig

    return {
        # Default layer_types: layer 0 slides, then every other layer is global.
        "gemma2": Gemma2Config(
            **COMMON_SETTINGS,
            num_key_value_heads=2,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=10.0,
        ),
        "gemma3": Gemma3TextConfig(
            **COMMON_SETTINGS,
            num_key_value_heads=1,
            query_pre_attn_scalar=24,
            layer_types=[SLIDING, GLOBAL, SLIDING, GLOBAL],
            rope_parameters={
                SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                GLOBAL: {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
            },
        ),
        # A cap so small that fp32 tanh saturates: every clearly positive logit becomes exactly the cap, and greedy
        # takes the first of those ties (not the raw argmax).
        "gemma2_saturated": Gemma2Config(
            **COMMON_SETTINGS, num_key_value_heads=2, query_pre_attn_scalar=24, final_logit_softcapping=1e-3
        ),
    }


def write_tiny_gemma(name: str, directory: Path, tokenizer_source: Path) -> Path:
    """A random checkpoint of `name` (seed 0) with SmolLM2's tokenizer, every norm weight (q/k norms included)
    drawn from U(-0.5, 0.5) so the 1 + w scale is visible, and the (tied) embedding scaled by hidden**-0.5."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_configs()[name], dtype=torch.float32).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)
        # Times Gemma's normalizer sqrt(hidden) the embedding enters at the init scale; unscaled it swamps the
        # residual and every greedy stream repeats one token whatever the layers compute.
        model.get_input_embeddings().weight.mul_(model.config.hidden_size**-0.5)
    model.save_pretrained(directory)
    for file_name in TOKENIZER_FILES:
        if (tokenizer_source / file_name).exists():
            shutil.copy(tokenizer_source / file_name, directory / file_name)
    return directory


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = write_tiny_gemma(name, tmp_path_factory.mktemp(name), smollm2_dir)
        return built[name]

    return get


# Lengths 1-60 (seeded) and a 60-token repeat: prompts inside and well past the 20-token window.
PROMPTS = [*random_prompts(3, seed=11), [5] * 60]


def greedy(max_tokens: int = MAX_NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def runner_of(llm: Any) -> Any:
    return llm.engine.core.executor.worker.runner


def test_saturated_logit_soft_cap_ties_as_hf_and_skips_the_greedy_screen(gemma_dir, make_llm, hf_reference):
    """With the final logits soft-capped, greedy is the argmax of the capped logits, where fp32 tanh makes raw
    logits that differ tie; the bf16 screen (an argmax of raw logits) is not built even when asked for."""
    model_dir = gemma_dir("gemma2_saturated")
    prompts = PROMPTS[:2]
    expected = [hf_reference.greedy(model_dir, ids, 8) for ids in prompts]
    llm = make_llm(model_dir, greedy_screening="on")
    outputs = llm.generate(prompts, greedy(8), use_tqdm=False)
    assert [output.outputs[0].token_ids for output in outputs] == expected
    assert runner_of(llm).greedy_screen is None
    assert_no_leaked_blocks(llm)


def test_gemma3_without_soft_cap_keeps_the_greedy_screen(gemma_dir, make_llm):
    from model_executor.cpu_features import cpu_has_bf16_dot_products

    if not cpu_has_bf16_dot_products():
        pytest.skip("the screen needs bf16 dot products")
    llm = make_llm(gemma_dir("gemma3"), greedy_screening="on")
    assert runner_of(llm).greedy_screen is not None


@pytest.mark.parametrize(
    ("family", "setting", "message"),
    [
        ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
        (
            "gemma3",
            {
                "rope_parameters": {
                    SLIDING: {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
                    GLOBAL: {"rope_type": "default", "rope_theta": 1e6},
                }
            },
            "'dynamic'",
        ),
    ],
)
def test_gemma_refuses_configs_it_cannot_run(family, setting, message):
    from model_executor.models.gemma2 import Gemma2ForCausalLM
    from model_executor.models.gemma3 import Gemma3ForCausalLM

    config = family_configs()[family]
    for key, value in setting.items():
        setattr(config, key, value)
    model_class = {"gemma2": Gemma2ForCausalLM, "gemma3": Gemma3ForCausalLM}[family]
    with pytest.raises(ValueError, match=message):
        model_class.check_config(config)
