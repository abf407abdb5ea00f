"""Kernel 2: unified paged attention, one launch for a flat batch mixing prefill chunks and decodes.

Work is cut into query tiles, each (request, first query of the tile) planned on the host by `plan_query_tiles`;
the grid is (tiles, kv_heads), so programs exist for real query tiles only. A program holds BLOCK_M rows =
BLOCK_Q query tokens x GROUP_PAD query heads sharing one KV head (GQA: each K/V tile is loaded once for the
whole group), walks the request's KV through its block table TILE_N keys at a time and accumulates an online
softmax in fp32. Short queries (decodes) get a small tile, long ones (prefill chunks) a large one: the first
`num_small_tiles` programs take the small-tile branch, so a decode never pays for a prefill-sized tile.

Masking is by absolute position: query i of a request with seq_len S and query_len Q sits at position S - Q + i
and sees keys at positions <= its own (and > position - sliding_window when a window is set). With a logit soft cap,
scores become `cap * tanh(scores / cap)` before the mask (Gemma 2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Smallest tl.dot operand size on NVIDIA tensor cores.
MIN_DOT_SIZE = 16
SMALL_BLOCK_M = 16
LARGE_BLOCK_M = 64
SMALL_TILE_N = 32
LARGE_TILE_N = 64
LOG2E: tl.constexpr = tl.constexpr(math.log2(math.e))
# Kernels are decorated for the interpreter or for the GPU once, at import: TRITON_INTERPRET=1 must be set before.
INTERPRETED = bool(triton.knobs.runtime.interpret)


@dataclass(frozen=True, slots=True)
class TileConfig:
    """Compile-time tile shape of the unified kernel for one (group size, head_dim) layer shape."""

    num_queries_per_kv: int
    group_pad: int  # query heads per KV head, padded to a power of two
    head_dim: int
    head_dim_pad: int  # padded to a power of two >= 16 (tl.arange and tl.dot need it)
    small_block_m: int
    large_block_m: int
    small_tile_n: int
    large_tile_n: int

    @property
    def small_block_q(self) -> int:
        """Query tokens per small tile: requests with at most this many new tokens use one small tile."""
        return self.small_block_m // self.group_pad

    @property
    def large_block_q(self) -> int:
        return self.large_block_m // self.group_pad


def make_tile_config(num_heads: int, num_kv_heads: int, head_dim: int) -> TileConfig:
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    num_queries_per_kv = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(num_queries_per_kv)
    return TileConfig(
        num_queries_per_kv=num_queries_per_kv,
        group_pad=group_pad,
        head_dim=head_dim,
        head_dim_pad=max(MIN_DOT_SIZE, triton.next_power_of_2(head_dim)),
        small_block_m=max(SMALL_BLOCK_M, group_pad),
        large_block_m=max(LARGE_BLOCK_M, group_pad),
        small_tile_n=SMALL_TILE_N,
        large_tile_n=LARGE_TILE_N,
    )


def plan_query_tiles(query_lens: Sequence[int], config: TileConfig) -> tuple[list[int], list[int], int]:
    """(request of each tile, first query offset of each tile, number of small tiles), small tiles first.

    A request with at most `config.small_block_q` new tokens (every decode) is one small tile; a longer one is
    cut into large tiles of `config.large_block_q` queries. Requests with no new tokens get no tile.
    """
    small_block_q, large_block_q = config.small_block_q, config.large_block_q
    small = [request for request, query_len in enumerate(query_lens) if 0 < query_len <= small_block_q]
    tile_request = list(small)
    tile_q_start = [0] * len(small)
    for request, query_len in enumerate(query_lens):
        if query_len > small_block_q:
            for q_start in range(0, query_len, large_block_q):
                tile_request.append(request)
                tile_q_start.append(q_start)
    return tile_request, tile_q_start, len(small)


@triton.jit
def _attend_tile(
    tile,
    kv_head,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    tile_request_ptr,
    tile_q_start_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    NUM_QUERIES_PER_KV: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    request = tl.load(tile_request_ptr + tile)
    q_start = tl.load(tile_q_start_ptr + tile)
    token_start = tl.load(query_start_loc_ptr + request)
    query_len = tl.load(query_start_loc_ptr + request + 1) - token_start
    seq_len = tl.load(seq_lens_ptr + request)
    context_len = seq_len - query_len

    # Row r of the tile is query token q_start + r // GROUP_PAD, query head r % GROUP_PAD of this KV head.
    rows = tl.arange(0, BLOCK_M)
    q_offset = q_start + rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    row_valid = (q_offset < query_len) & (head_in_group < NUM_QUERIES_PER_KV)
    q_pos = context_len + q_offset
    head = kv_head * NUM_QUERIES_PER_KV + head_in_group
    token = (token_start + q_offset).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(
        query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    # Keys the tile's last real query can see end at its own position; earlier tiles need no more.
    last_q = tl.minimum(q_start + BLOCK_Q, query_len) - 1
    kv_end = context_len + last_q + 1
    if SLIDING_WINDOW > 0:
        # The first query of the tile sees the earliest key; start at the KV tile that holds it.
        kv_lo = tl.maximum(context_len + q_start - SLIDING_WINDOW + 1, 0)
        kv_begin = (kv_lo // TILE_N) * TILE_N
    else:
        kv_lo = 0
        kv_begin = 0

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    block_table = block_tables_ptr + request.to(tl.int64) * stride_bt
    kv_head_offset = kv_head.to(tl.int64) * stride_ch
    for tile_start in range(kv_begin, kv_end, TILE_N):
        key_pos = tile_start + tl.arange(0, TILE_N)
        # Keys no row of the tile may see are not even loaded (0 * garbage could be NaN in P @ V).
        key_valid = (key_pos >= kv_lo) & (key_pos < kv_end)
        # Each key finds its physical block, so a KV tile may span several cache blocks.
        physical = tl.load(block_table + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slot_offsets = physical * stride_cb + (key_pos % BLOCK_SIZE).to(tl.int64) * stride_cs + kv_head_offset
        k_t = tl.load(
            key_cache_ptr + slot_offsets[None, :] + dims[:, None],
            mask=dim_valid[:, None] & key_valid[None, :],
            other=0.0,
        )
        v = tl.load(
            value_cache_ptr + slot_offsets[:, None] + dims[None, :],
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        if DOT_FP32:
            k_t = k_t.to(tl.float32)
            v = v.to(tl.float32)
        # Scores in log2 units: the softmax scale and log2(e) are folded into one multiply for exp2.
        scores = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP > 0:
            # cap * tanh(s / cap) in log2 units (SOFTCAP = cap * log2(e)), tanh(x) = 1 - 2 / (e^(2x) + 1) via exp2.
            scores = SOFTCAP * (1.0 - 2.0 / (tl.math.exp2(scores * (2.0 * LOG2E / SOFTCAP)) + 1.0))
        allowed = key_valid[None, :] & (key_pos[None, :] <= q_pos[:, None])
        if SLIDING_WINDOW > 0:
            allowed = allowed & (key_pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # A row with no visible key so far (padding, window start) keeps max -inf: subtract 0, not -inf (NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(scores - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Rows that saw no key (only padding rows can) divide by 1 and stay 0 instead of NaN.
    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out_offsets = token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=q_mask)


# num_small_tiles changes every step: not specializing on it avoids recompiles (e.g. when it is 1).
@triton.jit(do_not_specialize=["num_small_tiles"])
def unified_attention_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    tile_request_ptr,
    tile_q_start_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_small_tiles,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    NUM_QUERIES_PER_KV: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SMALL_BLOCK_M: tl.constexpr,
    SMALL_TILE_N: tl.constexpr,
    LARGE_BLOCK_M: tl.constexpr,
    LARGE_TILE_N: tl.constexpr,
):
    """Grid (tiles, kv_heads); programs below num_small_tiles use the small (decode) tile."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    if tile < num_small_tiles:
        _attend_tile(
            tile,
            kv_head,
            query_ptr,
            key_cache_ptr,
            value_cache_ptr,
            out_ptr,
            tile_request_ptr,
            tile_q_start_ptr,
            query_start_loc_ptr,
            seq_lens_ptr,
            block_tables_ptr,
            scale_log2,
            stride_qt,
            stride_qh,
            stride_ot,
            stride_oh,
            stride_cb,
            stride_cs,
            stride_ch,
            stride_bt,
            NUM_QUERIES_PER_KV,
            GROUP_PAD,
            HEAD_DIM,
            HEAD_DIM_PAD,
            BLOCK_SIZE,
            SLIDING_WINDOW,
            SOFTCAP,
            DOT_FP32,
            DOT_PRECISION,
            SMALL_BLOCK_M,
            SMALL_TILE_N,
        )
    else:
        _attend_tile(
            tile,
            kv_head,
            query_ptr,
            key_cache_ptr,
            value_cache_ptr,
            out_ptr,
            tile_request_ptr,
            tile_q_start_ptr,
            query_start_loc_ptr,
            seq_lens_ptr,
            block_tables_ptr,
            scale_log2,
            stride_qt,
            stride_qh,
            stride_ot,
            stride_oh,
            stride_cb,
            stride_cs,
            stride_ch,
            stride_bt,
            NUM_QUERIES_PER_KV,
            GROUP_PAD,
            HEAD_DIM,
            HEAD_DIM_PAD,
            BLOCK_SIZE,
            SLIDING_WINDOW,
            SOFTCAP,
            DOT_FP32,
            DOT_PRECISION,
            LARGE_BLOCK_M,
            LARGE_TILE_N,
        )


def unified_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    tile_request: torch.Tensor,
    tile_q_start: torch.Tensor,
    num_small_tiles: int,
    config: TileConfig,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> None:
    """Attention of query [tokens, heads, head_dim] over the paged cache into output [tokens, heads, head_dim].

    key_cache/value_cache: [blocks, block_size, kv_heads, head_dim] already holding the step's new tokens.
    query_start_loc [requests + 1], seq_lens [requests], block_tables [requests, max_blocks] (int32, padding
    entries may be anything valid, e.g. 0), and the tile plan from `plan_query_tiles` as int32 tensors.
    Every real query token must be covered by the plan; rows of padded tokens are left untouched.
    Scores are `q @ k^T * scale`, then `soft_cap * tanh(scores / soft_cap)` when soft_cap is set, then masked.
    """
    num_tiles = tile_request.shape[0]
    if num_tiles == 0:
        return
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key_cache.stride(-1) != 1 or key_cache.stride() != value_cache.stride() or output.stride(-1) != 1:
        raise ValueError("caches and output need a contiguous head_dim, and both caches the same strides")
    num_kv_heads = key_cache.shape[2]
    # fp32 models want exact fp32 dots on GPU (not TF32); the interpreter's bf16 dot is wrong, so it gets fp32.
    dot_fp32 = query.dtype == torch.float32 or INTERPRETED
    unified_attention_kernel[(num_tiles, num_kv_heads)](
        query,
        key_cache,
        value_cache,
        output,
        tile_request,
        tile_q_start,
        query_start_loc,
        seq_lens,
        block_tables,
        num_small_tiles,
        scale * math.log2(math.e),
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        NUM_QUERIES_PER_KV=config.num_queries_per_kv,
        GROUP_PAD=config.group_pad,
        HEAD_DIM=config.head_dim,
        HEAD_DIM_PAD=config.head_dim_pad,
        BLOCK_SIZE=key_cache.shape[1],
        SLIDING_WINDOW=sliding_window or 0,
        # In the kernel's log2 units; one compiled variant per cap value (a model has one or two).
        SOFTCAP=soft_cap * math.log2(math.e) if soft_cap else 0.0,
        DOT_FP32=dot_fp32,
        DOT_PRECISION="ieee" if dot_fp32 else "tf32",
        SMALL_BLOCK_M=config.small_block_m,
        SMALL_TILE_N=config.small_tile_n,
        LARGE_BLOCK_M=config.large_block_m,
        LARGE_TILE_N=config.large_tile_n,
        num_warps=4,
        # fp32 K/V tiles are twice the shared memory per pipeline stage: fewer stages keep them within limits.
        num_stages=2 if query.element_size() == 4 else 3,
    )
