"""Kernels under the model: attention backends over the paged KV cache (Triton on CUDA, our C++ kernels on CPU,
pure torch as the reference), the C++ CPU ops (`cpu_ops`: attention, linear panels, the decoder stack), Triton
fused elementwise kernels and CUDA graphs."""

from cuda_ext.attention import AttentionBackend, AttentionBatch, get_attention_backend

__all__ = ["AttentionBackend", "AttentionBatch", "get_attention_backend"]
