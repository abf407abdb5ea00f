from cuda_ext.attention.base import AttentionBackend, AttentionBatch
from cuda_ext.attention.registry import get_attention_backend

__all__ = ["AttentionBackend", "AttentionBatch", "get_attention_backend"]
