"""Picks the attention backend from the device, with a config override."""

from __future__ import annotations

import importlib

import torch

from cuda_ext.attention.base import AttentionBackend
from cuda_ext.attention.torch_backend import TorchAttentionBackend

BACKENDS: dict[str, type[AttentionBackend]] = {TorchAttentionBackend.name: TorchAttentionBackend}
# Imported on first use, so CPU-only runs never import triton or need a CUDA toolchain.
LAZY_BACKENDS: dict[str, str] = {
    "triton": "cuda_ext.attention.triton_backend:TritonAttentionBackend",
    "cpu": "cuda_ext.attention.cpu_backend:CpuAttentionBackend",
}


def backend_class(name: str) -> type[AttentionBackend]:
    """The class registered as `name`, importing a lazily registered one on first use."""
    if name not in BACKENDS and name in LAZY_BACKENDS:
        module_name, class_name = LAZY_BACKENDS[name].split(":")
        BACKENDS[name] = getattr(importlib.import_module(module_name), class_name)
    if name not in BACKENDS:
        choices = sorted({*BACKENDS, *LAZY_BACKENDS})
        raise ValueError(f"unknown attention backend {name!r}; choose one of {choices} or 'auto'")
    return BACKENDS[name]


def get_attention_backend(
    name: str,
    device: torch.device,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    sliding_window: int | None = None,
    *,
    scale: float | None = None,
    logit_soft_cap: float | None = None,
) -> AttentionBackend:
    """`name` is a registered backend or "auto": Triton on CUDA; on CPU our C++ kernels ("cpu"), or the pure
    torch backend where they cannot be built.

    "triton" on a CPU device only works with TRITON_INTERPRET=1 set before triton is imported (tests).
    sliding_window, scale and logit_soft_cap are this layer's own (see `AttentionBackend.__init__`).
    """
    if name == "auto":
        if torch.device(device).type == "cuda":
            name = "triton"
        else:
            from cuda_ext.cpu_ops import load_cpu_ops

            name = "cpu" if load_cpu_ops() is not None else TorchAttentionBackend.name
    cls = backend_class(name)
    if name == "triton":
        from cuda_ext.attention.triton_backend import check_triton_device

        check_triton_device(torch.device(device))
    return cls(num_heads, num_kv_heads, head_dim, sliding_window, scale=scale, logit_soft_cap=logit_soft_cap)
