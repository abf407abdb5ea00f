"""The attention-backend interface: the model calls it, never a concrete backend.

KV-cache layout, one tensor per layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (index 0 keys,
1 values). Token t of a request lives in block `block_table[t // block_size]` at offset `t % block_size`;
its flat slot is `block_id * block_size + offset`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class AttentionBatch:
    """One step's attention work as plain per-request lists, decodes first.

    Request i contributes query_lens[i] new tokens (flat and contiguous in the step's token rows) and attends
    to seq_lens[i] keys: its cached prefix plus those new tokens.
    """

    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: list[int]
    num_decodes: int
    """The first num_decodes requests have query_len 1."""
    decodes_share_sequences: bool = False
    """Some decode rows are one sequence's consecutive tokens (speculative drafts, each with its own seq_len): a
    row attends to the keys the rows before it write in the same step."""


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and attends over it, for a flat batch of mixed requests."""

    name: str
    supports_cuda_graphs: bool = False
    """Whether a decode step's write and attention can be captured (no host sync, no data-dependent shapes)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None = None,
        *,
        scale: float | None = None,
        logit_soft_cap: float | None = None,
    ):
        """sliding_window: a query sees the last `sliding_window` keys, itself included (None = all).
        scale multiplies q @ k^T (None = head_dim**-0.5); logit_soft_cap > 0 maps scores to
        `cap * tanh(scores / cap)` before the mask (None or 0 = off). A backend that cannot honour an argument raises.
        """
        if sliding_window is not None and sliding_window < 0:
            raise ValueError(f"sliding_window must be a key count (0 or None: no window), got {sliding_window}")
        if logit_soft_cap is not None and logit_soft_cap < 0:
            raise ValueError(f"logit_soft_cap must be positive (0 or None: off), got {logit_soft_cap}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sliding_window = sliding_window or None  # 0 = no window, as the kernels read it
        self.scale = head_dim**-0.5 if scale is None else float(scale)
        self.logit_soft_cap = float(logit_soft_cap) if logit_soft_cap else None

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """One layer's cache in the layout above."""
        return torch.zeros(2, num_blocks, block_size, self.num_kv_heads, self.head_dim, dtype=dtype, device=device)

    @abstractmethod
    def build_metadata(self, batch: AttentionBatch, block_size: int, device: torch.device) -> Any:
        """Turn the plain batch into this backend's tensors, once per step (shared by all layers)."""

    @abstractmethod
    def build_decode_metadata(
        self, seq_lens: torch.Tensor, block_tables: torch.Tensor, slot_mapping: torch.Tensor, block_size: int
    ) -> Any:
        """Metadata of a decode-only batch (one query token per request) from device tensors alone.

        seq_lens [requests], block_tables [requests, max_blocks] and slot_mapping [requests] are int32. Nothing
        is read back to the host, so a CUDA graph can capture it with the forward pass and replay it.
        """

    @abstractmethod
    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, metadata: Any
    ) -> torch.Tensor:
        """query [tokens, heads, head_dim], key/value [tokens, kv_heads, head_dim] -> [tokens, heads * head_dim]."""
