"""Paged attention on CPU with our C++ kernels: the default CPU backend when they compile.

Decodes (one query token each) run `paged_decode_attention`, prefill chunks `paged_prefill_attention`; both read
every request's KV blocks in place (decode in fp32 or bf16, fp32 math). Steps with a prefill chunk past
PREFILL_KERNEL_MAX_KEYS keys, and other dtypes than PREFILL_KERNEL_DTYPES or head sizes, keep the torch backend's
padded-group SDPA for their prefill chunks. The KV write is one C++ call per layer.

The metadata is shared by all layers of a step: each layer passes its own window, scale and soft cap to the
kernels (a soft cap of 0 is none), and the SDPA fallback's groups make one mask per window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cuda_ext.attention.base import AttentionBatch
from cuda_ext.attention.torch_backend import PaddedGroup, TorchAttentionBackend
from cuda_ext.cpu_ops import load_cpu_ops

# Prefill chunks with up to this many keys (cached prefix plus chunk) run our kernel, longer ones SDPA: over long
# key runs SDPA's GEMM tiles beat our flash loop, over short ones its padding and masking cost more (see the prefill
# rows of `benchmarks/bench_cpu_kernels.py`).
PREFILL_KERNEL_MAX_KEYS = 256
# The dtypes whose prefill chunks run our kernel. It reads bf16 too (widened to fp32 lanes), but SDPA's bf16 path beat
# it on every bf16 prefill row of `benchmarks/bench_cpu_kernels.py` where measured: bf16 and fp16 chunks take SDPA.
PREFILL_KERNEL_DTYPES = (torch.float32,)
# The kernel's cache row offsets are 32-bit.
PREFILL_KERNEL_MAX_CACHE_ELEMENTS = 2**31 - 1


@dataclass(slots=True)
class CpuAttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] int64, -1 = padding row
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [decodes, max_blocks] int32
    decode_seq_lens: torch.Tensor | None  # [decodes] int32
    prefill: PrefillChunks | None
    decodes_share_sequences: bool = False  # see AttentionBatch


@dataclass(slots=True)
class PrefillChunks:
    """The step's prefill chunks (after its decodes), as the C++ kernel reads them."""

    batch: AttentionBatch
    block_size: int
    block_tables: torch.Tensor  # [chunks, max_blocks] int32
    query_starts: torch.Tensor  # [chunks + 1] int32, rows into the chunks' tokens
    seq_lens: torch.Tensor  # [chunks] int32: cached keys plus the chunk's own
    fits_kernel: bool  # no chunk has more than PREFILL_KERNEL_MAX_KEYS keys
    padded_group: PaddedGroup | None = None  # built on first use, for the SDPA fallback (window-independent)


def padded_block_tables(block_tables: list[list[int]], seq_lens: list[int], block_size: int) -> torch.Tensor:
    """[requests, max blocks] int32: each request's blocks that hold its seq_len keys, then block 0 as padding."""
    needed = [-(-seq_len // block_size) for seq_len in seq_lens]
    width = max(needed)
    rows = [table[:n] + [0] * (width - n) for table, n in zip(block_tables, needed, strict=True)]
    return torch.tensor(rows, dtype=torch.int32)


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

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
        ops = load_cpu_ops()
        if ops is None:
            raise RuntimeError("the cpu attention backend needs the C++ CPU kernels, which did not build")
        self.ops = ops
        # The kernel's vector path holds whole head rows in registers; other head sizes take SDPA.
        self.prefill_kernel_head_dim = head_dim % ops.vector_lanes == 0
        self.soft_cap = self.logit_soft_cap or 0.0

    def build_metadata(self, batch: AttentionBatch, block_size: int, device: torch.device) -> CpuAttentionMetadata:
        num_decodes = batch.num_decodes
        decode_tables = decode_lens = None
        if num_decodes:
            seq_lens = batch.seq_lens[:num_decodes]
            decode_tables = padded_block_tables(batch.block_tables[:num_decodes], seq_lens, block_size)
            decode_lens = torch.tensor(seq_lens, dtype=torch.int32)
        prefill = None
        if num_decodes < len(batch.query_lens):
            prefill = self._prefill_chunks(batch, block_size)
        slot_mapping = torch.tensor(batch.slot_mapping, dtype=torch.int64)
        return CpuAttentionMetadata(
            slot_mapping, num_decodes, decode_tables, decode_lens, prefill, batch.decodes_share_sequences
        )

    def _prefill_chunks(self, batch: AttentionBatch, block_size: int) -> PrefillChunks:
        first = batch.num_decodes
        seq_lens = batch.seq_lens[first:]
        query_starts = [0]
        for query_len in batch.query_lens[first:]:
            query_starts.append(query_starts[-1] + query_len)
        return PrefillChunks(
            batch,
            block_size,
            padded_block_tables(batch.block_tables[first:], seq_lens, block_size),
            torch.tensor(query_starts, dtype=torch.int32),
            torch.tensor(seq_lens, dtype=torch.int32),
            max(seq_lens) <= PREFILL_KERNEL_MAX_KEYS,
        )

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
                soft_cap=self.soft_cap,
            )
        prefill = metadata.prefill
        if prefill is None:
            return output
        if (
            prefill.fits_kernel
            and self.prefill_kernel_head_dim
            and query.dtype in PREFILL_KERNEL_DTYPES
            and kv_cache[0].numel() <= PREFILL_KERNEL_MAX_CACHE_ELEMENTS
        ):
            prefill_query = query[num_decodes:]
            self.ops.paged_prefill_attention(
                output[num_decodes:].view(prefill_query.shape),
                prefill_query if prefill_query.stride(1) == self.head_dim else prefill_query.contiguous(),
                kv_cache[0],
                kv_cache[1],
                prefill.block_tables,
                prefill.query_starts,
                prefill.seq_lens,
                self.scale,
                self.sliding_window or 0,
                soft_cap=self.soft_cap,
            )
            return output
        group = prefill.padded_group
        if group is None:
            batch = prefill.batch
            group = prefill.padded_group = self._build_group(
                batch, num_decodes, len(batch.query_lens), num_decodes, prefill.block_size, query.device
            )
        output[group.token_start : group.token_end] = self._attend_group(
            query[group.token_start : group.token_end].contiguous(), kv_cache, group
        )
        return output
