"""Llama-family decoder (Llama 2/3/3.x, SmolLM, Mistral) over the paged KV cache.

`LlamaMLP` and `LlamaDecoderLayer` (pre-norm RMSNorm, SwiGLU) are reused by the families with the same layer shape
(Qwen2, Qwen3, Phi-3), each building its own `DecoderAttention`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from cuda_ext.fused_ops import silu_and_mul
from model_executor.layers.attention import DecoderAttention
from model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from model_executor.layers.norm import RMSNorm
from model_executor.layers.rotary import check_rope_parameters, rope_parameters
from model_executor.models.decoder import CausalLMBase, StepInputs, attend_with_residual, config_head_dim
from model_executor.parallel_state import ParallelContext


def check_silu_and_rope(hf_config: Any, owner: str = "") -> None:
    """What a SwiGLU family built from LlamaMLP refuses: another `hidden_act`, a rope type we cannot build.
    `owner` prefixes the message ("Qwen2ForCausalLM: ")."""
    hidden_act = getattr(hf_config, "hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"{owner}hidden_act {hidden_act!r} is not supported (silu is)")
    check_rope_parameters(rope_parameters(hf_config))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up in one column-parallel matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, parallel: ParallelContext, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, parallel, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, parallel, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        return self.down_proj(silu_and_mul(gate_up))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm layer: x + attn(norm(x)), then + mlp(norm(...)), with the residual adds fused into the norms."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, rms_norm_eps: float):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, rms_norm_eps)

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
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaForCausalLM(CausalLMBase):
    """Llama and Mistral: `attention_bias` on q, k, v and o, `mlp_bias`, optional `head_dim`, one `sliding_window`
    on every layer (Mistral v0.1), rope default / llama3 / linear, tied or untied head."""

    supports_decode_stack: ClassVar[bool] = True

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        check_silu_and_rope(hf_config)

    def make_layer(self, index: int) -> nn.Module:
        config = self.config
        attention_bias = bool(getattr(config, "attention_bias", False))
        self_attn = DecoderAttention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config_head_dim(config),
            self.parallel,
            self.attention_backend_name,
            self.device,
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            sliding_window=getattr(config, "sliding_window", None),
        )
        mlp = LlamaMLP(
            config.hidden_size, config.intermediate_size, self.parallel, bias=bool(getattr(config, "mlp_bias", False))
        )
        return LlamaDecoderLayer(self_attn, mlp, config.hidden_size, config.rms_norm_eps)
