"""Greedy tokens of a bf16 LM head on AMX tiles, without its logits.

A plain greedy row needs only the argmax of its logits. Where the LM head runs on our AMX kernel, `amx_greedy_tokens`
keeps each row's best bf16-rounded logit as the tiles produce them: the token the sampler would take from the head's
bf16 logits (the first of equal maxima), without writing, widening to fp32 and reading back [rows, vocab] of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model_executor.layers.linear import CpuAmxLinearMethod
from model_executor.layers.vocab import ParallelLMHead
from model_executor.sampler import greedy_tokens
from model_executor.structured_output import apply_bitmask


class AmxGreedyHead:
    """`token_ids(hidden)` = the argmax of each row's bf16 logits under a bf16 LM head packed for AMX."""

    def __init__(self, lm_head: ParallelLMHead, method: CpuAmxLinearMethod):
        self.lm_head = lm_head
        self.ops = method.ops
        # Rows whose token came from the kernel, and rows that took the logits path (no token allowed).
        self.num_screened_rows = 0
        self.num_fallback_rows = 0

    @classmethod
    def build(cls, lm_head: ParallelLMHead) -> AmxGreedyHead | None:
        """The fused head where the LM head is a bf16 weight on our AMX kernel (a whole, unbiased head); else None."""
        method = lm_head.linear_method
        if not isinstance(method, CpuAmxLinearMethod) or lm_head.weight.dtype != torch.bfloat16:
            return None
        if getattr(lm_head, "amx_weight", None) is None or getattr(lm_head, "bias", None) is not None:
            return None
        return cls(lm_head, method)

    def token_ids(
        self, hidden: torch.Tensor, bitmask: torch.Tensor | None = None, constrained: Sequence[int] = ()
    ) -> torch.Tensor:
        """int64 [rows]: each row's greedy token; for the `constrained` rows, among those their `bitmask` rows allow."""
        hidden = hidden.to(torch.bfloat16).contiguous()
        weight_rows = self.lm_head.weight.shape[0]
        row_bitmask = bitmask.contiguous() if constrained else None
        token_ids = self.ops.amx_greedy_tokens(
            hidden, self.lm_head.amx_weight, weight_rows, self.lm_head.vocab_size, row_bitmask
        )
        # A row that allows no token takes the sampler's own path (its logits, all masked, then the argmax).
        fallback = (token_ids < 0).nonzero().flatten()
        if fallback.numel():
            rows = fallback.tolist()
            logits = self.lm_head.compute_logits(hidden.index_select(0, fallback)).float()
            apply_bitmask(logits, bitmask[rows], list(range(len(rows))))
            token_ids[fallback] = greedy_tokens(logits)
        self.num_screened_rows += hidden.shape[0] - fallback.numel()
        self.num_fallback_rows += fallback.numel()
        return token_ids
