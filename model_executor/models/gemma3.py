"""Gemma 3 text (`Gemma3ForCausalLM`, model_type `gemma3_text`: the 270M and 1B checkpoints) over the paged KV cache.

As Gemma 2 (`models/gemma2.py`) plus per-head q/k norms (`GemmaRMSNorm(head_dim)`, before rotary) and two rope
tables: sliding layers rotate with `rope_parameters["sliding_attention"]` (theta 10 000), global ones with
`rope_parameters["full_attention"]` (theta 1e6, `linear` scaling on 4B and up). By default five sliding layers
precede each global one. No attention soft-capping: transformers' Gemma 3 does not apply `attn_logit_softcapping`
even when a config sets it, so neither do we; `final_logit_softcapping` is applied when set.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from model_executor.layers.attention import DecoderAttention
from model_executor.layers.norm import GemmaRMSNorm
from model_executor.layers.rotary import RotaryEmbedding, check_rope_parameters, get_rope, rope_parameters
from model_executor.models.decoder import config_head_dim
from model_executor.models.gemma2 import GemmaCausalLMBase, gemma_layer_types
from model_executor.parallel_state import ParallelContext

logger = logging.getLogger(__name__)


class Gemma3ForCausalLM(GemmaCausalLMBase):
    """Gemma 3 text: q/k norms, one rope table per layer type, 5:1 sliding to global layers by default."""

    family = "Gemma 3"
    sliding_window_pattern = 6

    @classmethod
    def layer_types(cls, hf_config: Any) -> list[str]:
        # transformers 4.x configs name the pattern instead of listing the layers.
        pattern = (
            getattr(hf_config, "sliding_window_pattern", None)
            or getattr(hf_config, "_sliding_window_pattern", None)
            or cls.sliding_window_pattern
        )
        return gemma_layer_types(hf_config, pattern)

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        super().check_config(hf_config)
        for layer_type in sorted(set(cls.layer_types(hf_config))):
            check_rope_parameters(rope_parameters(hf_config, layer_type))

    def __init__(self, config: Any, parallel: ParallelContext, attention_backend: str, device: torch.device):
        attn_soft_cap = getattr(config, "attn_logit_softcapping", None)
        if attn_soft_cap:
            logger.warning(
                "Gemma 3: attn_logit_softcapping=%s is not applied (transformers' Gemma 3 ignores it too)",
                attn_soft_cap,
            )
        super().__init__(config, parallel, attention_backend, device)

    def make_rope(self) -> dict[str, RotaryEmbedding]:
        """One table per layer type present, keyed by that type (each layer's `rope_key`)."""
        config = self.config
        head_dim = config_head_dim(config)
        return {
            layer_type: get_rope(head_dim, config.max_position_embeddings, rope_parameters(config, layer_type))
            for layer_type in sorted(set(self.layer_types(config)))
        }

    def make_attention(self, layer_type: str) -> DecoderAttention:
        config = self.config
        head_dim = config_head_dim(config)
        return DecoderAttention(
            **self.attention_arguments(layer_type),
            q_norm=GemmaRMSNorm(head_dim, config.rms_norm_eps),
            k_norm=GemmaRMSNorm(head_dim, config.rms_norm_eps),
            rope_key=layer_type,
        )
