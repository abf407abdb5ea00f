"""Gemma 2 over the paged KV cache, and the layer pieces Gemma 3 shares with it.

What sets the Gemma layer apart from Llama's (transformers' `modeling_gemma2.py`): embeddings scaled by
sqrt(hidden_size) rounded to the model dtype; every norm is `GemmaRMSNorm` (x_norm * (1 + w)), four per layer, the
attention and MLP outputs normalised before their residual adds; GeGLU with the tanh GELU; attention scaled by
`query_pre_attn_scalar**-0.5` rather than head_dim's; sliding and global layers alternating by `layer_types`; and
Gemma 2's tanh soft-capping of the attention scores and of the final logits.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from cuda_ext.fused_ops import gelu_tanh_and_mul
from model_executor.layers.attention import DecoderAttention
from model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from model_executor.layers.norm import GemmaRMSNorm
from model_executor.layers.rotary import check_rope_parameters, rope_parameters
from model_executor.models.decoder import CausalLMBase, StepInputs, attend_with_residual, config_head_dim
from model_executor.parallel_state import ParallelContext

logger = logging.getLogger(__name__)

SLIDING = "sliding_attention"
GLOBAL = "full_attention"
# transformers' ACT2FN name for F.gelu(approximate="tanh"), the only activation Gemma 2 and 3 checkpoints use.
GEMMA_ACTIVATION = "gelu_pytorch_tanh"


def gemma_layer_types(config: Any, sliding_window_pattern: int) -> list[str]:
    """Each layer's attention kind: the config's `layer_types`, else every `sliding_window_pattern`-th layer global
    and the others sliding (transformers' default when a config predates `layer_types`)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return list(layer_types)
    return [SLIDING if (index + 1) % sliding_window_pattern else GLOBAL for index in range(config.num_hidden_layers)]


def check_gemma_config(family: str, hf_config: Any, layer_types: list[str]) -> None:
    """Refusals common to Gemma 2 and 3 (ValueError naming the setting)."""
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError(f"{family}: use_bidirectional_attention is not supported (causal decoding only)")
    activation = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", GEMMA_ACTIVATION)
    if activation != GEMMA_ACTIVATION:
        raise ValueError(f"{family}: hidden_activation {activation!r} is not supported ({GEMMA_ACTIVATION} is)")
    unknown = sorted(set(layer_types) - {SLIDING, GLOBAL})
    if unknown:
        raise ValueError(f"{family}: layer types {unknown} are not supported ({SLIDING}, {GLOBAL} are)")
    if len(layer_types) != hf_config.num_hidden_layers:
        raise ValueError(f"{family}: {len(layer_types)} layer_types for {hf_config.num_hidden_layers} layers")


class GemmaMLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x)), gate and up in one column-parallel matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, parallel: ParallelContext):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, parallel)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    """x + post_attn(attn(input_norm(x))), then + post_ff(mlp(pre_ff(...))).

    In the (hidden, residual) carry the residual adds are fused into the next norm: `pre_feedforward_layernorm`
    adds the normalised attention output, and the next layer's `input_layernorm` (or the final norm) adds the
    normalised MLP output this layer returns.
    """

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, rms_norm_eps: float):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = GemmaRMSNorm(hidden_size, rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden_size, rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden_size, rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden_size, rms_norm_eps)

    def forward(
        self,
        step: StepInputs,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        output_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) of `output_rows` only (all rows if None); every row's K/V is cached either way."""
        hidden_states, residual = attend_with_residual(self, step, hidden_states, residual, kv_cache, output_rows)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class GemmaCausalLMBase(CausalLMBase):
    """What Gemma 2 and Gemma 3 share: scaled embeddings, Gemma layers and norms, per-layer sliding windows, the
    final logits soft-capped by `final_logit_softcapping` when the config sets it. A family sets
    `sliding_window_pattern` (its default when a config has no `layer_types`) and builds its attention in
    `make_attention`."""

    family = "Gemma"
    sliding_window_pattern = 2

    @classmethod
    def layer_types(cls, hf_config: Any) -> list[str]:
        return gemma_layer_types(hf_config, cls.sliding_window_pattern)

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        check_gemma_config(cls.family, hf_config, cls.layer_types(hf_config))

    def __init__(self, config: Any, parallel: ParallelContext, attention_backend: str, device: torch.device):
        super().__init__(config, parallel, attention_backend, device)
        if parallel.is_first_stage:
            # transformers rounds sqrt(hidden_size) to the model dtype before multiplying (55.4256 -> 55.5 in bf16).
            weight = self.embed_tokens.weight
            normalizer = torch.tensor(config.hidden_size**0.5, dtype=weight.dtype, device=weight.device)
            self.register_buffer("embed_scale", normalizer, persistent=False)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None) or None

    def make_attention(self, layer_type: str) -> DecoderAttention:
        raise NotImplementedError(f"{type(self).__name__} must implement make_attention")

    def make_layer(self, index: int) -> nn.Module:
        config = self.config
        self_attn = self.make_attention(self.layer_types(config)[index])
        mlp = GemmaMLP(config.hidden_size, config.intermediate_size, self.parallel)
        return GemmaDecoderLayer(self_attn, mlp, config.hidden_size, config.rms_norm_eps)

    def attention_arguments(self, layer_type: str) -> dict[str, Any]:
        """The `DecoderAttention` arguments both families read the same way from their configs."""
        config = self.config
        attention_bias = bool(getattr(config, "attention_bias", False))
        return {
            "hidden_size": config.hidden_size,
            "num_heads": config.num_attention_heads,
            "num_kv_heads": config.num_key_value_heads,
            "head_dim": config_head_dim(config),
            "parallel": self.parallel,
            "attention_backend": self.attention_backend_name,
            "device": self.device,
            "qkv_bias": attention_bias,
            "o_bias": attention_bias,
            "scale": float(config.query_pre_attn_scalar) ** -0.5,
            "sliding_window": config.sliding_window if layer_type == SLIDING else None,
        }

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def make_final_norm(self) -> nn.Module:
        return GemmaRMSNorm(self.config.hidden_size, self.config.rms_norm_eps)


class Gemma2ForCausalLM(GemmaCausalLMBase):
    """Gemma 2: sliding and global layers alternate (layer 0 slides), one rope table, attention scores soft-capped
    by `attn_logit_softcapping` and the final logits by `final_logit_softcapping`, head tied to the embedding."""

    family = "Gemma 2"
    sliding_window_pattern = 2

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        super().check_config(hf_config)
        check_rope_parameters(rope_parameters(hf_config))

    def make_attention(self, layer_type: str) -> DecoderAttention:
        soft_cap = getattr(self.config, "attn_logit_softcapping", None) or None
        return DecoderAttention(**self.attention_arguments(layer_type), logit_soft_cap=soft_cap)
