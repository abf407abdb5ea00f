"""Tensor-parallel linear layers.

Each layer owns `load_weight(param_name, loaded_weight, shard_id)`, which reads only this rank's slice of a
checkpoint tensor: `loaded_weight` may be a lazy safetensors slice, so a rank never holds the full tensor.

After loading, `pack_weights(use_cpu_kernels)` picks the layer's `linear_method` once (the kernel its matmuls run
on) and lays the weight out for it; `forward` calls `self.linear_method.apply(self, x, bias)`, with no per-call
checks of device, dtype or settings.

With LoRA enabled (`model_executor.lora`), a layer's `lora` adds the batch's adapter deltas to its output: column
layers before returning their slice, row layers to their partial sum before the all-reduce (their A is split by
input columns as the weight is, so the partial deltas sum to the whole one). `lora_slices` says where each of a
layer's projections lies in its output and in a checkpoint tensor, so adapters load the same slices the weights do.
"""

from __future__ import annotations

import functools
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from model_executor.cpu_features import cpu_has_amx_bf16
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
    """The weight reordered into oneDNN's blocked layout for CPU matmuls, or None where this torch build cannot.

    oneDNN's prepacked GEMM beats MKL's on this model's skinny shapes, and the reorder is paid once at load.
    """
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKING_BATCH_HINT)
    except (RuntimeError, AttributeError) as error:  # a torch build without it: plain F.linear
        logger.warning("oneDNN weight packing unavailable (%s); CPU linears use torch.nn.functional.linear", error)
        return None


@functools.cache
def onednn_packing_available(dtype: torch.dtype) -> bool:
    """Whether this torch build packs `dtype` weights for oneDNN (asked once per dtype, on a small weight)."""
    return torch.backends.mkldnn.is_available() and pack_weight_for_cpu(torch.zeros(8, 8, dtype=dtype)) is not None


class LinearMethod(ABC):
    """How a layer's matmul runs. Chosen once per layer by `select_linear_method`; the layer keeps the weights."""

    ops: ModuleType | None = None
    """Our C++ kernel module, where this method runs on it."""

    def process_weights_after_loading(self, layer: PackableWeight) -> None:  # noqa: B027 (most kernels need none)
        """Lay the loaded weight out for this kernel, on the layer beside the plain weight."""

    @abstractmethod
    def apply(self, layer: PackableWeight, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [tokens, in] -> [tokens, out] = x W^T (+ bias)."""


class UnquantizedLinearMethod(LinearMethod):
    """torch's matmul on the plain weight: CUDA, CPU with our kernels off, and every layer before packing."""

    def apply(self, layer: PackableWeight, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return nn.functional.linear(x, layer.weight, bias)


class OneDnnLinearMethod(LinearMethod):
    """oneDNN's prepacked GEMM (bf16 on CPU, or fp32 where our kernels cannot be built)."""

    def process_weights_after_loading(self, layer: PackableWeight) -> None:
        layer.packed_weight = pack_weight_for_cpu(layer.weight)

    def apply(self, layer: PackableWeight, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2:
            return nn.functional.linear(x, layer.weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, bias, "none", [], "")


class CpuPanelLinearMethod(LinearMethod):
    """Our C++ panel GEMM (`cuda_ext.cpu_ops` pack_panels / panel_linear) for fp32 on CPU: the weight is packed
    once into panels; it beats oneDNN's packed GEMM on this engine's shapes."""

    def __init__(self, ops: ModuleType):
        self.ops = ops

    def process_weights_after_loading(self, layer: PackableWeight) -> None:
        layer.panel_weight = self.ops.pack_panels(layer.weight.detach())

    def apply(self, layer: PackableWeight, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2:
            return nn.functional.linear(x, layer.weight, bias)
        out = torch.empty(x.shape[0], layer.weight.shape[0], dtype=x.dtype, device=x.device)
        self.ops.panel_linear(out, x if x.stride(-1) == 1 else x.contiguous(), layer.panel_weight)
        return out.add_(bias) if bias is not None else out


# Most tokens a call runs on our bf16 panels; larger calls go to oneDNN's packed bf16 GEMM. Measured with
# benchmarks/bench_bf16_gemm.py where the CPU has AMX (Intel Xeon from Sapphire Rapids on): there VDPBF16PS issues
# at a fraction of the FMA's rate and oneDNN's tile GEMM leads from about 8 tokens on, while below that its per-call
# cost dominates. With AVX512-BF16 alone (AMD Zen 4 and 5; not yet measured) ours takes decode batches and prefill
# chunks stay on the library.
BF16_PANEL_MAX_TOKENS_WITH_AMX = 4
BF16_PANEL_MAX_TOKENS = 64


class CpuBf16KernelLinearMethod(LinearMethod):
    """bf16 weights on CPU: one of our C++ kernels (bf16 products, fp32 sums, the bias added to the sums, one
    rounding to the output's dtype) for calls of up to `max_tokens` tokens, oneDNN's packed bf16 GEMM above that
    (where this torch build packs bf16; else ours at any count)."""

    def __init__(self, ops: ModuleType, max_tokens: int):
        self.ops = ops
        self.max_tokens = max_tokens
        self.onednn = OneDnnLinearMethod() if onednn_packing_available(torch.bfloat16) else None

    @abstractmethod
    def pack(self, layer: PackableWeight) -> None:
        """Lay the layer's weight out as the kernel reads it, on the layer."""

    @abstractmethod
    def run_kernel(self, layer: PackableWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """out = x W^T (+ bias) on the kernel, x 2-d with contiguous rows."""

    def process_weights_after_loading(self, layer: PackableWeight) -> None:
        self.pack(layer)
        if self.onednn is not None:
            self.onednn.process_weights_after_loading(layer)

    def apply(self, layer: PackableWeight, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2:
            return nn.functional.linear(x, layer.weight, bias)
        if self.onednn is not None and x.shape[0] > self.max_tokens and x.dtype == torch.bfloat16:
            return self.onednn.apply(layer, x, bias)
        return self.run_kernel(layer, x if x.stride(-1) == 1 else x.contiguous(), bias)


class CpuBf16PanelLinearMethod(CpuBf16KernelLinearMethod):
    """Our bf16 panel GEMM (`cuda_ext.cpu_ops` pack_bf16_panels / bf16_panel_linear, VDPBF16PS: AVX512-BF16)."""

    def pack(self, layer: PackableWeight) -> None:
        layer.bf16_panel_weight = self.ops.pack_bf16_panels(layer.weight.detach())

    def run_kernel(self, layer: PackableWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if bias is None:
            out = torch.empty(x.shape[0], layer.weight.shape[0], dtype=x.dtype, device=x.device)
            self.ops.bf16_panel_linear(out, x, layer.bf16_panel_weight)
            return out
        # The bias joins the fp32 sums, so a bf16 output is rounded once, as F.linear's is.
        sums = torch.empty(x.shape[0], layer.weight.shape[0], dtype=torch.float32, device=x.device)
        self.ops.bf16_panel_linear(sums, x, layer.bf16_panel_weight)
        return sums.add_(bias).to(x.dtype)


# Most tokens a call runs on our AMX kernel; larger calls (prefill chunks) go to oneDNN's packed bf16 GEMM, which
# blocks a large x better (benchmarks/bench_bf16_gemm.py: ours leads up to 64-128 tokens, level or behind beyond).
AMX_MAX_TOKENS = 128


class CpuAmxLinearMethod(CpuBf16KernelLinearMethod):
    """Our AMX tile GEMM (`cuda_ext.cpu_ops` pack_amx_weight / amx_linear, TDPBF16PS: Intel Xeon from Sapphire
    Rapids on)."""

    def __init__(self, ops: ModuleType, max_tokens: int = AMX_MAX_TOKENS):
        super().__init__(ops, max_tokens)

    def pack(self, layer: PackableWeight) -> None:
        layer.amx_weight = self.ops.pack_amx_weight(layer.weight.detach())

    def run_kernel(self, layer: PackableWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = torch.empty(x.shape[0], layer.weight.shape[0], dtype=x.dtype, device=x.device)
        self.ops.amx_linear(out, x, layer.amx_weight, bias if bias is None else bias.float())
        return out


UNQUANTIZED = UnquantizedLinearMethod()


def select_linear_method(weight: torch.Tensor, use_cpu_kernels: bool) -> LinearMethod:
    """The kernel for this weight: on CPU with `use_cpu_kernels`, fp32 on our panels (where they build), bf16 on our
    AMX tiles (where the CPU has them) or else our bf16 panels (AVX512-BF16) for small calls and oneDNN's for large
    ones, fp32 and bf16 on oneDNN's packed GEMM otherwise; torch's matmul everywhere else."""
    if not use_cpu_kernels or weight.device.type != "cpu":
        return UNQUANTIZED
    if weight.dtype in (torch.float32, torch.bfloat16):
        from cuda_ext.cpu_ops import load_cpu_ops

        ops = load_cpu_ops()
        if ops is not None and weight.dtype == torch.float32:
            return CpuPanelLinearMethod(ops)
        if ops is not None and getattr(ops, "has_amx", False) and ops.amx_usable():
            return CpuAmxLinearMethod(ops)
        if ops is not None and getattr(ops, "has_bf16_panels", False):
            max_tokens = BF16_PANEL_MAX_TOKENS_WITH_AMX if cpu_has_amx_bf16() else BF16_PANEL_MAX_TOKENS
            return CpuBf16PanelLinearMethod(ops, max_tokens)
    if weight.dtype in (torch.float32, torch.bfloat16) and onednn_packing_available(weight.dtype):
        return OneDnnLinearMethod()
    return UNQUANTIZED


@dataclass(frozen=True, slots=True)
class LoRASlice:
    """One projection of a linear layer, as a LoRA adapter's B matrix (its output rows) sees it on this rank."""

    offset: int
    """Its first column in this rank's output."""
    rows: int
    """Its columns in this rank's output (rows of this rank's B slice)."""
    source_start: int
    """This rank's first row in the projection's own checkpoint tensor."""
    fused_start: int
    """The projection's first row in a fused checkpoint tensor (Phi-3's qkv_proj, gate_up_proj)."""


class LoRAHook(ABC):
    """What a layer's `lora` does (model_executor.lora.LinearLoRA): add the step's adapter deltas to `out`."""

    @abstractmethod
    def apply(self, out: torch.Tensor, x: torch.Tensor) -> None: ...


class PackableWeight:
    """Mixin of the layers whose `weight` multiplies their input (the linears and the LM head). The plain weight
    stays after packing (the greedy screen, the C++ decoder stack and the GPU path read it)."""

    weight: nn.Parameter
    linear_method: LinearMethod = UNQUANTIZED
    packed_weight: torch.Tensor | None = None  # oneDNN's blocked layout (OneDnnLinearMethod)
    panel_weight: torch.Tensor | None = None  # our kernel's panels (CpuPanelLinearMethod)
    bf16_panel_weight: torch.Tensor | None = None  # our bf16 panels (CpuBf16PanelLinearMethod)
    amx_weight: torch.Tensor | None = None  # our AMX tiles (CpuAmxLinearMethod)

    def pack_weights(self, use_cpu_kernels: bool) -> None:
        """After loading: choose this layer's kernel once and lay the weight out for it."""
        self.linear_method = select_linear_method(self.weight, use_cpu_kernels)
        self.linear_method.process_weights_after_loading(self)


class ColumnParallelLinear(PackableWeight, nn.Module):
    """y = x W^T with W split by output rows; each rank returns its slice of y (no communication)."""

    def __init__(self, input_size: int, output_size: int, parallel: ParallelContext, bias: bool = False):
        super().__init__()
        self.parallel = parallel
        self.output_size_per_rank = divide(output_size, parallel.tp_size, "output size")
        self.weight = nn.Parameter(torch.empty(self.output_size_per_rank, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.output_size_per_rank), requires_grad=False) if bias else None
        self.lora: LoRAHook | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear_method.apply(self, x, self.bias)
        if self.lora is not None:
            self.lora.apply(out, x)
        return out

    def load_weight(self, param_name: str, loaded_weight: Any, shard_id: Any = None) -> None:
        param = getattr(self, param_name)
        rows = self.output_size_per_rank
        copy_into(param.data, read_rows(loaded_weight, self.parallel.tp_rank * rows, rows))

    def lora_slices(self) -> list[LoRASlice]:
        rows = self.output_size_per_rank
        return [LoRASlice(0, rows, self.parallel.tp_rank * rows, 0)]

    def lora_input_range(self) -> tuple[int, int] | None:
        """The input columns this rank's LoRA A reads: None, all of them (the input is not split)."""
        return None


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up of SwiGLU)."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], parallel: ParallelContext, bias: bool = False):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), parallel, bias)

    def load_weight(self, param_name: str, loaded_weight: Any, shard_id: Any = None) -> None:
        """shard_id i: the checkpoint tensor of projection i alone; "gate_up": all projections fused in one tensor
        (rows in `output_sizes` order, Phi-3's `gate_up_proj`), split here."""
        param = getattr(self, param_name)
        if shard_id == "gate_up":
            for index in range(len(self.output_sizes)):
                self._load_projection(param, index, loaded_weight, sum(self.output_sizes[:index]))
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"unknown merged shard {shard_id!r}")
        self._load_projection(param, shard_id, loaded_weight, 0)

    def _load_projection(self, param: torch.Tensor, index: int, loaded_weight: Any, first_row: int) -> None:
        """This rank's rows of projection `index`, which starts at row `first_row` of `loaded_weight`."""
        tp_size, tp_rank = self.parallel.tp_size, self.parallel.tp_rank
        rows = divide(self.output_sizes[index], tp_size, "merged output size")
        offset = sum(self.output_sizes[:index]) // tp_size
        copy_into(param.data[offset : offset + rows], read_rows(loaded_weight, first_row + tp_rank * rows, rows))

    def lora_slices(self) -> list[LoRASlice]:
        tp_size, tp_rank = self.parallel.tp_size, self.parallel.tp_rank
        slices = []
        for index, size in enumerate(self.output_sizes):
            rows = size // tp_size
            first = sum(self.output_sizes[:index])
            slices.append(LoRASlice(first // tp_size, rows, tp_rank * rows, first))
        return slices


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
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
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
        """shard_id "q", "k", "v": that projection's checkpoint tensor; "qkv": the three fused in one tensor (q
        rows, then k, then v, as Phi-3's `qkv_proj`), split here."""
        param = getattr(self, param_name)
        if shard_id == "qkv":
            q_rows, kv_rows = self.total_num_heads * self.head_dim, self.total_num_kv_heads * self.head_dim
            for part, first_row in (("q", 0), ("k", q_rows), ("v", q_rows + kv_rows)):
                self._load_projection(param, part, loaded_weight, first_row)
            return
        self._load_projection(param, shard_id, loaded_weight, 0)

    def _load_projection(self, param: torch.Tensor, shard_id: Any, loaded_weight: Any, first_row: int) -> None:
        """This rank's rows of projection `shard_id`, which starts at row `first_row` of `loaded_weight`."""
        if shard_id == "q":
            offset, rows, start = 0, self.q_size, self.parallel.tp_rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            rows, start = self.kv_size, self.kv_head_offset * self.head_dim
        else:
            raise ValueError(f"unknown qkv shard {shard_id!r}")
        copy_into(param.data[offset : offset + rows], read_rows(loaded_weight, first_row + start, rows))

    def lora_slices(self) -> list[LoRASlice]:
        q_rows, kv_rows = self.total_num_heads * self.head_dim, self.total_num_kv_heads * self.head_dim
        kv_start = self.kv_head_offset * self.head_dim
        return [
            LoRASlice(0, self.q_size, self.parallel.tp_rank * self.q_size, 0),
            LoRASlice(self.q_size, self.kv_size, kv_start, q_rows),
            LoRASlice(self.q_size + self.kv_size, self.kv_size, kv_start, q_rows + kv_rows),
        ]


class RowParallelLinear(PackableWeight, nn.Module):
    """y = x W^T with W split by input columns; partial sums are all-reduced, the bias added once after."""

    def __init__(self, input_size: int, output_size: int, parallel: ParallelContext, bias: bool = False):
        super().__init__()
        self.parallel = parallel
        self.input_size_per_rank = divide(input_size, parallel.tp_size, "input size")
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_rank), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        self.lora: LoRAHook | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.linear_method.apply(self, x)
        if self.lora is not None:
            self.lora.apply(partial, x)
        y = self.parallel.all_reduce(partial)
        return y + self.bias if self.bias is not None else y

    def lora_slices(self) -> list[LoRASlice]:
        rows = self.weight.shape[0]
        return [LoRASlice(0, rows, 0, 0)]

    def lora_input_range(self) -> tuple[int, int] | None:
        """This rank's input columns, which its LoRA A reads (A is split as the weight is)."""
        columns = self.input_size_per_rank
        return self.parallel.tp_rank * columns, columns

    def load_weight(self, param_name: str, loaded_weight: Any, shard_id: Any = None) -> None:
        param = getattr(self, param_name)
        if param_name == "bias":
            copy_into(param.data, loaded_weight[:])
            return
        columns = self.input_size_per_rank
        copy_into(param.data, read_columns(loaded_weight, self.parallel.tp_rank * columns, columns))
