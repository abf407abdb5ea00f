"""Paged attention on CPU with our C++ kernels: the default CPU backend when they compile.

Decodes (one query token each) run `paged_decode_attention`, which reads every request's KV blocks in place;
prefill chunks keep the torch backend's padded-group SDPA (compute-bound, where a GEMM wins). The KV write is
one C++ call per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cuda_ext.attention.base import AttentionBatch
from cuda_ext.attention.torch_backend import PaddedGroup, TorchAttentionBackend
from cuda_ext.cpu_ops import load_cpu_ops


@dataclass(slots=True)
class CpuAttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] int64, -1 = padding row
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [decodes, max_blocks] int32
    decode_seq_lens: torch.Tensor | None  # [decodes] int32
    prefill_group: PaddedGroup | None


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None):
        super().__init__(num_heads, num_kv_heads, head_dim, sliding_window)
        ops = load_cpu_ops()
        if ops is None:
            raise RuntimeError("the cpu attention backend needs the C++ CPU kernels, which did not build")
        self.ops = ops

    def build_metadata(self, batch: AttentionBatch, block_size: int, device: torch.device) -> CpuAttentionMetadata:
        num_decodes = batch.num_decodes
        decode_tables = decode_lens = None
        if num_decodes:
            seq_lens = batch.seq_lens[:num_decodes]
            needed = [-(-seq_len // block_size) for seq_len in seq_lens]
            width = max(needed)
            rows = [table[:n] + [0] * (width - n) for table, n in zip(batch.block_tables, needed, strict=False)]
            decode_tables = torch.tensor(rows, dtype=torch.int32)
            decode_lens = torch.tensor(seq_lens, dtype=torch.int32)
        prefill_group = None
        if num_decodes < len(batch.query_lens):
            prefill_group = self._build_group(
                batch, num_decodes, len(batch.query_lens), num_decodes, block_size, device
            )
        slot_mapping = torch.tensor(batch.slot_mapping, dtype=torch.int64)
        return CpuAttentionMetadata(slot_mapping, num_decodes, decode_tables, decode_lens, prefill_group)

    def build_decode_metadata(
        self, seq_lens: torch.Tensor, block_tables: torch.Tensor, slot_mapping: torch.Tensor, block_size: int
    ) -> CpuAttentionMetadata:
        return CpuAttentionMetadata(
            slot_mapping.to(torch.int64),
            seq_lens.shape[0],
            block_tables.to(torch.int32).contiguous(),
            seq_lens.to(torch.int32).contiguous(),
            None,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CpuAttentionMetadata,
    ) -> torch.Tensor:
        self.ops.reshape_and_cache(key, value, kv_cache[0], kv_cache[1], metadata.slot_mapping)
        output = torch.empty(query.shape[0], self.num_heads * self.head_dim, dtype=query.dtype, device=query.device)
        num_decodes = metadata.num_decodes
        if num_decodes:
            decode_output = output[:num_decodes].view(num_decodes, self.num_heads, self.head_dim)
            self.ops.paged_decode_attention(
                decode_output,
                query[:num_decodes],
                kv_cache[0],
                kv_cache[1],
                metadata.decode_block_tables,
                metadata.decode_seq_lens,
                self.scale,
                self.sliding_window or 0,
            )
        group = metadata.prefill_group
        if group is not None:
            output[group.token_start : group.token_end] = self._attend_group(
                query[group.token_start : group.token_end].contiguous(), kv_cache, group
            )
        return output
