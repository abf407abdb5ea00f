"""Attention backends over the paged KV cache: torch (CPU, reference) now, Triton (CUDA) beside it."""

from cuda_ext.attention import AttentionBackend, AttentionBatch, get_attention_backend

__all__ = ["AttentionBackend", "AttentionBatch", "get_attention_backend"]
