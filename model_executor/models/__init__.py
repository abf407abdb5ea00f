"""Model architectures by HF `architectures` name, imported on first use.

A family whose module does not import yet (not landed, or broken) is simply not supported: `supported_architectures()`
lists only the entries whose class loads, so families land in any order.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from torch import nn

logger = logging.getLogger(__name__)

MODEL_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "model_executor.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "model_executor.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "model_executor.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "model_executor.models.qwen3:Qwen3ForCausalLM",
    "Phi3ForCausalLM": "model_executor.models.phi3:Phi3ForCausalLM",
    "Gemma2ForCausalLM": "model_executor.models.gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "model_executor.models.gemma3:Gemma3ForCausalLM",
}

# Architectures users bring that we refuse with a specific reason rather than the generic list.
REFUSED_ARCHITECTURES: dict[str, str] = {
    "Gemma3ForConditionalGeneration": "multimodal Gemma 3: use a text-only checkpoint (gemma-3-1b/270m) for now",
}

# architecture -> its class, or why it could not be loaded (None: its module is not there); filled on first use.
_classes: dict[str, type[nn.Module] | str | None] = {}


def _load(architecture: str) -> type[nn.Module] | str | None:
    """The registered class; None when its module does not exist (yet); else the error that kept it from loading."""
    if architecture not in _classes:
        module_name, class_name = MODEL_REGISTRY[architecture].split(":")
        try:
            _classes[architecture] = getattr(importlib.import_module(module_name), class_name)
        except ModuleNotFoundError as error:
            if error.name != module_name:
                # The family module exists but something it imports does not: a real bug, worth a warning.
                logger.warning("architecture %s is unavailable: %s", architecture, error)
                _classes[architecture] = f"{type(error).__name__}: {error}"
            else:
                _classes[architecture] = None
        except Exception as error:  # a broken family must not take the others down
            logger.warning("architecture %s is unavailable: %s: %s", architecture, type(error).__name__, error)
            _classes[architecture] = f"{type(error).__name__}: {error}"
    return _classes[architecture]


def _is_class(loaded: type[nn.Module] | str | None) -> bool:
    return isinstance(loaded, type)


def supported_architectures() -> list[str]:
    """The registered architectures whose module imports and defines the class, sorted."""
    return sorted(name for name in MODEL_REGISTRY if _is_class(_load(name)))


def architectures_of(hf_config: Any) -> list[str]:
    """`hf_config.architectures`, or for a config that lacks it the causal-LM class transformers itself would build
    for its `model_type` (GGUF conversions write no `architectures`); [] when neither says."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if architectures:
        return architectures
    model_type = getattr(hf_config, "model_type", None)
    if not model_type:
        return []
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if causal_lm is None:
        return []
    logger.info("config.json names no architectures; model_type %r means %s", model_type, causal_lm)
    return [causal_lm]


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    """The class for the first supported entry of `architectures`; ValueError naming the supported ones otherwise."""
    if not architectures:
        raise ValueError(
            f"config.json names no architectures; supported architectures: {', '.join(supported_architectures())}"
        )
    for architecture in architectures:
        if architecture in MODEL_REGISTRY and _is_class(loaded := _load(architecture)):
            return loaded
    for architecture in architectures:
        if architecture in REFUSED_ARCHITECTURES:
            raise ValueError(f"architecture {architecture} is not supported: {REFUSED_ARCHITECTURES[architecture]}")
    broken = [name for name in architectures if name in MODEL_REGISTRY and isinstance(_load(name), str)]
    unavailable = [f"{name} ({_load(name)})" for name in broken]
    reason = f"; registered but unavailable: {', '.join(unavailable)}" if unavailable else ""
    raise ValueError(
        f"architecture {', '.join(architectures)} is not supported{reason}; "
        f"supported architectures: {', '.join(supported_architectures())}"
    )


def check_architectures(hf_config: Any) -> type[nn.Module]:
    """The model class for `hf_config` (ValueError listing the supported architectures when there is none)."""
    architectures = architectures_of(hf_config)
    if not architectures:
        model_type = getattr(hf_config, "model_type", None)
        raise ValueError(
            f"config.json names no architectures and transformers knows no causal LM for its model_type "
            f"{model_type!r}; supported architectures: {', '.join(supported_architectures())}"
        )
    return get_model_class(architectures)
