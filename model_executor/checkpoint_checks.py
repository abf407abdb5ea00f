"""Refusals that need only a model's directory and HF config: run before any worker starts (CLI, engine actor, LLM),
so a checkpoint the engine cannot run is one line up front instead of a failed deployment later."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any

from torch import nn

from model_executor.hub import bin_only_message
from model_executor.models import architectures_of, check_architectures

PYTORCH_WEIGHT_PATTERNS = ("*.bin", "*.pt", "*.pth")


def check_weight_format(model_dir: Path) -> None:
    """Refuse a directory whose weights are PyTorch pickles only (no `*.safetensors` beside them)."""
    model_dir = Path(model_dir)
    if any(model_dir.glob("*.safetensors")):
        return
    pickles = sorted(path.name for pattern in PYTORCH_WEIGHT_PATTERNS for path in model_dir.glob(pattern))
    if pickles:
        raise ValueError(bin_only_message(f"{model_dir} ({', '.join(pickles[:3])})"))


def quantization_method(hf_config: Any) -> str | None:
    """The `quant_method` of the config's `quantization_config` (a dict or a transformers object), None if absent."""
    quantization = getattr(hf_config, "quantization_config", None)
    if not quantization:
        return None
    if isinstance(quantization, dict):
        method = quantization.get("quant_method")
    else:
        method = getattr(quantization, "quant_method", None)
    if isinstance(method, enum.Enum):
        method = method.value
    return str(method) if method else "unknown"


def check_checkpoint(model_dir: Path, hf_config: Any) -> type[nn.Module]:
    """Raise ValueError (one line) for a checkpoint pagedserve cannot run; return its model class otherwise.

    Refuses PyTorch-only weights, any `quantization_config`, an architecture that is not supported (the message
    lists the supported ones), and what the family's own `check_config(hf_config)` refuses. A config without
    `architectures` (GGUF conversions) gets the causal-LM class transformers maps its `model_type` to, written into
    `hf_config.architectures` so every later reader of this config (workers included) sees the same class.
    """
    check_weight_format(model_dir)
    method = quantization_method(hf_config)
    if method is not None:
        raise ValueError(
            f"{model_dir}: quantized with {method!r}; pagedserve runs unquantized float32/bfloat16/float16 "
            "checkpoints only"
        )
    if not getattr(hf_config, "architectures", None) and (derived := architectures_of(hf_config)):
        hf_config.architectures = derived
    model_class = check_architectures(hf_config)
    check_config = getattr(model_class, "check_config", None)
    if check_config is not None:
        check_config(hf_config)
    return model_class
