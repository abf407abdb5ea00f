"""Tiny random checkpoints of every architecture family we serve, built with transformers itself (design doc
issue-35 §4): the parity matrix in tests/test_model_families.py runs our engine on them against HF transformers.

Each spec is a transformers config class plus the settings that exercise what sets the family apart (windows that
are not a multiple of the block size, biases, q/k norms, soft caps, partial or scaled rotary). HF initialises norms
to ones (zeros for Gemma's `1 + w` norms) and biases to zeros, so a model that ignored them would still match: the
tweak randomises them before saving.
"""

from __future__ import annotations

import functools
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from model_executor.tiny_model import TOKENIZER_FILES

# Prompts up to 60 tokens plus 40 generated: every window of 20 slides past its edge and across block boundaries.
BLOCK_SIZE = 16
SLIDING_WINDOW = 20

COMMON_SETTINGS: dict[str, Any] = {
    "vocab_size": 49152,  # SmolLM2's tokenizer
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    # std 0.02 gives near-ties in the logits that flip on rounding; 0.2 gives clear winners.
    "initializer_range": 0.2,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def randomize_neutral_init(model: nn.Module, norm_range: tuple[float, float]) -> None:
    """Norm weights U(norm_range) (q/k norms included), every bias N(0, 0.2): HF's init leaves them neutral."""
    low, high = norm_range
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.uniform_(low, high)
            bias = getattr(module, "bias", None)
            if isinstance(bias, nn.Parameter):
                bias.normal_(0.0, 0.2)


# RMSNorm scales by w: around 1. Gemma's norms scale by (1 + w): around 0.
randomize_rms_norms = functools.partial(randomize_neutral_init, norm_range=(0.5, 1.5))


def randomize_gemma(model: nn.Module) -> None:
    """Gemma's norms around 0, and its (tied) embedding scaled by hidden**-0.5 so that, times Gemma's normalizer
    hidden**0.5, it enters the residual at the init scale: at full size it swamps the residual and every greedy
    stream repeats one token, whatever the layers compute."""
    randomize_neutral_init(model, norm_range=(-0.5, 0.5))
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(model.config.hidden_size**-0.5)


def longrope_factors(seed: int, count: int) -> list[float]:
    """Per-frequency longrope rescale factors U(1, 4), reproducible."""
    rng = random.Random(seed)
    return [round(rng.uniform(1.0, 4.0), 4) for _ in range(count)]


@dataclass(frozen=True)
class FamilySpec:
    """How to build one tiny checkpoint: `config_class` is a transformers class name, `settings` its arguments on
    top of COMMON_SETTINGS, `tweak` what randomises HF's neutral init."""

    architecture: str
    config_class: str
    settings: dict[str, Any] = field(default_factory=dict)
    tweak: Callable[[nn.Module], None] = randomize_rms_norms
    # Whether the default CPU engine's decode steps run the C++ decoder stack (design §3.3): False, or True
    # provided the built extension's `DecodeStack.add_layer` takes `decode_stack_needs` (a later build's keyword).
    decode_stack: bool = True
    decode_stack_needs: str | None = None
    # Where decode_stack is False: what the engine's reason for running layer by layer says.
    layer_by_layer_reason: str = ""
    # Prompt plus generated tokens stay below this (Phi-3's longrope is HF-identical only below its original max).
    max_sequence_length: int = 512

    def config(self) -> Any:
        import transformers

        return getattr(transformers, self.config_class)(**{**COMMON_SETTINGS, **self.settings})


PHI3_HEAD_DIM = COMMON_SETTINGS["hidden_size"] // COMMON_SETTINGS["num_attention_heads"]

FAMILY_SPECS: dict[str, FamilySpec] = {
    "llama": FamilySpec("LlamaForCausalLM", "LlamaConfig", {"tie_word_embeddings": False}),
    "llama32": FamilySpec(
        "LlamaForCausalLM",
        "LlamaConfig",
        {
            "tie_word_embeddings": True,
            "head_dim": 32,
            "attention_bias": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        },
    ),
    "mistral": FamilySpec("MistralForCausalLM", "MistralConfig", {"sliding_window": SLIDING_WINDOW}),
    "qwen2": FamilySpec(
        "Qwen2ForCausalLM",
        "Qwen2Config",
        # Layer 0 attends to everything, layers 1 and 2 slide: one step's metadata serves both kinds.
        {"num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": SLIDING_WINDOW, "max_window_layers": 1},
        decode_stack_needs="sliding_window",
        layer_by_layer_reason="sliding windows differ",
    ),
    "qwen3": FamilySpec(
        "Qwen3ForCausalLM",
        "Qwen3Config",
        {"head_dim": 32, "tie_word_embeddings": True},
        decode_stack_needs="q_norm_weight",
        layer_by_layer_reason="q/k norms",
    ),
    "phi3": FamilySpec(
        "Phi3ForCausalLM",
        "Phi3Config",
        {
            "original_max_position_embeddings": 128,
            "sliding_window": 40,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": longrope_factors(1, PHI3_HEAD_DIM // 2),
                "long_factor": longrope_factors(2, PHI3_HEAD_DIM // 2),
            },
        },
        max_sequence_length=128,
    ),
    "phi3_partial": FamilySpec(
        "Phi3ForCausalLM",
        "Phi3Config",
        {
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        },
        decode_stack=False,
        layer_by_layer_reason="partial rotary",
    ),
    "gemma2": FamilySpec(
        "Gemma2ForCausalLM",
        "Gemma2Config",
        {
            "num_hidden_layers": 4,
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": SLIDING_WINDOW,
            "attn_logit_softcapping": 3.0,
            "final_logit_softcapping": 10.0,
        },
        tweak=randomize_gemma,
        decode_stack=False,
        layer_by_layer_reason="not implemented for Gemma2ForCausalLM",
    ),
    "gemma3": FamilySpec(
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        {
            "num_hidden_layers": 4,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            "sliding_window": SLIDING_WINDOW,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
            },
        },
        tweak=randomize_gemma,
        decode_stack=False,
        layer_by_layer_reason="not implemented for Gemma3ForCausalLM",
    ),
}


def write_tiny_family(name: str, directory: Path, tokenizer_source: Path) -> Path:
    """The `name` spec's checkpoint (safetensors, seed 0, neutral init randomised) plus SmolLM2's tokenizer."""
    from transformers import AutoModelForCausalLM

    spec = FAMILY_SPECS[name]
    config = spec.config()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if type(model).__name__ != spec.architecture:
        raise AssertionError(f"{spec.config_class} built {type(model).__name__}, not {spec.architecture}")
    spec.tweak(model)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    for file_name in TOKENIZER_FILES:
        if (tokenizer_source / file_name).exists():
            shutil.copy(tokenizer_source / file_name, directory / file_name)
    return directory


def unsupported_reason(architecture: str) -> str | None:
    """Why our registry does not serve `architecture` (None: it does). Families land one by one: the parity matrix
    skips the others with this reason."""
    from model_executor import models

    supported_architectures = getattr(models, "supported_architectures", None)
    if supported_architectures is not None and architecture in supported_architectures():
        return None
    try:
        # Before the lazy registry, "supported" is: listed, and its module imports (get_model_class imports it).
        models.get_model_class([architecture])
    except ValueError as error:
        return f"not in supported_architectures(): {error}"
    return None if supported_architectures is None else f"{architecture} is not in supported_architectures()"


def random_prompts(count: int, seed: int) -> list[list[int]]:
    """`count` prompts of 1-60 token ids drawn from the vocabulary past the special tokens (ids 0-2), seeded."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(1, 61))] for _ in range(count)]
