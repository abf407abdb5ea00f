"""Qwen2 / Qwen2.5 decoder: the Llama layer shape (pre-norm RMSNorm, SwiGLU) with q/k/v biases always on, no o_proj
bias, and a sliding window on the layers the config marks as sliding."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from model_executor.layers.attention import DecoderAttention
from model_executor.models.decoder import CausalLMBase, config_head_dim
from model_executor.models.llama import LlamaDecoderLayer, LlamaMLP, check_silu_and_rope


def layer_sliding_window(config: Any, index: int) -> int | None:
    """The window of layer `index`, as transformers reads it: `layer_types[index] == "sliding_attention"` gives
    `sliding_window`, any other type none. Configs without `layer_types` (transformers 4 exports read by hand) use
    the rule transformers derives it from: a window when `use_sliding_window`, on layers `>= max_window_layers`."""
    window = getattr(config, "sliding_window", None) or None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[index] == "sliding_attention" else None
    if not getattr(config, "use_sliding_window", False):
        return None
    return window if index >= getattr(config, "max_window_layers", 0) else None


class Qwen2ForCausalLM(CausalLMBase):
    """Qwen2 and Qwen2.5 (Qwen2Config has no `attention_bias`: q, k and v carry biases in every checkpoint)."""

    supports_decode_stack: ClassVar[bool] = True

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        check_silu_and_rope(hf_config, f"{cls.__name__}: ")

    def make_attention(self, index: int) -> DecoderAttention:
        config = self.config
        return DecoderAttention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config_head_dim(config),
            self.parallel,
            self.attention_backend_name,
            self.device,
            qkv_bias=True,
            o_bias=False,
            sliding_window=layer_sliding_window(config, index),
        )

    def make_layer(self, index: int) -> nn.Module:
        config = self.config
        mlp = LlamaMLP(config.hidden_size, config.intermediate_size, self.parallel)
        return LlamaDecoderLayer(self.make_attention(index), mlp, config.hidden_size, config.rms_norm_eps)
