"""Exact greedy tokens at half the LM head's cost on CPUs with bf16 dot products.

The LM head is a large share of a decode step's time on CPU (the biggest weight, read for every token). A greedy
row needs only the argmax of its fp32 logits, so the head runs once in bf16 (oneDNN packs the weight once;
AVX512-BF16 does two products per lane), and fp32 logits are computed only for the tokens whose bf16 logit lies
within its error bound of the best (typically a handful). The bound is a proof,
not a tolerance: with both operands rounded to bf16 (relative error 2^-8 each) a product's error is at most
2^-7 |x_j w_ij|, so a logit's is at most 2^-7 |x| |w_i| (Cauchy-Schwarz), plus 2^-8 of its value for the bf16
result; both are taken twice over. The token is the argmax of those fp32 logits, the first of equal maxima, as
`Sampler` picks: the same token as the full fp32 head, computed by the same kernel (`screened_greedy` in
cuda_ext/csrc/greedy_screen.cpp). A row whose candidates overflow `MAX_CANDIDATES` gets its full fp32 logits.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import ModuleType

import torch

from model_executor.cpu_features import cpu_has_bf16_dot_products
from model_executor.layers.linear import PACKING_BATCH_HINT
from model_executor.sampler import greedy_tokens
from model_executor.structured_output import apply_bitmask

logger = logging.getLogger(__name__)

# Twice the worst cases: 2^-7 for products of bf16-rounded operands, 2^-8 for rounding the result to bf16.
INPUT_ROUNDING = 2.0**-6
OUTPUT_ROUNDING = 2.0**-7
# Added to every bound: an absolute margin for the float arithmetic of the bound itself.
SLACK = 1e-5
# What a token structured outputs forbid scores in the bf16 screen.
FORBIDDEN_APPROX_LOGIT = -1e30
# Above this many candidates a row's fp32 logits are computed in full (a flat distribution; rare when greedy).
MAX_CANDIDATES = 256
# Rows of random hidden states the start-up self-check puts through both heads.
SELF_CHECK_ROWS = 8


class GreedyScreen:
    """A bf16 copy of an fp32 LM head weight and its row norms; `token_ids(hidden)` = argmax of hidden @ weight^T."""

    def __init__(self, weight: torch.Tensor, ops: ModuleType):
        self.weight = weight.detach()
        self.ops = ops
        self.packed_bf16 = torch.ops.mkldnn._reorder_linear_weight(self.weight.bfloat16(), PACKING_BATCH_HINT)
        self.row_norms = self.weight.norm(dim=1).contiguous()
        # Rows that took the screen, and those that fell back to full fp32 logits (operators, tests).
        self.num_screened_rows = 0
        self.num_fallback_rows = 0

    @classmethod
    def build(cls, weight: torch.Tensor, ops: ModuleType | None, mode: str) -> GreedyScreen | None:
        """The screen for this LM head, or None where it does not apply (mode "off", not fp32 on CPU, no kernels,
        no bf16 dot products under "auto", or a backend whose bf16 results break the bound)."""
        if mode == "off" or ops is None or weight.device.type != "cpu" or weight.dtype != torch.float32:
            return None
        if mode == "auto" and not cpu_has_bf16_dot_products():
            return None
        screen = cls(weight, ops)
        if not screen.bound_holds():
            logger.warning("bf16 LM head outside its error bound on this machine: greedy rows use the fp32 head")
            return None
        logger.info("greedy rows: LM head in bf16, fp32 logits only for the tokens that can still be the argmax")
        return screen

    def bound_holds(self) -> bool:
        """Both heads on random hidden states (scaled as a final norm's output): every bf16 logit within its bound."""
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn(SELF_CHECK_ROWS, self.weight.shape[1], generator=generator) * 2.0
        exact = torch.empty(hidden.shape[0], self.weight.shape[0])
        self.ops.linear_tokens(exact, hidden, self.weight)
        approx = self.approx_logits(hidden).float()
        bound = (
            INPUT_ROUNDING * hidden.norm(dim=1, keepdim=True) * self.row_norms + OUTPUT_ROUNDING * approx.abs() + SLACK
        )
        return bool(((approx - exact).abs() <= bound).all())

    def approx_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """bf16 [rows, vocab]: the LM head's one matmul for greedy rows."""
        return torch.ops.mkldnn._linear_pointwise(hidden.bfloat16(), self.packed_bf16, None, "none", [], "")

    def token_ids(
        self, hidden: torch.Tensor, bitmask: torch.Tensor | None = None, constrained: Sequence[int] = ()
    ) -> torch.Tensor:
        """int64 [rows]: the argmax of each row's fp32 logits (the first of equal maxima); for the `constrained` rows,
        among the tokens their `bitmask` rows allow (structured outputs)."""
        hidden = hidden.float().contiguous()
        approx = self.approx_logits(hidden)
        if constrained:
            # Finite, so the kernel still screens the row; far below any logit, so never a candidate.
            apply_bitmask(approx, bitmask, constrained, FORBIDDEN_APPROX_LOGIT)
        token_ids = self.ops.screened_greedy(
            approx,
            hidden,
            self.weight,
            self.row_norms,
            INPUT_ROUNDING,
            OUTPUT_ROUNDING,
            SLACK,
            MAX_CANDIDATES,
        )
        fallback = (token_ids < 0).nonzero().flatten()
        if fallback.numel():
            full = torch.empty(fallback.numel(), self.weight.shape[0])
            self.ops.linear_tokens(full, hidden.index_select(0, fallback), self.weight)
            if constrained:
                fallback_rows, constrained_rows = fallback.tolist(), set(constrained)
                masked = [position for position, row in enumerate(fallback_rows) if row in constrained_rows]
                apply_bitmask(full, bitmask[fallback_rows], masked)
            token_ids[fallback] = greedy_tokens(full)
        self.num_screened_rows += hidden.shape[0] - fallback.numel()
        self.num_fallback_rows += fallback.numel()
        return token_ids
