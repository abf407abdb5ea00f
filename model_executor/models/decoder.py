"""The decoder-only causal LM skeleton every family shares: pipeline stage range, layers keyed by global index, the
forward loop over the paged KV cache, stage inputs/outputs, tied LM head, and the checkpoint-name classification
the weight loader relies on. A family subclasses `CausalLMBase` and fills in its hooks (`make_layer`, `make_rope`,
`embed`, `make_final_norm`, `check_config`) and class attributes."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from cuda_ext.attention import AttentionBackend
from model_executor.layers.norm import RMSNorm
from model_executor.layers.rotary import RotaryEmbedding, get_rope, rope_parameters
from model_executor.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from model_executor.parallel_state import ParallelContext
from model_executor.weight_loader import CheckpointSkip

# Checkpoint tensors transformers saves that no model here reads (rotary caches of old exports).
UNUSED_CHECKPOINT_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")

_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")


def config_head_dim(config: Any) -> int:
    """The attention head size: the config's `head_dim` where set (it may differ from hidden / heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(slots=True)
class StepInputs:
    """Per-step values every layer reads, computed once per forward."""

    attn_metadata: Any
    rope: dict[str, tuple[RotaryEmbedding, tuple[torch.Tensor, torch.Tensor]]]
    """Rope key -> (its RotaryEmbedding, that table's cos/sin rows for this step's positions)."""


def attend_with_residual(
    layer: nn.Module,
    step: StepInputs,
    hidden_states: torch.Tensor,
    residual: torch.Tensor | None,
    kv_cache: torch.Tensor,
    output_rows: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm layer's first half: `layer.input_layernorm` (adding the residual carried in, none on the first
    layer), then `layer.self_attn`; returns (attention output, residual), both narrowed to `output_rows`."""
    if residual is None:
        residual = hidden_states
        hidden_states = layer.input_layernorm(hidden_states)
    else:
        hidden_states, residual = layer.input_layernorm(hidden_states, residual)
    hidden_states = layer.self_attn(step, hidden_states, kv_cache, output_rows)
    if output_rows is not None:
        residual = residual.index_select(0, output_rows)
    return hidden_states, residual


class CausalLMBase(nn.Module):
    """Embedding, decoder layers, final norm and LM head; `forward` returns hidden states, not logits.

    Subclasses implement `make_layer(index)` (a module whose forward is `layer(step, hidden, residual, kv_cache,
    output_rows=None) -> (hidden, residual)` and whose attention is `layer.self_attn`) and may override the other
    hooks. The hooks run inside `__init__`, after `config`, `parallel`, `attention_backend_name`, `device` and the
    stage range are set.
    """

    # Checkpoint projection name -> (our fused parameter, shard id).
    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    final_logit_softcapping: float | None = None
    """`cap * tanh(logits / cap)` on the logits when set (Gemma 2)."""
    supports_decode_stack: ClassVar[bool] = False
    """Whether the C++ decoder stack (`model_executor.cpu_decode_stack`) can run this family's layers."""
    lora_batch: Any = None
    """The step's LoRA rows (`model_executor.lora.LoRABatch`), set on the model once adapters are enabled."""

    def __init__(self, config: Any, parallel: ParallelContext, attention_backend: str, device: torch.device):
        # Refused here too, for models built without the up-front check (tests, `LLM` on a directory).
        self.check_config(config)
        super().__init__()
        self.config = config
        self.parallel = parallel
        self.attention_backend_name = attention_backend
        self.device = torch.device(device)
        self.start_layer, self.end_layer = parallel.stage_layer_range(config.num_hidden_layers)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # Pipeline stages hold only their own layers; keys keep the checkpoint's global layer numbers.
        self.layers = nn.ModuleDict(
            {str(index): self.make_layer(index) for index in range(self.start_layer, self.end_layer)}
        )
        if parallel.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
        # One table per rope key: positions are looked up once per step, not once per layer.
        ropes = self.make_rope()
        self.rotary_embeddings = nn.ModuleDict(ropes)
        # The C++ decode stack reads the default table.
        self.rotary: RotaryEmbedding | None = ropes.get("default")
        if parallel.is_last_stage:
            self.norm = self.make_final_norm()
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel)
            if self.tie_word_embeddings and parallel.is_first_stage:
                self.lm_head.weight = self.embed_tokens.weight
        self._param_names: frozenset[str] | None = None

    # ----- hooks -----

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        """Raise ValueError for a config this family cannot run (called before any worker starts)."""

    def make_layer(self, index: int) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} must implement make_layer")

    def make_rope(self) -> dict[str, RotaryEmbedding]:
        """Rope key -> table; layers pick theirs with `DecoderAttention(rope_key=...)`."""
        params = rope_parameters(self.config)
        return {"default": get_rope(config_head_dim(self.config), self.config.max_position_embeddings, params)}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first stage's input hidden states."""
        return self.embed_tokens(input_ids)

    def make_final_norm(self) -> nn.Module:
        return RMSNorm(self.config.hidden_size, self.config.rms_norm_eps)

    # ----- the forward pass -----

    @property
    def num_local_layers(self) -> int:
        return self.end_layer - self.start_layer

    @property
    def attention_backend(self) -> AttentionBackend:
        """The backend whose metadata a step shares across all layers (the first local layer's)."""
        return self.layers[str(self.start_layer)].self_attn.attn

    def step_inputs(self, positions: torch.Tensor, attn_metadata: Any) -> StepInputs:
        rope = {key: (rotary, rotary.cos_sin(positions)) for key, rotary in self.rotary_embeddings.items()}
        return StepInputs(attn_metadata, rope)

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
        step = self.step_inputs(positions, attn_metadata)
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
            return self.embed(input_ids), None
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
        logits = self.lm_head.compute_logits(hidden_states)
        cap = self.final_logit_softcapping
        if cap:
            # transformers' order: divide, tanh, multiply (in place on our own logits tensor).
            logits = logits.div_(cap).tanh_().mul_(cap)
        return logits

    # ----- checkpoint names -----

    @property
    def param_names(self) -> frozenset[str]:
        """Our parameter names as the weight loader sees them (`named_parameters()`, tied ones once)."""
        if self._param_names is None:
            self._param_names = frozenset(name for name, _ in self.named_parameters())
        return self._param_names

    def _map_packed(self, name: str) -> tuple[str, Any]:
        for checkpoint_part, (param_part, shard_id) in self.packed_modules_mapping.items():
            if f".{checkpoint_part}." in name:
                return name.replace(f".{checkpoint_part}.", f".{param_part}."), shard_id
        return name, None

    def checkpoint_name_to_param(self, checkpoint_name: str) -> tuple[str, Any] | CheckpointSkip | None:
        """Classify an HF checkpoint tensor name: (our parameter name, shard id) to load it; `CheckpointSkip.UNUSED`
        for known tensors no model reads (rotary caches, a head tied to the embedding); `CheckpointSkip.OTHER_STAGE`
        for a valid tensor of another pipeline stage; None for a name that maps to no parameter on any stage."""
        name = checkpoint_name.removeprefix("model.")
        if name.endswith(UNUSED_CHECKPOINT_SUFFIXES):
            return CheckpointSkip.UNUSED
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return CheckpointSkip.UNUSED
        params = self.param_names
        match = _LAYER_NAME.fullmatch(name)
        if match is not None:
            index, suffix = int(match.group(1)), match.group(2)
            param_suffix, shard_id = self._map_packed(f".{suffix}")
            if self.start_layer <= index < self.end_layer:
                param_name = f"layers.{index}{param_suffix}"
                return (param_name, shard_id) if param_name in params else None
            # Another stage's layer: valid when the same tensor of one of our layers (all alike in shape of
            # names) is a parameter; per-layer differences are the family's to allow in an override.
            if 0 <= index < self.config.num_hidden_layers and f"layers.{self.start_layer}{param_suffix}" in params:
                return CheckpointSkip.OTHER_STAGE
            return None
        if name.startswith("embed_tokens."):
            if self.parallel.is_first_stage:
                return (name, None) if name in params else None
            if self.tie_word_embeddings and self.parallel.is_last_stage:
                # A last stage without the embedding still needs the tied weights for its LM head.
                return "lm_head" + name.removeprefix("embed_tokens"), None
            return CheckpointSkip.OTHER_STAGE if name == "embed_tokens.weight" else None
        if name.startswith(("norm.", "lm_head.")):
            if self.parallel.is_last_stage:
                return (name, None) if name in params else None
            return CheckpointSkip.OTHER_STAGE if name in ("norm.weight", "lm_head.weight") else None
        param_name, shard_id = self._map_packed(name)
        return (param_name, shard_id) if param_name in params else None
