"""Llama-family decoder (Llama 2/3, SmolLM, Mistral-style configs) over the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from cuda_ext.attention import AttentionBackend, get_attention_backend
from cuda_ext.fused_ops import silu_and_mul
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


@dataclass(slots=True)
class StepInputs:
    """Per-step values every layer reads, computed once per forward."""

    attn_metadata: Any
    rotary: RotaryEmbedding
    cos_sin: tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    """Self-attention over the paged KV cache. `attention_backend` names a registered backend ("auto": by device);
    the layer gets its `AttentionBackend` from `cuda_ext.attention`'s registry and calls only that interface."""

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
        self,
        step: StepInputs,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every row's keys and values go into the cache; the output is `output_rows`' only (all rows if None)."""
        qkv = self.qkv_proj(hidden_states)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        query = qkv[:, :q_size].view(-1, self.num_heads, self.head_dim)
        key = qkv[:, q_size : q_size + kv_size].view(-1, self.num_kv_heads, self.head_dim)
        value = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        # Rotated in place inside qkv; each backend copies to contiguous only what its kernels need.
        step.rotary.apply(query, key, step.cos_sin)
        attended = self.attn.forward(query, key, value, kv_cache, step.attn_metadata)
        if output_rows is not None:
            attended = attended.index_select(0, output_rows)
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
        return self.down_proj(silu_and_mul(gate_up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, parallel: ParallelContext, attention_backend: str, device: torch.device):
        super().__init__()
        self.self_attn = LlamaAttention(config, parallel, attention_backend, device)
        self.mlp = LlamaMLP(config, parallel)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        step: StepInputs,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        output_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) of `output_rows` only (all rows if None); every row's K/V is cached either way."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(step, hidden_states, kv_cache, output_rows)
        if output_rows is not None:
            residual = residual.index_select(0, output_rows)
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
        self.parallel = parallel
        self.start_layer, self.end_layer = parallel.stage_layer_range(config.num_hidden_layers)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # Pipeline stages hold only their own layers; keys keep the checkpoint's global layer numbers.
        self.layers = nn.ModuleDict(
            {
                str(index): LlamaDecoderLayer(config, parallel, attention_backend, device)
                for index in range(self.start_layer, self.end_layer)
            }
        )
        if parallel.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rope_theta, rope_scaling = rope_settings(config)
        # One table for all layers: positions are looked up once per step, not once per layer.
        self.rotary = RotaryEmbedding(head_dim, config.max_position_embeddings, rope_theta, rope_scaling)
        if parallel.is_last_stage:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel)
            if self.tie_word_embeddings and parallel.is_first_stage:
                self.lm_head.weight = self.embed_tokens.weight

    @property
    def num_local_layers(self) -> int:
        return self.end_layer - self.start_layer

    @property
    def attention_backend(self) -> AttentionBackend:
        return self.layers[str(self.start_layer)].self_attn.attn

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: Any,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Last stage: final hidden states. Other stages: (hidden, residual) for the next stage.

        Stages after the first take the previous stage's (hidden, residual) as `intermediate`. On the last stage,
        `output_rows` (int64 row indices) asks for those rows' final hidden states only: the last layer still
        caches every row's keys and values, but runs its output projection and MLP on those rows alone (a prefill
        chunk samples from its last token only).
        """
        step = StepInputs(attn_metadata, self.rotary, self.rotary.cos_sin(positions))
        hidden_states, residual = self.stage_input(input_ids, intermediate)
        # Every stage owns at least one layer (stage_layer_range); the last one may narrow to output_rows.
        *earlier, (last_layer, last_cache) = zip(self.layers.values(), kv_caches)
        for layer, kv_cache in earlier:
            hidden_states, residual = layer(step, hidden_states, residual, kv_cache)
        last_rows = output_rows if self.parallel.is_last_stage else None
        hidden_states, residual = last_layer(step, hidden_states, residual, last_cache, last_rows)
        return self.stage_output(hidden_states, residual)

    def stage_input(
        self, input_ids: torch.Tensor, intermediate: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden, residual) this stage's first layer takes: the token embeddings (no residual yet) on the first
        stage, the previous stage's output on the others."""
        if self.parallel.is_first_stage:
            return self.embed_tokens(input_ids), None
        return intermediate

    def stage_output(
        self, hidden_states: torch.Tensor, residual: torch.Tensor, output_rows: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """What this stage returns after its last layer: (hidden, residual) for the next stage, or on the last
        stage the final norm of `output_rows`' rows (all rows if None)."""
        if not self.parallel.is_last_stage:
            return hidden_states, residual
        if output_rows is not None:
            hidden_states, residual = hidden_states.index_select(0, output_rows), residual.index_select(0, output_rows)
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
        if name == "embed_tokens.weight" and self.tie_word_embeddings and not self.parallel.is_first_stage:
            # A last stage without the embedding still needs the tied weights for its LM head.
            return "lm_head.weight", None
        for checkpoint_part, (param_part, shard_id) in self.packed_modules_mapping.items():
            if f".{checkpoint_part}." in name:
                return name.replace(f".{checkpoint_part}.", f".{param_part}."), shard_id
        return name, None
