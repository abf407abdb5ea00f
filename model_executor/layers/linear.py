"""Tensor-parallel linear layers.

Each layer owns `load_weight(param_name, loaded_weight, shard_id)`, which reads only this rank's slice of a
checkpoint tensor: `loaded_weight` may be a lazy safetensors slice, so a rank never holds the full tensor.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
from torch import nn

from model_executor.parallel_state import ParallelContext, divide

logger = logging.getLogger(__name__)

# oneDNN picks its blocked layout for a typical M.
PACKING_BATCH_HINT = 64


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


def pack_weight_for_cpu(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight reordered into oneDNN's blocked layout for CPU matmuls (bf16, or fp32 where our kernels cannot be
    built), or None where that path is off.

    oneDNN's prepacked GEMM beats MKL's on this model's skinny shapes (up to 2x at one token, 1.6x on the
    LM head at batch 64), and the reorder is paid once at load instead of on every call.
    """
    from cuda_ext.cpu_ops import DISABLE_ENV

    if (
        weight.device.type != "cpu"
        or weight.dtype not in (torch.float32, torch.bfloat16)
        or not torch.backends.mkldnn.is_available()
        or os.environ.get(DISABLE_ENV) == "1"
    ):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKING_BATCH_HINT)
    except (RuntimeError, AttributeError) as error:  # a torch build without it: plain F.linear
        logger.warning("oneDNN weight packing unavailable (%s); CPU linears use torch.nn.functional.linear", error)
        return None


def apply_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed_weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    linear_kernel_ops: ModuleType | None = None,
    panel_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    if panel_weight is not None and linear_kernel_ops is not None and x.dim() == 2:
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
        linear_kernel_ops.panel_linear(out, x if x.stride(-1) == 1 else x.contiguous(), panel_weight)
        return out.add_(bias) if bias is not None else out
    if packed_weight is not None and x.dim() == 2:
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
    return nn.functional.linear(x, weight, bias)


class PackableWeight:
    """Mixin: `pack_weights()` after loading lays the weight out for CPU matmuls: fp32 weights in our kernel's
    panels (`cuda_ext.cpu_ops` pack_panels; it beats oneDNN's packed GEMM at every row count measured), others in
    oneDNN's blocked layout. The plain weight stays (the greedy screen and the GPU path read it)."""

    packed_weight: torch.Tensor | None = None
    panel_weight: torch.Tensor | None = None
    linear_kernel_ops: ModuleType | None = None

    def pack_weights(self) -> None:
        from cuda_ext.cpu_ops import DISABLE_ENV, load_cpu_ops

        weight = self.weight
        if weight.device.type == "cpu" and weight.dtype == torch.float32 and os.environ.get(DISABLE_ENV) != "1":
            self.linear_kernel_ops = load_cpu_ops()
            if self.linear_kernel_ops is not None:
                self.panel_weight = self.linear_kernel_ops.pack_panels(weight.detach())
                return
        self.packed_weight = pack_weight_for_cpu(weight)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return apply_linear(x, self.weight, self.packed_weight, bias, self.linear_kernel_ops, self.panel_weight)


class ColumnParallelLinear(PackableWeight, nn.Module):
    """y = x W^T with W split by output rows; each rank returns its slice of y (no communication)."""

    def __init__(self, input_size: int, output_size: int, parallel: ParallelContext, bias: bool = False):
        super().__init__()
        self.parallel = parallel
        self.output_size_per_rank = divide(output_size, parallel.tp_size, "output size")
        self.weight = nn.Parameter(torch.empty(self.output_size_per_rank, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.output_size_per_rank), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)

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


class RowParallelLinear(PackableWeight, nn.Module):
    """y = x W^T with W split by input columns; partial sums are all-reduced, the bias added once after."""

    def __init__(self, input_size: int, output_size: int, parallel: ParallelContext, bias: bool = False):
        super().__init__()
        self.parallel = parallel
        self.input_size_per_rank = divide(input_size, parallel.tp_size, "input size")
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_rank), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.parallel.all_reduce(self.project(x))
        return y + self.bias if self.bias is not None else y

    def load_weight(self, param_name: str, loaded_weight: Any, shard_id: Any = None) -> None:
        param = getattr(self, param_name)
        if param_name == "bias":
            copy_into(param.data, loaded_weight[:])
            return
        columns = self.input_size_per_rank
        copy_into(param.data, read_columns(loaded_weight, self.parallel.tp_rank * columns, columns))
