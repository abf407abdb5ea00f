"""Tensor-parallel linear layers.

Each layer owns `load_weight(param_name, loaded_weight, shard_id)`, which reads only this rank's slice of a
checkpoint tensor: `loaded_weight` may be a lazy safetensors slice, so a rank never holds the full tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from model_executor.parallel_state import ParallelContext, divide


def read_rows(loaded_weight: Any, start: int, size: int) -> torch.Tensor:
    """Rows [start, start + size) of a tensor or a lazy safetensors slice."""
    return loaded_weight[start : start + size]


def read_columns(loaded_weight: Any, start: int, size: int) -> torch.Tensor:
    """Columns [start, start + size) of a 2-D tensor or a lazy safetensors slice."""
    return loaded_weight[:, start : start + size]


def copy_into(param: torch.Tensor, shard: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(shard.shape):
        raise ValueError(f"checkpoint shard of shape {tuple(shard.shape)} does not fit parameter {tuple(param.shape)}")
    param.copy_(shard)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split by output rows; each rank returns its slice of y (no communication)."""

    def __init__(self, input_size: int, output_size: int, parallel: ParallelContext, bias: bool = False):
        super().__init__()
        self.parallel = parallel
        self.output_size_per_rank = divide(output_size, parallel.tp_size, "output size")
        self.weight = nn.Parameter(torch.empty(self.output_size_per_rank, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.output_size_per_rank), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)

    def load_weight(self, param_name: str, loaded_weight: Any, shard_id: Any = None) -> None:
        param = getattr(self, param_name)
        rows = self.output_size_per_rank
        copy_into(param.data, read_rows(loaded_weight, self.parallel.tp_rank * rows, rows))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up of SwiGLU)."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], parallel: ParallelContext, bias: bool = False):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), parallel, bias)

    def load_weight(self, param_name: str, loaded_weight: Any, shard_id: Any = None) -> None:
        param = getattr(self, param_name)
        tp_size, tp_rank = self.parallel.tp_size, self.parallel.tp_rank
        rows = divide(self.output_sizes[shard_id], tp_size, "merged output size")
        offset = sum(self.output_sizes[:shard_id]) // tp_size
        copy_into(param.data[offset : offset + rows], read_rows(loaded_weight, tp_rank * rows, rows))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection split by heads; KV heads are replicated when ranks outnumber them."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        parallel: ParallelContext,
        bias: bool = False,
    ):
        tp_size = parallel.tp_size
        self.head_dim = head_dim
        self.num_heads_per_rank = divide(num_heads, tp_size, "number of attention heads")
        if tp_size >= num_kv_heads:
            divide(tp_size, num_kv_heads, "tensor-parallel size vs KV heads")
            self.num_kv_heads_per_rank = 1
            self.kv_head_offset = parallel.tp_rank * num_kv_heads // tp_size
        else:
            self.num_kv_heads_per_rank = divide(num_kv_heads, tp_size, "number of KV heads")
            self.kv_head_offset = parallel.tp_rank * self.num_kv_heads_per_rank
        self.q_size = self.num_heads_per_rank * head_dim
        self.kv_size = self.num_kv_heads_per_rank * head_dim
        output_per_rank = self.q_size + 2 * self.kv_size
        super().__init__(hidden_size, output_per_rank * tp_size, parallel, bias)

    def load_weight(self, param_name: str, loaded_weight: Any, shard_id: Any = None) -> None:
        param = getattr(self, param_name)
        if shard_id == "q":
            offset, rows, start = 0, self.q_size, self.parallel.tp_rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            rows, start = self.kv_size, self.kv_head_offset * self.head_dim
        else:
            raise ValueError(f"unknown qkv shard {shard_id!r}")
        copy_into(param.data[offset : offset + rows], read_rows(loaded_weight, start, rows))


class RowParallelLinear(nn.Module):
    """y = x W^T with W split by input columns; partial sums are all-reduced, the bias added once after."""

    def __init__(self, input_size: int, output_size: int, parallel: ParallelContext, bias: bool = False):
        super().__init__()
        self.parallel = parallel
        self.input_size_per_rank = divide(input_size, parallel.tp_size, "input size")
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_rank), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.parallel.all_reduce(nn.functional.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y

    def load_weight(self, param_name: str, loaded_weight: Any, shard_id: Any = None) -> None:
        param = getattr(self, param_name)
        if param_name == "bias":
            copy_into(param.data, loaded_weight[:])
            return
        columns = self.input_size_per_rank
        copy_into(param.data, read_columns(loaded_weight, self.parallel.tp_rank * columns, columns))
