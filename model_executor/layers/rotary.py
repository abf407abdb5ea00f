"""Rotary position embedding (NeoX half-split layout, as HF-format checkpoints use): the rope settings read from an
HF config, the cos/sin tables built from them once at load, and the in-place rotation of q and k."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from cuda_ext.fused_ops import apply_rotary

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def _is_nested(params: dict[str, Any]) -> bool:
    """Whether `params` holds one rope dict per layer type (Gemma 3) rather than one for all layers."""
    return bool(params) and all(isinstance(value, dict) for value in params.values())


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The rope settings of `config` (of `layer_type`'s layers where they differ by layer type), normalised to one
    flat dict with at least `rope_type`, `rope_theta` and `partial_rotary_factor`.

    Reads transformers 5's `config.rope_parameters` (flat, or nested per layer type) and the 4.x attributes
    `rope_theta` / `rope_scaling` / `partial_rotary_factor` / `rope_local_base_freq`.
    """
    stored = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if _is_nested(stored):
        if layer_type is None:
            raise ValueError(f"rope parameters differ by layer type ({sorted(stored)}); name the layer type")
        if layer_type not in stored:
            raise ValueError(f"no rope parameters for layer type {layer_type!r} (the config has {sorted(stored)})")
        params = dict(stored[layer_type])
    else:
        params = dict(stored)
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    params.pop("type", None)
    if "rope_theta" not in params:
        # transformers 4.x Gemma 3 kept the sliding layers' base apart.
        local_theta = getattr(config, "rope_local_base_freq", None)
        use_local = layer_type == "sliding_attention" and local_theta is not None
        params["rope_theta"] = local_theta if use_local else getattr(config, "rope_theta", 10000.0)
        if use_local:
            params["rope_type"] = "default"
    params.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    if params["rope_type"] == "longrope":
        # Phi-3 keeps the pretraining length beside the rope dict; transformers gives that one priority.
        original = getattr(config, "original_max_position_embeddings", None)
        if original is not None:
            params["original_max_position_embeddings"] = original
        params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return params


def check_rope_parameters(params: dict[str, Any]) -> None:
    """Raise ValueError, naming the type, for rope settings `get_rope` cannot build."""
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.x long-context frequency scaling: slow down low frequencies, keep high ones, blend between."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    original_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def longrope_attention_factor(params: dict[str, Any], max_position: int) -> float:
    """The cos/sin multiplier of longrope: the config's, else sqrt(1 + ln(factor) / ln(original length))."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = max_position / original
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original))


def rope_angles(rotary_dim: int, max_position: int, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """(angles [max_position, rotary_dim / 2] fp32, cos/sin multiplier) for `params`' rope type."""
    check_rope_parameters(params)
    rope_type = params.get("rope_type", "default")
    theta = float(params.get("rope_theta", 10000.0))
    # The expressions follow transformers' so that the fp32 tables are bit-identical to its inv_freq.
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    positions = torch.arange(max_position, dtype=torch.float32)[:, None]
    if rope_type == "longrope":
        original = params["original_max_position_embeddings"]
        short_inv_freq = 1.0 / (torch.tensor(params["short_factor"], dtype=torch.float32) * theta**exponents)
        long_inv_freq = 1.0 / (torch.tensor(params["long_factor"], dtype=torch.float32) * theta**exponents)
        # HF re-encodes the whole sequence with the long set once it passes `original`; a paged cache cannot, so
        # positions before it keep the short set.
        angles = torch.where(positions < original, positions * short_inv_freq, positions * long_inv_freq)
        if max_position > original:
            logger.info("longrope: not HF-identical past %d tokens", original)
        return angles, longrope_attention_factor(params, max_position)
    inv_freq = 1.0 / (theta**exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        inv_freq = llama3_scaled_inv_freq(inv_freq, params)
    return positions * inv_freq[None, :], 1.0


def get_rope(head_dim: int, max_position: int, params: dict[str, Any]) -> RotaryEmbedding:
    """The rotary embedding for `params` (from `rope_parameters`): types default, linear, llama3 and longrope; the
    first `head_dim * partial_rotary_factor` dims of each head rotate, the rest pass through."""
    rotary_dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0) or 1.0))
    angles, attention_scaling = rope_angles(rotary_dim, max_position, params)
    return RotaryEmbedding(
        head_dim,
        angles.cos() * attention_scaling,
        angles.sin() * attention_scaling,
        rope_type=params.get("rope_type", "default"),
    )


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to q and k in place from precomputed fp32 cos/sin tables
    [max_position, rotary_dim / 2]; with `rotary_dim < head_dim` only each head's first `rotary_dim` dims rotate."""

    def __init__(self, head_dim: int, cos_table: torch.Tensor, sin_table: torch.Tensor, rope_type: str = "default"):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = 2 * cos_table.shape[-1]
        self.rope_type = rope_type
        if self.rotary_dim > head_dim:
            raise ValueError(f"rotary dim {self.rotary_dim} exceeds head_dim {head_dim}")
        self.register_buffer("cos_table", cos_table.float(), persistent=False)
        self.register_buffer("sin_table", sin_table.float(), persistent=False)

    @property
    def is_partial(self) -> bool:
        return self.rotary_dim < self.head_dim

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token tables, looked up once per step and shared by every layer: [tokens, 1, rotary_dim / 2]."""
        return self.cos_table[positions].unsqueeze(1), self.sin_table[positions].unsqueeze(1)

    def apply(self, query: torch.Tensor, key: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> None:
        """query: [tokens, heads, head_dim], key: [tokens, kv_heads, head_dim]; rotated in place."""
        if self.is_partial:
            # Views: the kernels take size(2) as the rotated width and stride(1) as the head stride.
            query, key = query[..., : self.rotary_dim], key[..., : self.rotary_dim]
        apply_rotary(query, key, *cos_sin)
