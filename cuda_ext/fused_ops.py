"""Per-layer fused ops: our C++ kernels on CPU tensors where they built, our Triton kernels on CUDA tensors, the
torch reference otherwise (CPU without a compiler). The model calls these, never the kernels directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cuda_ext.cpu_ops import load_cpu_ops


def _cpu_ops(tensor: torch.Tensor):
    return load_cpu_ops() if tensor.device.type == "cpu" else None


def _triton_ops(tensor: torch.Tensor):
    if tensor.device.type != "cuda":
        return None
    # Imported on first CUDA use: CPU-only runs never import triton.
    from cuda_ext.kernels import fused_elementwise

    return fused_elementwise


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Variance in fp32 whatever the activation dtype, as the reference implementation does.
    x_fp32 = x.float()
    normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * RMSNorm(x) over the last dim."""
    kernels = _triton_ops(x)
    if kernels is not None and x.dim() == 2 and x.stride(-1) == 1:
        return kernels.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual). The C++ and Triton paths reuse both inputs' memory for the outputs."""
    ops = _cpu_ops(x)
    if ops is not None and x.dim() == 2 and x.stride(-1) == 1 and residual.stride(-1) == 1:
        ops.fused_add_rms_norm(x, residual, weight, eps)
        return x, residual
    kernels = _triton_ops(x)
    same_layout = x.dim() == 2 and x.stride(-1) == 1 and residual.stride(-1) == 1 and x.shape == residual.shape
    if kernels is not None and same_layout and torch.promote_types(weight.dtype, x.dtype) == x.dtype == residual.dtype:
        return kernels.rms_norm(x, weight, eps, residual), residual
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed


def rotary_reference(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> None:
    for x in (query, key):
        x1, x2 = x[..., :half], x[..., half:]
        x1_float, x2_float = x1.float(), x2.float()
        rotated_first = x1_float * cos - x2_float * sin
        rotated_second = x2_float * cos + x1_float * sin
        x1.copy_(rotated_first)
        x2.copy_(rotated_second)


def apply_rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """query [tokens, heads, head_dim] and key [tokens, kv_heads, head_dim] (rows may be strided), in place;
    cos/sin [tokens, 1, head_dim / 2] fp32."""
    ops = _cpu_ops(query)
    if ops is not None and query.stride(-1) == 1 and key.stride(-1) == 1:
        ops.rotary_embedding(query, key, cos, sin)
        return
    kernels = _triton_ops(query)
    if kernels is not None and query.stride(-1) == 1 and key.stride(-1) == 1 and cos.stride(-1) == sin.stride(-1) == 1:
        kernels.apply_rotary(query, key, cos, sin)
        return
    rotary_reference(query, key, cos, sin, query.shape[-1] // 2)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate_up[:, :half]) * gate_up[:, half:]."""
    half = gate_up.shape[-1] // 2
    ops = _cpu_ops(gate_up)
    if ops is not None and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        out = torch.empty(gate_up.shape[0], half, dtype=gate_up.dtype)
        ops.silu_and_mul(out, gate_up)
        return out
    kernels = _triton_ops(gate_up)
    if kernels is not None and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        return kernels.silu_and_mul(gate_up)
    return F.silu(gate_up[:, :half]) * gate_up[:, half:]


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate_up[..., :half]) * gate_up[..., half:]: GeGLU as Gemma's `gelu_pytorch_tanh` MLP computes it
    (transformers' `GELUTanh` is `F.gelu(approximate="tanh")`). torch's ops on every device for now."""
    half = gate_up.shape[-1] // 2
    # Contiguous as transformers' gate_proj output: torch's CPU gelu rounds a strided row's tail differently.
    return F.gelu(gate_up[..., :half].contiguous(), approximate="tanh") * gate_up[..., half:]
