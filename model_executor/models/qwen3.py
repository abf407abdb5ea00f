"""Qwen3 (dense) decoder: Qwen2's layers with an RMSNorm on each query and key head before rotary, biases from
`attention_bias` (o_proj included), and an explicit `head_dim` that need not equal hidden / heads."""

from __future__ import annotations

from model_executor.layers.attention import DecoderAttention
from model_executor.layers.norm import RMSNorm
from model_executor.models.decoder import config_head_dim
from model_executor.models.qwen2 import Qwen2ForCausalLM, layer_sliding_window


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    """Qwen3 dense models (`supports_decode_stack` as Qwen2: `cpu_decode_stack` runs the q/k norms where the built
    extension takes them, else steps run layer by layer)."""

    def make_attention(self, index: int) -> DecoderAttention:
        config = self.config
        head_dim = config_head_dim(config)
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderAttention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            head_dim,
            self.parallel,
            self.attention_backend_name,
            self.device,
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            sliding_window=layer_sliding_window(config, index),
            q_norm=RMSNorm(head_dim, config.rms_norm_eps),
            k_norm=RMSNorm(head_dim, config.rms_norm_eps),
        )
