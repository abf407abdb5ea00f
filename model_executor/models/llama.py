"""Llama-family decoder (Llama 2/3, SmolLM, Mistral-style configs) over the paged KV cache."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from cuda_ext.attention import AttentionBackend, get_attention_backend
from model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from model_executor.layers.norm import RMSNorm
from model_executor.layers.rotary import RotaryEmbedding
from model_executor.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from model_executor.parallel_state import ParallelContext


def rope_settings(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict) from both the transformers 4 and 5 config layouts."""
    rope_parameters = getattr(config, "rope_parameters", None) or {}
    rope_scaling = getattr(config, "rope_scaling", None) or rope_parameters or None
    rope_theta = rope_parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return float(rope_theta), rope_scaling


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, parallel: ParallelContext, attention_backend: str, device: torch.device):
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            parallel,
            bias=getattr(config, "attention_bias", False),
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            parallel,
            bias=getattr(config, "attention_bias", False),
        )
        rope_theta, rope_scaling = rope_settings(config)
        self.rotary = RotaryEmbedding(self.head_dim, config.max_position_embeddings, rope_theta, rope_scaling)
        self.num_heads = self.qkv_proj.num_heads_per_rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads_per_rank
        self.attn: AttentionBackend = get_attention_backend(
            attention_backend,
            device,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            getattr(config, "sliding_window", None),
        )

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: Any
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        query = qkv[:, :q_size].view(-1, self.num_heads, self.head_dim)
        key = qkv[:, q_size : q_size + kv_size].view(-1, self.num_kv_heads, self.head_dim)
        value = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        query, key = query.contiguous(), key.contiguous()
        self.rotary(positions, query, key)
        attended = self.attn.forward(query, key, value, kv_cache, attn_metadata)
        return self.o_proj(attended)


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, parallel: ParallelContext):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, parallel, bias=getattr(config, "mlp_bias", False)
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, parallel, bias=getattr(config, "mlp_bias", False)
        )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (silu is)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        half = gate_up.shape[-1] // 2
        return self.down_proj(nn.functional.silu(gate_up[:, :half]) * gate_up[:, half:])


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, parallel: ParallelContext, attention_backend: str, device: torch.device):
        super().__init__()
        self.self_attn = LlamaAttention(config, parallel, attention_backend, device)
        self.mlp = LlamaMLP(config, parallel)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaForCausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head; `forward` returns hidden states, not logits."""

    # Checkpoint projection name -> (our fused parameter, shard id).
    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Any, parallel: ParallelContext, attention_backend: str, device: torch.device):
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, parallel, attention_backend, device) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def attention_backend(self) -> AttentionBackend:
        return self.layers[0].self_attn.attn

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: Any,
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden_states, residual = layer(positions, hidden_states, residual, kv_cache, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def checkpoint_name_to_param(self, checkpoint_name: str) -> tuple[str, Any] | None:
        """Map an HF checkpoint tensor name to (our parameter name, shard id); None for tensors we skip."""
        name = checkpoint_name.removeprefix("model.")
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        for checkpoint_part, (param_part, shard_id) in self.packed_modules_mapping.items():
            if f".{checkpoint_part}." in name:
                return name.replace(f".{checkpoint_part}.", f".{param_part}."), shard_id
        return name, None
