"""Rotary position embedding (NeoX half-split layout, as Llama checkpoints in HF format use)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from cuda_ext.fused_ops import apply_rotary


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


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to q and k in place from a precomputed cos/sin table."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        rope_theta: float,
        rope_scaling: dict[str, Any] | None = None,
    ):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = llama3_scaled_inv_freq(inv_freq, rope_scaling)
        elif rope_type not in ("default", None):
            raise ValueError(f"rope scaling type {rope_type!r} is not supported (default and llama3 are)")
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos_table", freqs.cos(), persistent=False)
        self.register_buffer("sin_table", freqs.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token tables, looked up once per step and shared by every layer: [tokens, 1, head_dim / 2]."""
        return self.cos_table[positions].unsqueeze(1), self.sin_table[positions].unsqueeze(1)

    def apply(self, query: torch.Tensor, key: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> None:
        """query: [tokens, heads, head_dim], key: [tokens, kv_heads, head_dim]; rotated in place."""
        apply_rotary(query, key, *cos_sin)
