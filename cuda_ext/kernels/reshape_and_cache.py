"""Kernel 1: write a step's new keys and values into the paged KV cache ("reshape and cache")."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One program per token: copies its [kv_heads, head_dim] key and value rows to its slot (-1: skipped)."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, KV_HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    # A masked store rather than an early return: padding slots (-1) write nothing. The slot test is made a
    # tensor first: a scalar-bool & tensor-bool mask comes out int64 under the interpreter.
    slot_valid = (tl.zeros([KV_HEADS_PAD], dtype=tl.int64) + slot) >= 0
    mask = slot_valid[:, None] & (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    key = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    cache_offsets = block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    tl.store(key_cache_ptr + cache_offsets, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [tokens, kv_heads, head_dim] into key_cache/value_cache [blocks, block_size, kv_heads,
    head_dim] at slot_mapping [tokens] (block_id * block_size + offset; negative slots are padding, skipped).

    key/value may be strided views (e.g. slices of a fused QKV output) as long as head_dim is contiguous.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    if key_cache.stride(-1) != 1 or key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must share strides with a contiguous head_dim")
    block_size = key_cache.shape[1]
    reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
    )
