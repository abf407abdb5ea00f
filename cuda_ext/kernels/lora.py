"""Triton kernels for batched LoRA (punica-style "shrink" and "expand"): rows of one batch use different adapters.

Rows are grouped by adapter slot on the device (`sort_rows_by_slot`): `sorted_rows` lists the rows of slot 0, then
slot 1, ... (rows without an adapter last), and `slot_starts`/`slot_counts` say where each slot's rows are. Both
kernels run a grid with one axis over slots and one over row tiles sized for the whole batch; a program whose tile
lies past its slot's row count returns at once. No step needs the host to read a count, so a launch is safe inside
a CUDA graph capture (the grid depends on the row count only).

- shrink: buffer[row, :R] = scaling[slot] * x[row, :] @ A[slot]^T, fp32, one program per (row tile, slot), looping
  over K in BLOCK_K tiles.
- expand: out[row, n] += buffer[row, :] @ B[slot][n, :]^T, one program per (N tile, row tile, slot). Each row
  belongs to one slot, so every output element has one writer (no atomics).

Rank R is padded to a power of two >= 16 (tl.dot's smallest operand); padded ranks are masked to zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Smallest tl.dot operand size on NVIDIA tensor cores.
MIN_DOT_SIZE = 16
# Kernels are decorated for the interpreter or for the GPU once, at import: TRITON_INTERPRET=1 must be set before.
INTERPRETED = bool(triton.knobs.runtime.interpret)


def rank_pad(rank: int) -> int:
    return max(MIN_DOT_SIZE, triton.next_power_of_2(rank))


def row_block(num_rows: int) -> int:
    """Rows per program: a small tile for decode-sized batches, a larger one for prefill."""
    return 16 if num_rows <= 16 else 64


# Each kernel's compile-time constants and launch options: the launches below and offline_compile use these.
def shrink_launch(rank: int, num_rows: int, dtype: torch.dtype) -> tuple[dict, dict]:
    dot_fp32 = dtype == torch.float32 or INTERPRETED
    constexprs = {
        "RANK_PAD": rank_pad(rank),
        "BLOCK_M": row_block(num_rows),
        "BLOCK_K": 64 if dot_fp32 else 128,
        "DOT_FP32": dot_fp32,
        "DOT_PRECISION": "ieee" if dot_fp32 else "tf32",
    }
    return constexprs, {"num_warps": 4, "num_stages": 2 if dot_fp32 else 3}


def expand_launch(rank: int, num_rows: int, dtype: torch.dtype) -> tuple[dict, dict]:
    dot_fp32 = dtype == torch.float32 or INTERPRETED
    constexprs = {
        "RANK_PAD": rank_pad(rank),
        "BLOCK_M": row_block(num_rows),
        "BLOCK_N": 64 if dot_fp32 else 128,
        "DOT_FP32": dot_fp32,
        "DOT_PRECISION": "ieee" if dot_fp32 else "tf32",
    }
    return constexprs, {"num_warps": 4, "num_stages": 2}


@triton.jit
def _slot_rows(sorted_rows_ptr, slot_starts_ptr, slot_counts_ptr, slot, row_tile, BLOCK_M: tl.constexpr):
    """(rows of this tile as int64, which of them are real, whether the tile holds any row)."""
    count = tl.load(slot_counts_ptr + slot)
    start = tl.load(slot_starts_ptr + slot)
    positions = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = positions < count
    rows = tl.load(sorted_rows_ptr + start + positions, mask=row_valid, other=0).to(tl.int64)
    return rows, row_valid, row_tile * BLOCK_M < count


@triton.jit
def lora_shrink_kernel(
    x_ptr,
    lora_a_ptr,
    buffer_ptr,
    scalings_ptr,
    sorted_rows_ptr,
    slot_starts_ptr,
    slot_counts_ptr,
    hidden,
    rank,
    stride_xt,
    stride_xk,
    stride_al,
    stride_ar,
    stride_ak,
    stride_buffer,
    RANK_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (row tiles, slots): buffer[rows, :rank] = scaling * x[rows] @ A[slot]^T in fp32."""
    row_tile = tl.program_id(0)
    slot = tl.program_id(1)
    rows, row_valid, has_rows = _slot_rows(sorted_rows_ptr, slot_starts_ptr, slot_counts_ptr, slot, row_tile, BLOCK_M)
    if has_rows:
        ranks = tl.arange(0, RANK_PAD)
        rank_valid = ranks < rank
        a_base = lora_a_ptr + slot.to(tl.int64) * stride_al + ranks[None, :] * stride_ar
        acc = tl.zeros([BLOCK_M, RANK_PAD], dtype=tl.float32)
        for k_start in range(0, hidden, BLOCK_K):
            ks = k_start + tl.arange(0, BLOCK_K)
            k_valid = ks < hidden
            x_tile = tl.load(
                x_ptr + rows[:, None] * stride_xt + ks[None, :] * stride_xk,
                mask=row_valid[:, None] & k_valid[None, :],
                other=0.0,
            )
            # A^T tile [BLOCK_K, RANK_PAD]: padded ranks load as zeros.
            a_tile = tl.load(a_base + ks[:, None] * stride_ak, mask=k_valid[:, None] & rank_valid[None, :], other=0.0)
            if DOT_FP32:
                x_tile = x_tile.to(tl.float32)
                a_tile = a_tile.to(tl.float32)
            else:
                a_tile = a_tile.to(x_tile.dtype)
            acc += tl.dot(x_tile, a_tile, input_precision=DOT_PRECISION)
        acc = acc * tl.load(scalings_ptr + slot).to(tl.float32)
        tl.store(
            buffer_ptr + rows[:, None] * stride_buffer + ranks[None, :],
            acc,
            mask=row_valid[:, None] & rank_valid[None, :],
        )


@triton.jit
def lora_expand_kernel(
    buffer_ptr,
    lora_b_ptr,
    out_ptr,
    sorted_rows_ptr,
    slot_starts_ptr,
    slot_counts_ptr,
    out_features,
    rank,
    stride_buffer,
    stride_bl,
    stride_bn,
    stride_br,
    stride_ot,
    stride_on,
    RANK_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (N tiles, row tiles, slots): out[rows, n tile] += buffer[rows] @ B[slot][n tile]^T."""
    n_tile = tl.program_id(0)
    row_tile = tl.program_id(1)
    slot = tl.program_id(2)
    rows, row_valid, has_rows = _slot_rows(sorted_rows_ptr, slot_starts_ptr, slot_counts_ptr, slot, row_tile, BLOCK_M)
    if has_rows:
        ranks = tl.arange(0, RANK_PAD)
        rank_valid = ranks < rank
        ns = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_valid = ns < out_features
        shrunk = tl.load(
            buffer_ptr + rows[:, None] * stride_buffer + ranks[None, :],
            mask=row_valid[:, None] & rank_valid[None, :],
            other=0.0,
        )
        # The low-rank activation is rounded to the activation dtype, as a bf16/fp16 model's LoRA A output is.
        shrunk = shrunk.to(out_ptr.dtype.element_ty)
        # B^T tile [RANK_PAD, BLOCK_N].
        b_tile = tl.load(
            lora_b_ptr + slot.to(tl.int64) * stride_bl + ns[None, :] * stride_bn + ranks[:, None] * stride_br,
            mask=rank_valid[:, None] & n_valid[None, :],
            other=0.0,
        )
        if DOT_FP32:
            shrunk = shrunk.to(tl.float32)
            b_tile = b_tile.to(tl.float32)
        else:
            b_tile = b_tile.to(shrunk.dtype)
        delta = tl.dot(shrunk, b_tile, input_precision=DOT_PRECISION)
        out_mask = row_valid[:, None] & n_valid[None, :]
        out_ptrs = out_ptr + rows[:, None] * stride_ot + ns[None, :] * stride_on
        base = tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, (base + delta).to(out_ptr.dtype.element_ty), mask=out_mask)


def sort_rows_by_slot(row_slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_rows, slot_starts, slot_counts) as int32 tensors on row_slots' device, without a host sync.

    sorted_rows [T]: row indices ordered by slot (stable), rows with slot -1 last; slot_starts/slot_counts [L].
    """
    device = row_slots.device
    # Rows without an adapter sort after every slot.
    keys = torch.where(row_slots < 0, num_slots, row_slots).to(torch.int64)
    sorted_rows = torch.sort(keys, stable=True).indices.to(torch.int32)
    # scatter_add rather than bincount: CUDA bincount reads the maximum back to the host.
    counts = torch.zeros(num_slots + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(0, keys, torch.ones_like(keys, dtype=torch.int32))
    starts = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    return sorted_rows, starts[:num_slots].contiguous(), counts[:num_slots].contiguous()


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    scalings: torch.Tensor,
    sorted_rows: torch.Tensor,
    slot_starts: torch.Tensor,
    slot_counts: torch.Tensor,
) -> torch.Tensor:
    """[T, R] fp32: scaling[slot] * x[row] @ lora_a[slot]^T for every row in a slot (other rows undefined)."""
    num_rows, hidden = x.shape
    num_slots, rank, _ = lora_a.shape
    buffer = torch.empty(num_rows, rank, dtype=torch.float32, device=x.device)
    if num_rows == 0 or num_slots == 0:
        return buffer
    constexprs, options = shrink_launch(rank, num_rows, x.dtype)
    grid = (triton.cdiv(num_rows, constexprs["BLOCK_M"]), num_slots)
    lora_shrink_kernel[grid](
        x,
        lora_a,
        buffer,
        scalings,
        sorted_rows,
        slot_starts,
        slot_counts,
        hidden,
        rank,
        x.stride(0),
        x.stride(1),
        lora_a.stride(0),
        lora_a.stride(1),
        lora_a.stride(2),
        buffer.stride(0),
        **constexprs,
        **options,
    )
    return buffer


def lora_expand(
    out: torch.Tensor,
    buffer: torch.Tensor,
    lora_b: torch.Tensor,
    sorted_rows: torch.Tensor,
    slot_starts: torch.Tensor,
    slot_counts: torch.Tensor,
) -> None:
    """out[row] += buffer[row] @ lora_b[slot]^T in place, for rows in a slot; out may be a column slice (view)."""
    num_rows, out_features = out.shape
    num_slots, _, rank = lora_b.shape
    if num_rows == 0 or num_slots == 0:
        return
    constexprs, options = expand_launch(rank, num_rows, out.dtype)
    grid = (triton.cdiv(out_features, constexprs["BLOCK_N"]), triton.cdiv(num_rows, constexprs["BLOCK_M"]), num_slots)
    lora_expand_kernel[grid](
        buffer,
        lora_b,
        out,
        sorted_rows,
        slot_starts,
        slot_counts,
        out_features,
        rank,
        buffer.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        lora_b.stride(2),
        out.stride(0),
        out.stride(1),
        **constexprs,
        **options,
    )
