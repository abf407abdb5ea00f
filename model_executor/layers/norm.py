"""RMSNorm with the residual add fused in (one C++ pass over the hidden states on CPU, one Triton kernel on CUDA), and
Gemma's zero-centred variant."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cuda_ext.fused_ops import fused_add_rms_norm, rms_norm
from model_executor.layers.linear import copy_into


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without a residual: norm(x). With one: (norm(x + residual), x + residual), which may reuse the
        memory of x and residual (callers pass tensors they no longer need)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)

    def load_weight(self, param_name: str, loaded_weight: Any, shard_id: Any = None) -> None:
        copy_into(self.weight.data, loaded_weight[:])


def gemma_rms_norm_reference(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Gemma rounding: normalise and scale in fp32, one cast to x's dtype at the end."""
    x_fp32 = x.float()
    normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * scale).to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: `norm(x) * (1 + weight)` with the checkpoint's zero-centred `weight`, computed in fp32 and
    cast once (transformers' `Gemma2RMSNorm`). Same calls as `RMSNorm`: `norm(x)`, `norm(x, residual)`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        # 1 + weight in fp32, refreshed whenever the weight loads: the kernels take a plain multiplier.
        self.register_buffer("scale", torch.ones(hidden_size, dtype=torch.float32), persistent=False)

    def update_scale(self) -> None:
        """Recompute `scale` from `weight` (after loading, or after writing `weight` directly)."""
        self.scale.copy_(1.0 + self.weight.float())

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As `RMSNorm.forward`; the residual sum is taken in x's dtype, as transformers adds before the norm."""
        # A module cast with .to(dtype) casts the buffer too: (1 + w) must stay fp32 then, as transformers keeps it.
        scale = self.scale if self.scale.dtype == torch.float32 else 1.0 + self.weight.float()
        if x.dtype == torch.float32:
            # fp32: the RMSNorm kernels with weight (1 + w) are this exact math.
            if residual is None:
                return rms_norm(x, scale, self.eps)
            return fused_add_rms_norm(x, residual, scale, self.eps)
        if residual is None:
            return gemma_rms_norm_reference(x, scale, self.eps)
        summed = x + residual
        return gemma_rms_norm_reference(summed, scale, self.eps), summed

    def load_weight(self, param_name: str, loaded_weight: Any, shard_id: Any = None) -> None:
        copy_into(self.weight.data, loaded_weight[:])
        self.update_scale()
