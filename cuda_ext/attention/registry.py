"""Picks the attention backend from the device, with a config override."""

from __future__ import annotations

import torch

from cuda_ext.attention.base import AttentionBackend
from cuda_ext.attention.torch_backend import TorchAttentionBackend

BACKENDS: dict[str, type[AttentionBackend]] = {TorchAttentionBackend.name: TorchAttentionBackend}


def get_attention_backend(
    name: str,
    device: torch.device,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    sliding_window: int | None = None,
) -> AttentionBackend:
    """`name` is a registered backend or "auto" (the torch backend until the Triton one lands)."""
    if name == "auto":
        name = TorchAttentionBackend.name
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(BACKENDS)} or 'auto'")
    return BACKENDS[name](num_heads, num_kv_heads, head_dim, sliding_window)
