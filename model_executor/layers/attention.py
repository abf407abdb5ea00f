"""Decoder self-attention over the paged KV cache, shared by every model family: fused q/k/v projection, optional
per-head q/k norms, rotary from the step's table for this layer's rope key, the backend's paged attention, and the
output projection. Each family reads its own config and passes explicit arguments."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from cuda_ext.attention import AttentionBackend, get_attention_backend
from model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from model_executor.parallel_state import ParallelContext

if TYPE_CHECKING:
    from model_executor.models.decoder import StepInputs


class DecoderAttention(nn.Module):
    """Self-attention of one decoder layer. `attention_backend` names a registered backend ("auto": by device); the
    layer gets its `AttentionBackend` from `cuda_ext.attention`'s registry and calls only that interface.

    `scale` multiplies q @ k^T (None: head_dim**-0.5), `sliding_window` lets a query see its last keys only (None:
    all), `logit_soft_cap` maps scores to `cap * tanh(scores / cap)` (None: off). `q_norm` / `k_norm` normalise
    each head's query / key before rotary (Qwen3, Gemma 3). `rope_key` picks this layer's table from the step's
    `rope` dict (Gemma 3's sliding and global layers rotate differently).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        parallel: ParallelContext,
        attention_backend: str,
        device: torch.device,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        scale: float | None = None,
        sliding_window: int | None = None,
        logit_soft_cap: float | None = None,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        rope_key: str = "default",
    ):
        super().__init__()
        self.head_dim = head_dim
        self.rope_key = rope_key
        self.sliding_window = sliding_window or None
        self.logit_soft_cap = logit_soft_cap or None
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, num_heads, num_kv_heads, parallel, bias=qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, parallel, bias=o_bias)
        # Per-head weights [head_dim]: every TP rank holds them whole.
        self.q_norm = q_norm
        self.k_norm = k_norm
        self.num_heads = self.qkv_proj.num_heads_per_rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads_per_rank
        # Passed only when set, so a backend without these keywords still builds plain layers.
        backend_options: dict[str, float] = {}
        if scale is not None:
            backend_options["scale"] = scale
        if self.logit_soft_cap is not None:
            backend_options["logit_soft_cap"] = self.logit_soft_cap
        self.attn: AttentionBackend = get_attention_backend(
            attention_backend,
            device,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.sliding_window,
            **backend_options,
        )

    @property
    def scale(self) -> float:
        return self.attn.scale

    def forward(
        self,
        step: StepInputs,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every row's keys and values go into the cache; the output is `output_rows`' only (all rows if None)."""
        qkv = self.qkv_proj(hidden_states)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        query = qkv[:, :q_size].view(-1, self.num_heads, self.head_dim)
        key = qkv[:, q_size : q_size + kv_size].view(-1, self.num_kv_heads, self.head_dim)
        value = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        # The norms return new tensors; rotary then rotates those copies (or qkv's views) in place.
        if self.q_norm is not None:
            query = self.q_norm(query)
        if self.k_norm is not None:
            key = self.k_norm(key)
        rotary, cos_sin = step.rope[self.rope_key]
        # Each backend copies to contiguous only what its kernels need.
        rotary.apply(query, key, cos_sin)
        attended = self.attn.forward(query, key, value, kv_cache, step.attn_metadata)
        if output_rows is not None:
            attended = attended.index_select(0, output_rows)
        return self.o_proj(attended)
