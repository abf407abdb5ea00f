"""Phi-3 / Phi-3.5 / Phi-4-mini decoder: the Llama layer shape with q|k|v and gate|up fused in the checkpoint, one
sliding window on every layer, longrope and partial rotary.

Longrope: transformers picks the short or the long factors per forward call, from the longest position in it, and
re-encodes the whole sequence once it passes `original_max_position_embeddings`. A paged cache keeps keys rotated
once, so here positions below that length rotate with the short factors and later ones with the long factors
(`layers.rotary.rope_angles`, which logs where that stops matching transformers).
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from model_executor.layers.attention import DecoderAttention
from model_executor.models.decoder import CausalLMBase, config_head_dim
from model_executor.models.llama import LlamaDecoderLayer, LlamaMLP, check_silu_and_rope


class Phi3ForCausalLM(CausalLMBase):
    """`self_attn.qkv_proj` holds q, k and v rows and `mlp.gate_up_proj` gate then up (`up * silu(gate)`); no
    biases. Partial rotary (Phi-4-mini) rotates each head's first `head_dim * partial_rotary_factor` dims."""

    # The checkpoint's fused tensors: one name each, split into our shards by the linear layers.
    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = {
        "qkv_proj": ("qkv_proj", "qkv"),
        "gate_up_proj": ("gate_up_proj", "gate_up"),
    }
    supports_decode_stack: ClassVar[bool] = True

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        check_silu_and_rope(hf_config, f"{cls.__name__}: ")

    def make_layer(self, index: int) -> nn.Module:
        config = self.config
        self_attn = DecoderAttention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config_head_dim(config),
            self.parallel,
            self.attention_backend_name,
            self.device,
            sliding_window=getattr(config, "sliding_window", None),
        )
        mlp = LlamaMLP(config.hidden_size, config.intermediate_size, self.parallel)
        return LlamaDecoderLayer(self_attn, mlp, config.hidden_size, config.rms_norm_eps)
