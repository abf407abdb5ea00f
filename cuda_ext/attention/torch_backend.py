"""Paged attention in plain torch: the CPU backend and the reference for the Triton kernels.

Requests are split into two padded groups, decodes (one query row each) and prefill chunks, so a long prefill
chunk never pads the decodes' queries. Each group gathers its requests' KV blocks once per layer into a reused
buffer and runs one batched scaled-dot-product attention with an additive mask.

A step's metadata is built once, by one layer's backend, and shared by every layer, whose sliding windows may
differ: a group keeps its query positions and makes each window's mask on first use (then cached for the step).
Layers with a logit soft cap take an explicit path, since SDPA cannot cap: scores, cap, mask, fp32 softmax, values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from cuda_ext.attention.base import AttentionBackend, AttentionBatch


@dataclass(slots=True)
class PaddedGroup:
    """A set of requests attended together, padded to the longest query and the longest block table."""

    token_start: int
    token_end: int
    num_seqs: int
    max_query_len: int
    num_keys: int  # max_blocks * block_size: key positions 0 .. num_keys - 1 of every request
    gathered_block_ids: torch.Tensor  # [num_seqs * max_blocks] block ids, padding points at block 0
    query_positions: torch.Tensor  # [num_seqs, max_query_len] int64 absolute position of each padded query row
    is_real_query: torch.Tensor | None  # [num_seqs, max_query_len] bool; None when every row is real
    pad_index: torch.Tensor | None  # [num_seqs * max_query_len] group rows feeding each padded query row
    unpad_index: torch.Tensor | None  # [group tokens] padded rows holding each real query row
    key_buffer: torch.Tensor | None = None  # reused by every layer of the step
    value_buffer: torch.Tensor | None = None
    attn_biases: dict[tuple[int, int, torch.dtype], torch.Tensor] = field(default_factory=dict)
    """(sliding window or 0, group size, dtype) -> additive mask, made for the first layer asking for it."""

    def attn_bias(self, sliding_window: int | None, group_size: int, dtype: torch.dtype) -> torch.Tensor:
        """[num_seqs, 1, group_size * max_query_len (or 1), num_keys] of 0 and -inf for one layer's window.

        A query sees the keys at or before its position and, with a window W, after position - W: the last W keys,
        itself included (transformers' `kv_idx > q_idx - sliding_window`). Made from device tensors only.
        """
        cache_key = (sliding_window or 0, group_size, dtype)
        bias = self.attn_biases.get(cache_key)
        if bias is not None:
            return bias
        key_positions = torch.arange(self.num_keys, device=self.query_positions.device)[None, None, :]
        query_positions = self.query_positions[:, :, None]
        allowed = key_positions <= query_positions
        if sliding_window:
            allowed &= key_positions > query_positions - sliding_window
        if self.is_real_query is not None:
            # Padded query rows look at key 0 only, so no row is all -inf (which would give NaN).
            allowed = torch.where(self.is_real_query[:, :, None], allowed, key_positions == 0)
        bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
        if self.max_query_len > 1 and group_size > 1:
            # Rows ordered (query head in group, query position) to match the folded query layout.
            bias = bias.unsqueeze(1).expand(-1, group_size, -1, -1).reshape(self.num_seqs, -1, self.num_keys)
        bias = bias.unsqueeze(1)
        self.attn_biases[cache_key] = bias
        return bias


@dataclass(slots=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    has_padding_slots: bool
    groups: list[PaddedGroup]


def decode_group(seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> PaddedGroup:
    """The padded group of a decode-only batch (one query per request) from device tensors alone.

    seq_lens [requests] and block_tables [requests, max_blocks]; nothing is read back to the host.
    """
    num_seqs, max_blocks = block_tables.shape
    query_positions = (seq_lens.to(torch.int64) - 1)[:, None]
    gathered_block_ids = block_tables.to(torch.int64).flatten()
    return PaddedGroup(
        0, num_seqs, num_seqs, 1, max_blocks * block_size, gathered_block_ids, query_positions, None, None, None
    )


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def build_metadata(self, batch: AttentionBatch, block_size: int, device: torch.device) -> TorchAttentionMetadata:
        slot_mapping = torch.tensor(batch.slot_mapping, dtype=torch.int64, device=device)
        groups = []
        num_decode_tokens = batch.num_decodes
        if batch.num_decodes:
            groups.append(self._build_group(batch, 0, batch.num_decodes, 0, block_size, device))
        if batch.num_decodes < len(batch.query_lens):
            groups.append(
                self._build_group(
                    batch, batch.num_decodes, len(batch.query_lens), num_decode_tokens, block_size, device
                )
            )
        has_padding = bool(batch.slot_mapping) and min(batch.slot_mapping) < 0
        return TorchAttentionMetadata(slot_mapping, has_padding, groups)

    def build_decode_metadata(
        self, seq_lens: torch.Tensor, block_tables: torch.Tensor, slot_mapping: torch.Tensor, block_size: int
    ) -> TorchAttentionMetadata:
        group = decode_group(seq_lens, block_tables, block_size)
        # Padding rows carry slot -1, so the write always filters.
        return TorchAttentionMetadata(slot_mapping.to(torch.int64), True, [group])

    def _build_group(
        self, batch: AttentionBatch, first: int, last: int, token_start: int, block_size: int, device: torch.device
    ) -> PaddedGroup:
        query_lens = batch.query_lens[first:last]
        seq_lens = batch.seq_lens[first:last]
        num_seqs = last - first
        max_query_len = max(query_lens)
        max_blocks = max(-(-seq_len // block_size) for seq_len in seq_lens)
        block_ids = torch.zeros(num_seqs, max_blocks, dtype=torch.int64)
        for row, block_table in enumerate(batch.block_tables[first:last]):
            needed = -(-seq_lens[row] // block_size)
            block_ids[row, :needed] = torch.tensor(block_table[:needed], dtype=torch.int64)

        query_lens_t = torch.tensor(query_lens, dtype=torch.int64)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64)
        query_offsets = torch.arange(max_query_len)
        # Absolute position of each (padded) query row.
        query_positions = (seq_lens_t - query_lens_t)[:, None] + query_offsets[None, :]
        is_real_query = query_offsets[None, :] < query_lens_t[:, None]

        pad_index = unpad_index = None
        if max_query_len > 1:
            starts = torch.cumsum(query_lens_t, 0) - query_lens_t
            pad_index = (starts[:, None] + query_offsets[None, :]).clamp(max=sum(query_lens) - 1)
            pad_index = torch.where(is_real_query, pad_index, 0).flatten().to(device)
            unpad_index = is_real_query.flatten().nonzero().squeeze(1).to(device)
        return PaddedGroup(
            token_start=token_start,
            token_end=token_start + sum(query_lens),
            num_seqs=num_seqs,
            max_query_len=max_query_len,
            num_keys=max_blocks * block_size,
            gathered_block_ids=block_ids.flatten().to(device),
            query_positions=query_positions.to(device),
            is_real_query=None if bool(is_real_query.all()) else is_real_query.to(device),
            pad_index=pad_index,
            unpad_index=unpad_index,
        )

    def write_kv_cache(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, metadata: TorchAttentionMetadata
    ) -> None:
        slot_mapping = metadata.slot_mapping
        if metadata.has_padding_slots:
            keep = slot_mapping >= 0
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        kv_cache[0].view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slot_mapping, key)
        kv_cache[1].view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slot_mapping, value)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
    ) -> torch.Tensor:
        self.write_kv_cache(key, value, kv_cache, metadata)
        query = query.contiguous()  # the padded groups view it
        output = torch.empty(query.shape[0], self.num_heads * self.head_dim, dtype=query.dtype, device=query.device)
        for group in metadata.groups:
            output[group.token_start : group.token_end] = self._attend_group(
                query[group.token_start : group.token_end], kv_cache, group
            )
        return output

    def _attend_group(self, query: torch.Tensor, kv_cache: torch.Tensor, group: PaddedGroup) -> torch.Tensor:
        block_size = kv_cache.shape[2]
        if group.key_buffer is None:
            buffer_shape = (group.gathered_block_ids.numel(), block_size, self.num_kv_heads, self.head_dim)
            group.key_buffer = torch.empty(buffer_shape, dtype=kv_cache.dtype, device=kv_cache.device)
            group.value_buffer = torch.empty_like(group.key_buffer)
        # index_select into a reused buffer: a fresh allocation per layer costs page faults on CPU.
        torch.index_select(kv_cache[0], 0, group.gathered_block_ids, out=group.key_buffer)
        torch.index_select(kv_cache[1], 0, group.gathered_block_ids, out=group.value_buffer)
        num_seqs, max_query_len = group.num_seqs, group.max_query_len
        num_kv_heads, group_size, head_dim = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        keys = group.key_buffer.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
        values = group.value_buffer.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
        if group.pad_index is not None:
            query = query.index_select(0, group.pad_index)
        # GQA folded into the query-length axis: each KV head is read once for all its query heads.
        query = query.view(num_seqs, max_query_len, num_kv_heads, group_size, head_dim)
        query = query.permute(0, 2, 3, 1, 4).reshape(num_seqs, num_kv_heads, group_size * max_query_len, head_dim)
        if self.logit_soft_cap is None:
            attn_bias = group.attn_bias(self.sliding_window, group_size, query.dtype)
            attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=attn_bias, scale=self.scale)
        else:
            attn_bias = group.attn_bias(self.sliding_window, group_size, torch.float32)
            attended = soft_capped_attention(query, keys, values, attn_bias, self.scale, self.logit_soft_cap)
        attended = attended.view(num_seqs, num_kv_heads, group_size, max_query_len, head_dim).permute(0, 3, 1, 2, 4)
        attended = attended.reshape(num_seqs * max_query_len, self.num_heads * head_dim)
        if group.unpad_index is not None:
            attended = attended.index_select(0, group.unpad_index)
        return attended


def soft_capped_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    attn_bias: torch.Tensor,
    scale: float,
    soft_cap: float,
) -> torch.Tensor:
    """softmax(cap * tanh(q @ k^T * scale / cap) + bias) @ v, all in fp32, returned in the query's dtype.

    query [..., rows, head_dim], keys/values [..., keys, head_dim], attn_bias broadcast to [..., rows, keys].
    """
    scores = torch.matmul(query.float(), keys.float().transpose(-1, -2)).mul_(scale / soft_cap)
    scores = scores.tanh_().mul_(soft_cap).add_(attn_bias)
    probabilities = torch.softmax(scores, dim=-1)
    return torch.matmul(probabilities, values.float()).to(query.dtype)
