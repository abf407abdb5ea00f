"""RMSNorm with the residual add fused in (one pass over the hidden states)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from model_executor.layers.linear import copy_into


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without a residual: norm(x). With one: (norm(x + residual), x + residual)."""
        if residual is not None:
            x = x + residual
            residual = x
        # Variance in fp32 whatever the activation dtype, as the reference implementation does.
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * normed.to(x.dtype)
        return out if residual is None else (out, residual)

    def load_weight(self, param_name: str, loaded_weight: Any, shard_id: Any = None) -> None:
        copy_into(self.weight.data, loaded_weight[:])
