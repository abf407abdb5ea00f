"""Paged attention with Triton kernels: the CUDA backend (also runs on CPU tensors under TRITON_INTERPRET=1).

Per step, `build_metadata` packs every per-request array into one int32 host tensor and moves it to the device
in a single copy; per layer, `forward` launches two kernels: the KV-cache write, then one unified attention
launch over the whole flat batch (decodes and prefill chunks together).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cuda_ext.attention.base import AttentionBackend, AttentionBatch
from cuda_ext.kernels.reshape_and_cache import reshape_and_cache
from cuda_ext.kernels.unified_attention import (
    INTERPRETED,
    TileConfig,
    make_tile_config,
    plan_query_tiles,
    unified_attention,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TritonAttentionMetadata:
    """One step's device tensors, shared by every layer (all int32 views of one buffer)."""

    query_start_loc: torch.Tensor  # [requests + 1] cumulative query lengths
    seq_lens: torch.Tensor  # [requests] cached prefix + new tokens
    slot_mapping: torch.Tensor  # [tokens] flat cache slot of each new token, -1 = padding row
    tile_request: torch.Tensor  # [tiles] request of each query tile
    tile_q_start: torch.Tensor  # [tiles] first query offset (within its request) of each tile
    block_tables: torch.Tensor  # [requests, max_blocks] padded with block 0
    num_small_tiles: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int


def check_triton_device(device: torch.device) -> None:
    """Raise a clear error where Triton kernels cannot run: CPU tensors need the kernels interpreted."""
    if device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            f"the triton attention backend needs a CUDA device, got {device}; "
            "set TRITON_INTERPRET=1 before cuda_ext.kernels is imported to run it on CPU (slow, for tests)"
        )


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

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
        super().__init__(num_heads, num_kv_heads, head_dim, sliding_window, scale=scale, logit_soft_cap=logit_soft_cap)
        self.tile_config: TileConfig = make_tile_config(num_heads, num_kv_heads, head_dim)
        self._decode_tile_cache: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def build_decode_metadata(
        self, seq_lens: torch.Tensor, block_tables: torch.Tensor, slot_mapping: torch.Tensor, block_size: int
    ) -> TritonAttentionMetadata:
        check_triton_device(seq_lens.device)
        num_seqs, max_blocks = block_tables.shape
        query_start_loc, tile_request, tile_q_start = self._decode_tiles(num_seqs, seq_lens.device)
        return TritonAttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            slot_mapping=slot_mapping,
            tile_request=tile_request,
            tile_q_start=tile_q_start,
            block_tables=block_tables,
            num_small_tiles=num_seqs,
            num_tokens=num_seqs,
            max_query_len=1,
            max_seq_len=max_blocks * block_size,  # an upper bound: the kernel reads each request's own seq_len
        )

    def _decode_tiles(self, num_seqs: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A decode batch's fixed tile plan (one small tile per request), made once per size and device.

        Cached so a CUDA graph replays with the tensors its warm-up created, never allocating inside capture.
        """
        key = (num_seqs, str(device))
        tiles = self._decode_tile_cache.get(key)
        if tiles is None:
            arange = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)
            tiles = (arange, arange[:num_seqs], torch.zeros(num_seqs, dtype=torch.int32, device=device))
            self._decode_tile_cache[key] = tiles
        return tiles

    def build_metadata(self, batch: AttentionBatch, block_size: int, device: torch.device) -> TritonAttentionMetadata:
        check_triton_device(device)
        num_requests = len(batch.query_lens)
        query_start_loc = [0]
        for query_len in batch.query_lens:
            query_start_loc.append(query_start_loc[-1] + query_len)
        blocks_needed = [-(-seq_len // block_size) for seq_len in batch.seq_lens]
        max_blocks = max(blocks_needed, default=0) or 1
        # Block tables may hold blocks allocated beyond seq_len: keep only those the kernel can read.
        block_tables: list[int] = []
        for block_table, needed in zip(batch.block_tables, blocks_needed, strict=True):
            block_tables.extend(block_table[:needed])
            block_tables.extend([0] * (max_blocks - needed))
        tile_request, tile_q_start, num_small_tiles = plan_query_tiles(batch.query_lens, self.tile_config)
        parts = [query_start_loc, batch.seq_lens, batch.slot_mapping, tile_request, tile_q_start, block_tables]
        packed = torch.tensor([value for part in parts for value in part], dtype=torch.int32)
        if device.type == "cuda":
            packed = packed.pin_memory().to(device, non_blocking=True)
        views = list(torch.split(packed, [len(part) for part in parts]))
        return TritonAttentionMetadata(
            query_start_loc=views[0],
            seq_lens=views[1],
            slot_mapping=views[2],
            tile_request=views[3],
            tile_q_start=views[4],
            block_tables=views[5].view(num_requests, max_blocks),
            num_small_tiles=num_small_tiles,
            num_tokens=query_start_loc[-1],
            max_query_len=max(batch.query_lens, default=0),
            max_seq_len=max(batch.seq_lens, default=0),
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = query.shape[0]
        output = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=query.dtype, device=query.device)
        reshape_and_cache(key, value, kv_cache[0], kv_cache[1], metadata.slot_mapping)
        unified_attention(
            query,
            kv_cache[0],
            kv_cache[1],
            output,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            metadata.tile_request,
            metadata.tile_q_start,
            metadata.num_small_tiles,
            self.tile_config,
            self.scale,
            self.sliding_window,
            self.logit_soft_cap,
        )
        return output.view(num_tokens, self.num_heads * self.head_dim)
