"""Triton kernels for a layer's elementwise work on CUDA: RMSNorm (with the residual add), rotary, SiLU-and-mul.

The torch compositions they replace launch 8-20 small kernels each (casts, pow, mean, rsqrt, slices): in a
one-stream decode step on an H200 those launches, not the matmuls, were most of the GPU time. Each op here is one
launch, with fp32 math and the torch reference's roundings (the sum of a residual add and each SiLU are rounded to
the activation dtype before they are used, as the reference rounds them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 256))


# Each kernel's compile-time constants and warps for a layer shape: the launches below and offline_compile use these.
def rms_norm_launch(hidden: int, has_residual: bool) -> tuple[dict, int]:
    block = triton.next_power_of_2(hidden)
    return {"HAS_RESIDUAL": has_residual, "BLOCK": block}, _num_warps(block)


def silu_and_mul_launch(half: int) -> tuple[dict, int]:
    block = min(1024, triton.next_power_of_2(half))
    return {"BLOCK": block}, _num_warps(block)


def rotary_launch(num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[dict, int]:
    constexprs = {
        "Q_HEADS_PAD": triton.next_power_of_2(num_heads),
        "K_HEADS_PAD": triton.next_power_of_2(num_kv_heads),
        "HALF_PAD": triton.next_power_of_2(head_dim // 2),
    }
    return constexprs, 4


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + residual).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_residual + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / hidden
    normed = (x * tl.math.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * RMSNorm(x) over the last dim of a 2-D x (rows may be strided). With `residual`: the norm of
    x + residual, whose sum is written into `residual`, and the norm into `x` (returned)."""
    rows, hidden = x.shape
    if residual is None:
        out = torch.empty(rows, hidden, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    else:
        out = x
    if rows == 0:
        return out
    constexprs, num_warps = rms_norm_launch(hidden, residual is not None)
    _rms_norm_kernel[(rows,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        hidden,
        eps,
        **constexprs,
        num_warps=num_warps,
    )
    return out


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, half, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < half
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + half + cols, mask=mask, other=0.0).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (activated * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate_up[:, :half]) * gate_up[:, half:] for a 2-D gate_up."""
    rows, width = gate_up.shape
    half = width // 2
    out = torch.empty(rows, half, dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    constexprs, num_warps = silu_and_mul_launch(half)
    _silu_and_mul_kernel[(rows, triton.cdiv(half, constexprs["BLOCK"]))](
        gate_up, out, gate_up.stride(0), out.stride(0), half, **constexprs, num_warps=num_warps
    )
    return out


@triton.jit
def _rotate_heads(x_ptr, token, stride_t, stride_h, num_heads, half, cos, sin, d, d_mask, HEADS_PAD: tl.constexpr):
    heads = tl.arange(0, HEADS_PAD)
    mask = (heads[:, None] < num_heads) & d_mask[None, :]
    first = x_ptr + token * stride_t + heads[:, None] * stride_h + d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos[None, :] - x2 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + half, (x2 * cos[None, :] + x1 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    query_ptr,
    key_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    num_heads,
    num_kv_heads,
    half,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    d_mask = d < half
    cos = tl.load(cos_ptr + token * stride_cos + d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_sin + d, mask=d_mask, other=0.0).to(tl.float32)
    _rotate_heads(query_ptr, token, stride_qt, stride_qh, num_heads, half, cos, sin, d, d_mask, Q_HEADS_PAD)
    _rotate_heads(key_ptr, token, stride_kt, stride_kh, num_kv_heads, half, cos, sin, d, d_mask, K_HEADS_PAD)


def apply_rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate query [tokens, heads, head_dim] and key [tokens, kv_heads, head_dim] in place (rotate-half layout);
    cos/sin [tokens, 1, head_dim / 2]. Rows and heads may be strided; head_dim must be contiguous."""
    tokens, num_heads, head_dim = query.shape
    if tokens == 0:
        return
    constexprs, num_warps = rotary_launch(num_heads, key.shape[1], head_dim)
    _rotary_kernel[(tokens,)](
        query,
        key,
        cos,
        sin,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos.stride(0),
        sin.stride(0),
        num_heads,
        key.shape[1],
        head_dim // 2,
        **constexprs,
        num_warps=num_warps,
    )
