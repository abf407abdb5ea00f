"""RMSNorm with the residual add fused in (one C++ pass over the hidden states on CPU, one Triton kernel on CUDA)."""

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
