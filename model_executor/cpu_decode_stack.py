"""Decode steps, and steps with short prefill chunks, through the C++ decoder stack: one call runs all of a stage's
layers (CPU, one TP rank; fp32, or bf16 where the CPU has bf16 dot products).

The layer-by-layer path makes about 30 small calls per layer, each a Python call and a dispatch; the stack makes
one per step. Its projections run our panel kernel on the layers' panel weights (bf16: our AMX kernel on their tile
weights, or else our bf16 panel kernel on their bf16 panels), as the linear layers do. The
model files know nothing of it beyond the class flag `supports_decode_stack`: the model loader asks
`with_decode_stack(cls)` for a variant with `DecodeStackMixin` on CPU with our kernels on, and
`prepare_decode_stack` builds the stack once the weights are loaded and packed, or logs why it does not apply.

A step with prefill chunks runs the stack where every chunk fits our prefill attention kernel (at most
PREFILL_KERNEL_MAX_KEYS keys, head_dim a multiple of the vector lanes) and the step has at most
STACK_MAX_PREFILL_STEP_TOKENS tokens; the chunks' rows then attend with that kernel inside the stack, after every
row's keys are written. Other steps with chunks run layer by layer.

The stack runs the pre-norm Llama layer shape (`LlamaDecoderLayer`: RMSNorm, attention, RMSNorm, SwiGLU MLP) with
optional q/k/v, o and MLP biases, one default rope table, one scale, and per layer a sliding window and per-head q/k
RMSNorms where the built extension takes them.

LoRA: the stack runs no adapters, so a decode step with any adapter row runs layer by layer (base-only steps keep
the stack).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn

from cuda_ext.attention.cpu_backend import PREFILL_KERNEL_MAX_CACHE_ELEMENTS, CpuAttentionBackend
from cuda_ext.cpu_ops import load_cpu_ops
from model_executor.layers.norm import RMSNorm
from model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

logger = logging.getLogger(__name__)


def stack_takes_keyword(ops: Any, keyword: str) -> bool:
    """Whether the built extension's `DecodeStack.add_layer` takes `keyword` (pybind lists named arguments in the
    docstring): per-layer windows and q/k norms came with a later build."""
    return keyword in (getattr(ops.DecodeStack.add_layer, "__doc__", None) or "")


# Steps with prefill chunks and more tokens than this run layer by layer: past it oneDNN's GEMM (the layers' linears
# over 128 tokens) beats our AMX kernel by more than the stack saves in per-layer calls.
STACK_MAX_PREFILL_STEP_TOKENS = 512


def stack_takes_prefill_chunks(ops: Any, attention: CpuAttentionBackend) -> bool:
    """Whether the built stack takes prefill chunks (a later build) with this head size (the prefill kernel's
    vector path holds whole head rows)."""
    return "prefill_query_starts" in (getattr(ops.DecodeStack.forward, "__doc__", None) or "") and (
        attention.prefill_kernel_head_dim
    )


def _layer_shape_reason(layer: nn.Module) -> str | None:
    if not isinstance(layer, LlamaDecoderLayer) or not isinstance(layer.mlp, LlamaMLP):
        return f"layer {type(layer).__name__} is not the Llama layer shape the stack runs"
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if not all(type(norm) is RMSNorm for norm in norms):
        return "its norms are not plain RMSNorm"
    return None


def _projections(layer: nn.Module) -> tuple[nn.Module, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _bf16_kernel_weight(linear: nn.Module) -> torch.Tensor | None:
    """A bf16 linear's weight as our kernel reads it: AMX tiles, else bf16 panels, else None."""
    return linear.amx_weight if linear.amx_weight is not None else linear.bf16_panel_weight


def decode_stack_unsupported_reason(model: nn.Module) -> str | None:
    """Why the C++ stack cannot run `model`'s decode steps, or None where it can (checked per instance, on the built
    model: its parallelism, dtype, backend and each layer's attention settings)."""
    if not getattr(model, "supports_decode_stack", False):
        return f"not implemented for {type(model).__name__}"
    ops = load_cpu_ops()
    if ops is None:
        return "our C++ kernels are not built"
    if model.parallel.tp_size != 1:
        return f"tensor parallel size {model.parallel.tp_size} (the stack runs one rank's whole layers)"
    layers = list(model.layers.values())
    reasons: list[str] = []
    for layer in layers:
        reason = _layer_shape_reason(layer)
        if reason is not None:
            return reason
    attentions = [layer.self_attn for layer in layers]
    dtype = attentions[0].qkv_proj.weight.dtype
    if dtype == torch.bfloat16:
        if not stack_takes_keyword(ops, "qkv_bf16_panels"):
            reasons.append("dtype bfloat16 (this build of the stack runs float32)")
        elif not all(_bf16_kernel_weight(linear) is not None for layer in layers for linear in _projections(layer)):
            reasons.append("dtype bfloat16 with weights packed for neither AMX tiles nor bf16 panels")
    elif dtype != torch.float32:
        reasons.append(f"dtype {dtype} (the stack runs float32 and bfloat16)")
    backends = {type(attention.attn).__name__ for attention in attentions}
    if not all(isinstance(attention.attn, CpuAttentionBackend) for attention in attentions):
        reasons.append(f"attention backend {sorted(backends)} (the stack runs the cpu backend's kernels)")
    if model.rotary is None or len(model.rotary_embeddings) != 1:
        reasons.append(f"rope tables {sorted(model.rotary_embeddings)} (the stack takes one)")
    elif model.rotary.is_partial:
        reasons.append(f"partial rotary ({model.rotary.rotary_dim} of {model.rotary.head_dim} dims)")
    if any(attention.logit_soft_cap for attention in attentions):
        reasons.append("attention logit soft-capping")
    if len({attention.scale for attention in attentions}) > 1:
        reasons.append("attention scales differ across layers")
    windows = {attention.sliding_window for attention in attentions}
    if len(windows) > 1 and not stack_takes_keyword(ops, "sliding_window"):
        reasons.append(f"sliding windows differ across layers ({sorted(windows, key=str)})")
    if any(attention.q_norm is not None or attention.k_norm is not None for attention in attentions):
        eps = layers[0].input_layernorm.eps
        head_norms = [norm for attention in attentions for norm in (attention.q_norm, attention.k_norm) if norm]
        if not stack_takes_keyword(ops, "q_norm_weight"):
            reasons.append("per-head q/k norms")
        elif not all(type(norm) is RMSNorm and norm.eps == eps for norm in head_norms):
            reasons.append("per-head q/k norms other than RMSNorm with the layers' eps")
    return "; ".join(reasons) or None


def build_decode_stack(model: nn.Module) -> Any:
    """The C++ stack over `model`'s layers and loaded weights (call only where `decode_stack_unsupported_reason` is
    None)."""
    ops = load_cpu_ops()
    attention = model.attention_backend
    first_layer = model.layers[str(model.start_layer)]
    stack = ops.DecodeStack(
        num_heads=attention.num_heads,
        num_kv_heads=attention.num_kv_heads,
        head_dim=attention.head_dim,
        eps=first_layer.input_layernorm.eps,
        scale=attention.scale,
        sliding_window=attention.sliding_window or 0,
    )
    per_layer_windows = stack_takes_keyword(ops, "sliding_window")
    for layer in model.layers.values():
        attn, mlp = layer.self_attn, layer.mlp
        # Keywords only where needed, so a build without them still runs uniform Llama layers.
        extras: dict[str, Any] = {}
        if per_layer_windows:
            extras["sliding_window"] = attn.sliding_window or 0
        if attn.q_norm is not None:
            extras["q_norm_weight"] = attn.q_norm.weight
        if attn.k_norm is not None:
            extras["k_norm_weight"] = attn.k_norm.weight
        if attn.qkv_proj.weight.dtype == torch.bfloat16:
            # Each linear on the kernel its linear method packed it for.
            for name, linear in zip(("qkv", "o", "gate_up", "down"), _projections(layer), strict=True):
                kind = "amx" if linear.amx_weight is not None else "bf16_panels"
                extras[f"{name}_{kind}"] = _bf16_kernel_weight(linear)
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
            **extras,
        )
    return stack


class DecodeStackMixin:
    """Mixed in before a `CausalLMBase` family (by `with_decode_stack`): once `prepare_decode_stack` has built the
    C++ stack, the steps `stack_runs_step` allows run it; other steps, and all steps while `decode_stack` is None,
    run the layers one by one."""

    decode_stack: Any = None
    stack_runs_prefill = False  # whether steps with (short) prefill chunks run it too

    def prepare_decode_stack(self) -> bool:
        """Build the stack over the loaded (and packed) weights; False, with the reason logged, where it does not
        apply."""
        reason = decode_stack_unsupported_reason(self)
        if reason is not None:
            logger.info("decode steps run layer by layer: %s", reason)
            self.decode_stack = None
            return False
        self.decode_stack = build_decode_stack(self)
        self.stack_runs_prefill = stack_takes_prefill_chunks(load_cpu_ops(), self.attention_backend)
        return True

    def stack_runs_step(self, attn_metadata: Any, kv_caches: list[torch.Tensor]) -> bool:
        """Whether this step runs the stack: decodes, and prefill chunks short enough for the prefill kernel where
        the built stack takes them (longer chunks run SDPA layer by layer: over long key runs its GEMM tiles win)."""
        if self.decode_stack is None or (self.lora_batch is not None and self.lora_batch.active):
            return False
        prefill = attn_metadata.prefill
        if prefill is None:
            return True
        return (
            self.stack_runs_prefill
            and prefill.fits_kernel
            and attn_metadata.slot_mapping.shape[0] <= STACK_MAX_PREFILL_STEP_TOKENS
            and kv_caches[0][0].numel() <= PREFILL_KERNEL_MAX_CACHE_ELEMENTS
        )

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
        if not self.stack_runs_step(attn_metadata, kv_caches):
            return super().forward(input_ids, positions, kv_caches, attn_metadata, intermediate, output_rows)
        cos, sin = self.rotary.cos_sin(positions)
        hidden_states, residual = self.stage_input(input_ids, intermediate)
        has_residual = residual is not None
        if residual is None:
            residual = torch.empty_like(hidden_states)
        prefill = attn_metadata.prefill
        chunks = (
            {}
            if prefill is None
            else {
                "prefill_block_tables": prefill.block_tables,
                "prefill_query_starts": prefill.query_starts,
                "prefill_seq_lens": prefill.seq_lens,
            }
        )
        # The last stage's last layer runs its attention, projection and MLP on the sampled rows only.
        last_rows = output_rows if self.parallel.is_last_stage else None
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
            **chunks,
            output_rows=last_rows,
        )
        if last_rows is not None:
            # The stack left output row i in row i.
            num_outputs = last_rows.shape[0]
            return self.stage_output(hidden_states[:num_outputs], residual[:num_outputs])
        return self.stage_output(hidden_states, residual)


@functools.cache
def _decode_stack_variant(model_class: type[nn.Module]) -> type[nn.Module]:
    return type(model_class.__name__, (DecodeStackMixin, model_class), {"__module__": __name__})


def with_decode_stack(model_class: type[nn.Module]) -> type[nn.Module]:
    """The variant of `model_class` that can run the C++ stack (classes with `supports_decode_stack = True`), or
    `model_class` itself, logged (once per model load) where the stack is not implemented for the family."""
    if getattr(model_class, "supports_decode_stack", False):
        return _decode_stack_variant(model_class)
    logger.info("decode stack: not implemented for %s", model_class.__name__)
    return model_class


def runs_decode_stack(model: nn.Module) -> bool:
    """Whether `model`'s decode-only steps run the C++ stack."""
    return isinstance(model, DecodeStackMixin) and model.decode_stack is not None


# Llama's variant under its historical name (the model loader and tests name it).
CpuDecodeStackLlama = with_decode_stack(LlamaForCausalLM)
