"""Compile the kernels for an NVIDIA target without a GPU, with the ptxas bundled in the triton wheel.

The interpreter checks what the kernels compute, not whether the GPU compiler accepts them (tl.dot shapes and
dtypes, layouts, shared memory). This runs the real pipeline (TTIR, TTGIR, LLVM IR, PTX, cubin) for a layer
shape and reports each kernel's static shared memory, so a machine with no GPU can still catch compile errors:

    python -m cuda_ext.kernels.offline_compile [--arch 90] [--quick]

It needs compiled (not interpreted) kernels: run it without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from cuda_ext.kernels import fused_elementwise, lora
from cuda_ext.kernels.reshape_and_cache import reshape_and_cache_kernel
from cuda_ext.kernels.unified_attention import INTERPRETED, make_tile_config, unified_attention_kernel

logger = logging.getLogger(__name__)

ATTENTION_DATA_POINTERS = ("query_ptr", "key_cache_ptr", "value_cache_ptr", "out_ptr")
CACHE_DATA_POINTERS = ("key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr")


@dataclass(frozen=True, slots=True)
class LayerShape:
    dtype: str  # triton type name: bf16, fp16, fp32
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    sliding_window: int = 0
    soft_cap: float = 0.0  # Gemma 2's attention logit soft-capping (0 = off)


# (small shapes first: the tiny test model, a GQA-3 layer with a window; then Llama-3-8B-like layers)
QUICK_SHAPES = [LayerShape("bf16", 4, 2, 16, 16), LayerShape("fp16", 6, 2, 64, 32, 64)]
FULL_SHAPES = [
    *QUICK_SHAPES,
    LayerShape("bf16", 32, 8, 128, 16),
    LayerShape("bf16", 32, 8, 128, 32, 4096),
    LayerShape("fp32", 32, 8, 128, 16),
    LayerShape("bf16", 64, 8, 128, 16),
    LayerShape("bf16", 8, 4, 256, 16, 4096, 50.0),
]


def _signature(kernel: triton.JITFunction, constexprs: dict, pointers: dict[str, str], floats: tuple[str, ...]) -> dict:
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        elif name in floats:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    return signature


def compile_unified_attention(shape: LayerShape, arch: int = 90) -> triton.compiler.CompiledKernel:
    """The unified attention kernel as `unified_attention` would launch it for this layer shape."""
    config = make_tile_config(shape.num_heads, shape.num_kv_heads, shape.head_dim)
    dot_fp32 = shape.dtype == "fp32"
    constexprs = {
        "NUM_QUERIES_PER_KV": config.num_queries_per_kv,
        "GROUP_PAD": config.group_pad,
        "HEAD_DIM": config.head_dim,
        "HEAD_DIM_PAD": config.head_dim_pad,
        "BLOCK_SIZE": shape.block_size,
        "SLIDING_WINDOW": shape.sliding_window,
        # The kernel takes the cap in log2 units, as it does the scale.
        "SOFTCAP": shape.soft_cap * math.log2(math.e),
        "DOT_FP32": dot_fp32,
        "DOT_PRECISION": "ieee" if dot_fp32 else "tf32",
        "SMALL_BLOCK_M": config.small_block_m,
        "SMALL_TILE_N": config.small_tile_n,
        "LARGE_BLOCK_M": config.large_block_m,
        "LARGE_TILE_N": config.large_tile_n,
    }
    pointers = {name: "*i32" for name in unified_attention_kernel.arg_names if name.endswith("_ptr")}
    pointers |= {name: f"*{shape.dtype}" for name in ATTENTION_DATA_POINTERS}
    signature = _signature(unified_attention_kernel, constexprs, pointers, ("scale_log2",))
    options = {"num_warps": 4, "num_stages": 2 if dot_fp32 else 3}
    source = ASTSource(unified_attention_kernel, signature, constexprs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def compile_reshape_and_cache(shape: LayerShape, arch: int = 90) -> triton.compiler.CompiledKernel:
    constexprs = {
        "NUM_KV_HEADS": shape.num_kv_heads,
        "HEAD_DIM": shape.head_dim,
        "KV_HEADS_PAD": triton.next_power_of_2(shape.num_kv_heads),
        "HEAD_DIM_PAD": triton.next_power_of_2(shape.head_dim),
        "BLOCK_SIZE": shape.block_size,
    }
    pointers = {name: f"*{shape.dtype}" for name in CACHE_DATA_POINTERS} | {"slot_mapping_ptr": "*i32"}
    signature = _signature(reshape_and_cache_kernel, constexprs, pointers, ())
    source = ASTSource(reshape_and_cache_kernel, signature, constexprs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})


def compile_fused_elementwise(shape: LayerShape, arch: int = 90) -> list[triton.compiler.CompiledKernel]:
    """RMSNorm (alone and with the residual add), SiLU-and-mul and rotary as `fused_elementwise` launches them for a
    layer of hidden size num_heads * head_dim (MLP width four times that)."""
    hidden = shape.num_heads * shape.head_dim
    launches = [
        (fused_elementwise._rms_norm_kernel, fused_elementwise.rms_norm_launch(hidden, False), {}),
        (fused_elementwise._rms_norm_kernel, fused_elementwise.rms_norm_launch(hidden, True), {}),
        (fused_elementwise._silu_and_mul_kernel, fused_elementwise.silu_and_mul_launch(4 * hidden), {}),
        (
            fused_elementwise._rotary_kernel,
            fused_elementwise.rotary_launch(shape.num_heads, shape.num_kv_heads, shape.head_dim),
            {"cos_ptr": "*fp32", "sin_ptr": "*fp32"},
        ),
    ]
    compiled = []
    for kernel, (constexprs, num_warps), pointer_types in launches:
        pointers = {name: f"*{shape.dtype}" for name in kernel.arg_names if name.endswith("_ptr")} | pointer_types
        signature = _signature(kernel, constexprs, pointers, ("eps",))
        source = ASTSource(kernel, signature, constexprs)
        compiled.append(triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps}))
    return compiled


# (rank, batch rows) of the LoRA launches: a decode-sized batch at a small rank, a prefill-sized one at rank 64.
LORA_LAUNCHES = ((16, 1), (64, 4096))


def compile_lora(shape: LayerShape, arch: int = 90) -> list[triton.compiler.CompiledKernel]:
    """The LoRA shrink and expand kernels as `cuda_ext.lora_ops` launches them for a layer of hidden size
    num_heads * head_dim, at each of LORA_LAUNCHES."""
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[shape.dtype]
    index_pointers = {name: "*i32" for name in ("sorted_rows_ptr", "slot_starts_ptr", "slot_counts_ptr")}
    kernels = [
        (lora.lora_shrink_kernel, lora.shrink_launch, ("x_ptr", "lora_a_ptr"), ("buffer_ptr", "scalings_ptr")),
        (lora.lora_expand_kernel, lora.expand_launch, ("lora_b_ptr", "out_ptr"), ("buffer_ptr",)),
    ]
    compiled = []
    for rank, num_rows in LORA_LAUNCHES:
        for kernel, launch, data_pointers, fp32_pointers in kernels:
            constexprs, options = launch(rank, num_rows, torch_dtype)
            pointers = index_pointers | {name: f"*{shape.dtype}" for name in data_pointers}
            pointers |= {name: "*fp32" for name in fp32_pointers}
            signature = _signature(kernel, constexprs, pointers, ())
            source = ASTSource(kernel, signature, constexprs)
            compiled.append(triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options))
    return compiled


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80 (A100) or 90 (H100)")
    parser.add_argument("--quick", action="store_true", help="only the small shapes (a few seconds each)")
    args = parser.parse_args(argv)
    if INTERPRETED:
        print("TRITON_INTERPRET=1 is set: unset it to compile the kernels", file=sys.stderr)
        return 2
    for shape in QUICK_SHAPES if args.quick else FULL_SHAPES:
        start = time.perf_counter()
        attention = compile_unified_attention(shape, args.arch)
        cache_write = compile_reshape_and_cache(shape, args.arch)
        elementwise = compile_fused_elementwise(shape, args.arch)
        lora_kernels = compile_lora(shape, args.arch)
        print(
            f"sm_{args.arch} {shape}: attention shared {attention.metadata.shared} B, "
            f"cache write shared {cache_write.metadata.shared} B, {len(elementwise)} elementwise kernels, "
            f"{len(lora_kernels)} lora kernels (largest shared {max(k.metadata.shared for k in lora_kernels)} B) "
            f"({time.perf_counter() - start:.1f} s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
