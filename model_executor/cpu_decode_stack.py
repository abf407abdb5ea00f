"""Decode steps through the C++ decoder stack: one call runs all of a stage's layers (CPU, fp32, one TP rank).

The layer-by-layer path makes about 30 small calls per layer, each a Python call and a dispatch; the stack makes
one per step. Its projections run our panel kernel on the layers' panel weights, as the linear layers do. The
model file knows nothing of it: the model loader picks `CpuDecodeStackLlama` for Llama on CPU with our kernels on,
and `prepare_decode_stack` builds the stack once the weights are loaded and packed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cuda_ext.attention.cpu_backend import CpuAttentionBackend
from cuda_ext.cpu_ops import load_cpu_ops
from model_executor.models.llama import LlamaForCausalLM


def build_decode_stack(model: LlamaForCausalLM) -> Any | None:
    """The C++ stack over `model`'s layers and loaded weights, or None where it does not apply: no C++ kernels,
    tensor parallelism, another attention backend, or weights other than fp32."""
    ops = load_cpu_ops()
    attention = model.attention_backend
    first_layer = model.layers[str(model.start_layer)]
    if (
        ops is None
        or model.parallel.tp_size != 1
        or not isinstance(attention, CpuAttentionBackend)
        or first_layer.self_attn.qkv_proj.weight.dtype != torch.float32
    ):
        return None
    stack = ops.DecodeStack(
        num_heads=attention.num_heads,
        num_kv_heads=attention.num_kv_heads,
        head_dim=attention.head_dim,
        eps=first_layer.input_layernorm.eps,
        scale=attention.scale,
        sliding_window=attention.sliding_window or 0,
    )
    for layer in model.layers.values():
        attn, mlp = layer.self_attn, layer.mlp
        stack.add_layer(
            layer.input_layernorm.weight,
            attn.qkv_proj.weight,
            attn.qkv_proj.bias,
            attn.o_proj.weight,
            attn.o_proj.bias,
            layer.post_attention_layernorm.weight,
            mlp.gate_up_proj.weight,
            mlp.gate_up_proj.bias,
            mlp.down_proj.weight,
            mlp.down_proj.bias,
            # None before pack_weights: the dot-product kernel then runs on the plain weights.
            attn.qkv_proj.panel_weight,
            attn.o_proj.panel_weight,
            mlp.gate_up_proj.panel_weight,
            mlp.down_proj.panel_weight,
        )
    return stack


class CpuDecodeStackLlama(LlamaForCausalLM):
    """Llama whose decode-only steps run the C++ stack once `prepare_decode_stack` has built it; steps with a
    prefill chunk, and all steps while `decode_stack` is None, run the layers one by one."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.decode_stack: Any = None

    def prepare_decode_stack(self) -> bool:
        """Build the stack over the loaded (and packed) weights; False where it does not apply."""
        self.decode_stack = build_decode_stack(self)
        return self.decode_stack is not None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: Any,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        num_tokens = input_ids.shape[0]
        if self.decode_stack is None or attn_metadata.num_decodes != num_tokens:
            return super().forward(input_ids, positions, kv_caches, attn_metadata, intermediate, output_rows)
        cos, sin = self.rotary.cos_sin(positions)
        hidden_states, residual = self.stage_input(input_ids, intermediate)
        has_residual = residual is not None
        if residual is None:
            residual = torch.empty_like(hidden_states)
        # Updates hidden_states and residual in place, through every layer of this stage.
        self.decode_stack.forward(
            hidden_states,
            residual,
            has_residual,
            kv_caches,
            attn_metadata.decode_block_tables,
            attn_metadata.decode_seq_lens,
            attn_metadata.slot_mapping,
            cos.view(num_tokens, -1),
            sin.view(num_tokens, -1),
            attn_metadata.decodes_share_sequences,
        )
        return self.stage_output(hidden_states, residual, output_rows)


DECODE_STACK_MODELS: dict[type[nn.Module], type[nn.Module]] = {LlamaForCausalLM: CpuDecodeStackLlama}


def with_decode_stack(model_class: type[nn.Module]) -> type[nn.Module]:
    """The variant of `model_class` that can run the C++ stack, or `model_class` itself where none exists."""
    return DECODE_STACK_MODELS.get(model_class, model_class)


def runs_decode_stack(model: nn.Module) -> bool:
    """Whether `model`'s decode-only steps run the C++ stack."""
    return isinstance(model, CpuDecodeStackLlama) and model.decode_stack is not None
