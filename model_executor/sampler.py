"""Turns one step's logits into the next token of every running sequence.

Semantics follow vLLM v1:

0. structured outputs: the tokens a row's grammar forbids are set to -inf first (one masked fill for the batch);
1. logprobs (when a row asks for them) come from the RAW model logits, before any processing ("raw_logprobs");
2. min_tokens: EOS and the row's stop_token_ids are set to -inf while fewer than min_tokens tokens were generated;
3. logit_bias is added;
4. repetition penalty on tokens seen in the prompt or the output (logit > 0: divided, else multiplied), then frequency
   (times the count in the output) and presence (once per token in the output) penalties are subtracted;
5. greedy rows (temperature ~ 0) take the argmax of these processed logits; random rows are divided by their
   temperature, then min_p (relative to the top token's probability), top_k and top_p (on the distribution left after
   min_p and top_k) drop tokens, and one token is drawn from what remains.

Every stage works on the whole batch with per-row parameter tensors and is skipped when no row needs it. Tokens dropped
by top_k, top_p and min_p are found as a per-row probability threshold (ties at the boundary are kept, as vLLM does for
top_k): top_k reads it off `torch.topk`, top_p searches the nucleus among the 64 then 1024 most likely tokens and only
sorts the full vocabulary for rows whose nucleus is wider than that.

Drawing uses a two-level inverse CDF over the unnormalised probabilities (one float64 uniform per row per step): pick a
block of 256 tokens from the cumulative block masses, then a token inside the block. It is exact up to float32 rounding
of the probabilities, makes one pass over the vocabulary instead of generating a random number per token, and a seeded
row takes its uniform from its own generator, so a seed gives the same tokens whatever else shares the batch. On CPU
with our C++ kernels, rows without min_p / top_k / top_p draw in one kernel (`sample_from_logits`: the same draw from
the same uniform, reading bf16 logits as they are), where the torch composition makes several passes over float32
copies of the whole vocabulary.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from configs.sampling_params import SamplingParams
from model_executor.structured_output import apply_bitmask

logger = logging.getLogger(__name__)

# Width of the blocks of the two-level inverse-CDF draw: ~sqrt(vocab) keeps both levels small.
_BLOCK = 256
# Candidate-set sizes tried for the top_p nucleus before falling back to a full sort of the row.
_TOP_P_CANDIDATES = (64, 1024)


@dataclass(slots=True)
class SamplingRow:
    """One row of the logits matrix: the request's parameters and its token history."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    """Tokens generated so far (before this step)."""
    generator: torch.Generator | None
    """Set iff params.seed is not None; advanced in place (one draw per random step), persists across steps."""


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    """The sampled token."""
    logprob: float
    """Its log-probability under the raw model distribution."""
    rank: int
    """1-based rank of the sampled token: the number of tokens at least as likely."""
    top_logprobs: list[tuple[int, float]]
    """The params.logprobs most likely (token_id, logprob), best first."""


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    """None for rows whose params.logprobs is None."""


class Sampler:
    """Picks one token per row of a logits matrix; stateless apart from the EOS ids (generators live in the rows)."""

    def __init__(self, eos_token_ids: Collection[int], cpu_ops: ModuleType | None = None) -> None:
        self.eos_token_ids: tuple[int, ...] = tuple(sorted({int(t) for t in eos_token_ids}))
        # Our C++ CPU kernels, for the one-kernel draw of CPU rows (None: torch alone).
        self.draw_kernel = getattr(cpu_ops, "sample_from_logits", None)

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], bitmask: torch.Tensor | None = None
    ) -> SamplerOutput:
        """Sample the next token of every row.

        `logits` is float32 [len(rows), vocab_size] and is modified in place. Token ids in the rows (prompt, output,
        logit_bias keys, stop_token_ids) must be < vocab_size. `bitmask`: int32 [len(rows), words] of allowed tokens
        (bit t % 32 of word t // 32), read for the rows with structured outputs.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}.")
        if self._draws_in_one_kernel(logits, rows):
            # Nothing to process or report, and no row filters: one kernel on the logits as they are (bf16 too).
            return SamplerOutput(self._draw_in_kernel(logits, rows).tolist(), [None] * len(rows))
        if logits.dtype != torch.float32:
            logits = logits.float()
        if bitmask is not None:
            constrained = [i for i, row in enumerate(rows) if row.params.structured_outputs is not None]
            if constrained:
                apply_bitmask(logits, bitmask, constrained)
        if all(map(self.is_plain_greedy, rows)):
            # Nothing to process, nothing to report: the common decode step of a greedy batch is one argmax.
            return SamplerOutput(greedy_tokens(logits).tolist(), [None] * len(rows))

        logprob_idx = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        raw_logprobs: torch.Tensor | None = None
        if logprob_idx:
            # Computed before anything below touches the logits in place.
            raw = logits if len(logprob_idx) == len(rows) else logits[logprob_idx]
            raw_logprobs = torch.log_softmax(raw, dim=-1)

        self.apply_logits_processors(logits, rows)
        sampled = self._sample(logits, rows)

        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        if raw_logprobs is not None:
            num_top = [rows[i].params.logprobs or 0 for i in logprob_idx]
            for i, entry in zip(logprob_idx, _gather_logprobs(raw_logprobs, sampled[logprob_idx], num_top)):
                logprobs[i] = entry
        return SamplerOutput(sampled.tolist(), logprobs)

    def apply_logits_processors(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Apply min_tokens, logit_bias and the penalties to `logits` in place and return it.

        These are the stages before temperature; greedy rows take the argmax of the result.
        """
        self._apply_min_tokens(logits, rows)
        self._apply_logit_bias(logits, rows)
        _apply_penalties(logits, rows)
        return logits

    def _kernel_takes(self, logits: torch.Tensor) -> bool:
        return self.draw_kernel is not None and logits.device.type == "cpu" and logits.stride(-1) == 1

    def _draws_in_one_kernel(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> bool:
        """Every row random and plain (nothing to process or report, no grammar), none filtered, on the CPU kernel."""
        if not self._kernel_takes(logits):
            return False
        vocab = logits.shape[1]
        return all(
            not row.params.is_greedy
            and row.params.structured_outputs is None
            and self._is_plain(row)
            and not _filters(row.params, vocab)
            for row in rows
        )

    def _draw_in_kernel(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        temperatures = torch.tensor([row.params.temperature for row in rows], dtype=torch.float32)
        return self.draw_kernel(logits, temperatures, _row_uniforms(rows))

    def _is_plain(self, row: SamplingRow) -> bool:
        """Nothing to apply or report: the row's token comes from its raw logits."""
        params = row.params
        return (
            params.logprobs is None
            and not params.logit_bias
            and not params.needs_penalties
            and not self._under_min_tokens(row)
        )

    def is_plain_greedy(self, row: SamplingRow) -> bool:
        """Greedy with nothing to apply or report: the row's token is the argmax of its raw logits (for a row with
        structured outputs, of those its grammar allows)."""
        return row.params.is_greedy and self._is_plain(row)

    def _under_min_tokens(self, row: SamplingRow) -> bool:
        params = row.params
        has_stops = bool(self.eos_token_ids or params.stop_token_ids)
        return has_stops and len(row.output_token_ids) < params.min_tokens

    def _apply_min_tokens(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        row_idx: list[int] = []
        token_idx: list[int] = []
        for i, row in enumerate(rows):
            if self._under_min_tokens(row):
                # EOS is suppressed even with ignore_eos, as vLLM adds it to the min_tokens stop set unconditionally.
                stops = set(self.eos_token_ids).union(row.params.stop_token_ids)
                row_idx.extend([i] * len(stops))
                token_idx.extend(stops)
        if row_idx:
            index = (_long(row_idx, logits.device), _long(token_idx, logits.device))
            logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device))

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        row_idx: list[int] = []
        token_idx: list[int] = []
        biases: list[float] = []
        for i, row in enumerate(rows):
            bias = row.params.logit_bias
            if bias:
                row_idx.extend([i] * len(bias))
                token_idx.extend(bias.keys())
                biases.extend(bias.values())
        if row_idx:
            index = (_long(row_idx, logits.device), _long(token_idx, logits.device))
            logits.index_put_(index, torch.tensor(biases, dtype=logits.dtype, device=logits.device), accumulate=True)

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Return the sampled token ids as an int64 tensor [len(rows)] on logits.device."""
        random_idx = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if not random_idx:
            return greedy_tokens(logits)
        if len(random_idx) == len(rows):
            return self._sample_random(logits, rows)
        greedy_idx = [i for i, row in enumerate(rows) if row.params.is_greedy]
        sampled = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        sampled[greedy_idx] = greedy_tokens(logits[greedy_idx])
        sampled[random_idx] = self._sample_random(logits[random_idx], [rows[i] for i in random_idx])
        return sampled

    def _sample_random(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The random rows' draws: in one kernel where no row filters and the kernel takes these logits."""
        vocab = logits.shape[1]
        if self._kernel_takes(logits) and not any(_filters(row.params, vocab) for row in rows):
            return self._draw_in_kernel(logits, rows)
        return _sample_random(logits, rows)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the vocabulary, the first of equal maxima, as `argmax` (and HF's greedy search) picks.

    `max(dim).indices` promises the same index and is faster than `argmax` on CPU.
    """
    return logits.max(dim=-1).indices


def _long(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.long, device=device)


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Repetition, then frequency and presence penalties, touching only the tokens each row has seen."""
    vocab = logits.shape[1]
    device = logits.device
    rep_keys: list[torch.Tensor] = []
    out_keys: list[torch.Tensor] = []
    repetition = [1.0] * len(rows)
    frequency = [0.0] * len(rows)
    presence = [0.0] * len(rows)
    for i, row in enumerate(rows):
        params = row.params
        if not params.needs_penalties:
            continue
        # Flat keys row * vocab + token let one torch.unique deduplicate and count the whole batch.
        output = _long(row.output_token_ids, device) + i * vocab
        if params.repetition_penalty != 1.0:
            repetition[i] = params.repetition_penalty
            rep_keys.append(_long(row.prompt_token_ids, device) + i * vocab)
            rep_keys.append(output)
        if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
            frequency[i] = params.frequency_penalty
            presence[i] = params.presence_penalty
            out_keys.append(output)

    if rep_keys:
        keys = torch.unique(torch.cat(rep_keys))
        row_idx, token_idx = keys // vocab, keys % vocab
        penalty = torch.tensor(repetition, dtype=logits.dtype, device=device)[row_idx]
        values = logits[row_idx, token_idx]
        logits[row_idx, token_idx] = torch.where(values > 0, values / penalty, values * penalty)
    if out_keys:
        keys, counts = torch.unique(torch.cat(out_keys), return_counts=True)
        row_idx, token_idx = keys // vocab, keys % vocab
        freq = torch.tensor(frequency, dtype=logits.dtype, device=device)[row_idx]
        pres = torch.tensor(presence, dtype=logits.dtype, device=device)[row_idx]
        values = logits[row_idx, token_idx] - freq * counts.to(logits.dtype)
        logits[row_idx, token_idx] = values - pres


def _sample_random(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, min_p / top_k / top_p and one draw per row; `logits` (the random rows only) is overwritten."""
    device = logits.device
    temperature = [row.params.temperature for row in rows]
    # Unnormalised probabilities exp((l - max) / T): the top token weighs exactly 1, so min_p is a plain threshold.
    weights = logits.sub_(logits.amax(dim=-1, keepdim=True))
    if any(t != 1.0 for t in temperature):
        weights.div_(torch.tensor(temperature, dtype=weights.dtype, device=device).unsqueeze(1))
    weights.exp_()

    threshold = _drop_thresholds(weights, [row.params for row in rows])
    if threshold is not None:
        weights.masked_fill_(weights < threshold.unsqueeze(1), 0.0)

    return _inverse_cdf_sample(weights, _row_uniforms(rows).to(device))


def _row_uniforms(rows: Sequence[SamplingRow]) -> torch.Tensor:
    """float64 [rows] on the CPU: each row's uniform of this step, a seeded row's from its own generator."""
    uniforms = torch.empty(len(rows), dtype=torch.float64)
    unseeded = [i for i, row in enumerate(rows) if row.generator is None]
    if unseeded:
        uniforms[unseeded] = torch.rand(len(unseeded), dtype=torch.float64)
    for i, row in enumerate(rows):
        if row.generator is not None:
            # One draw per step from the request's own generator: batch-independent and cheap.
            generator = row.generator
            uniforms[i] = torch.rand((), dtype=torch.float64, generator=generator, device=generator.device).item()
    return uniforms


def _filters(params: SamplingParams, vocab: int) -> bool:
    """Whether min_p, top_k or top_p may drop tokens of this row."""
    return 0 < params.top_k < vocab or params.top_p < 1.0 or bool(params.min_p)


def _drop_thresholds(weights: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor | None:
    """Per-row weight below which min_p, top_k and top_p drop a token (0 keeps all); None if no row filters.

    `weights` are the unnormalised probabilities with the top token at 1.
    """
    num_rows, vocab = weights.shape
    if not any(_filters(p, vocab) for p in params):
        return None
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    # min_p first, as vLLM applies it before top_k/top_p; relative to the top token it is the weight itself.
    threshold = torch.tensor(min_p, dtype=weights.dtype, device=weights.device)

    candidate_rows = [i for i in range(num_rows) if top_k[i] or top_p[i] < 1.0]
    if not candidate_rows:
        return threshold
    k = max(top_k[i] for i in candidate_rows)
    top_p_rows = [i for i in candidate_rows if top_p[i] < 1.0]
    if top_p_rows:
        # One candidate past top_k lets the nucleus search see that the top_k set is complete.
        k = max(k, _TOP_P_CANDIDATES[0], *(top_k[i] + 1 for i in top_p_rows))
    pending = candidate_rows
    first_round = True
    while pending:
        index = _long(pending, weights.device)
        rows_weights = weights if len(pending) == num_rows else weights[index]
        if k >= vocab // 2:
            # Wide candidate sets cost nearly a full sort anyway.
            k = vocab
            values = rows_weights.sort(dim=-1, descending=True).values
        else:
            values = rows_weights.topk(k, dim=-1, sorted=True).values
        before_top_p = threshold[index]
        if first_round:
            # k >= every top_k, so the k-th best weight is in the candidates; ties with it are kept.
            kth = torch.tensor([top_k[i] for i in pending], dtype=torch.long, device=weights.device)
            kth_value = values.gather(1, (kth - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
            before_top_p = torch.where(kth > 0, torch.maximum(before_top_p, kth_value), before_top_p)
            threshold[index] = before_top_p
            first_round = False
        nucleus = torch.tensor([top_p[i] for i in pending], dtype=torch.float64, device=weights.device)
        needs_top_p = nucleus < 1.0
        if not bool(needs_top_p.any()):
            break

        kept = torch.where(values >= before_top_p.unsqueeze(1), values, 0.0).double()
        cumulative = kept.cumsum(dim=-1)
        # Mass left after min_p/top_k: from the candidates when they hold every kept token, else a masked full sum.
        contained = (values[:, -1] < before_top_p) | (k == vocab)
        mass = cumulative[:, -1].clone()
        outside = (~contained & needs_top_p).nonzero().squeeze(1)
        if outside.numel():
            outside_weights = rows_weights[outside]
            outside_threshold = before_top_p[outside].unsqueeze(1)
            outside_mass = torch.where(outside_weights >= outside_threshold, outside_weights, 0.0).double().sum(-1)
            mass[outside] = outside_mass
        target = nucleus * mass
        # The nucleus ends at the first token whose inclusive cumulative mass reaches top_p of the kept mass.
        found = needs_top_p & ((cumulative[:, -1] >= target) | contained)
        last = (cumulative < target.unsqueeze(1)).sum(dim=-1).clamp(max=k - 1)
        top_p_value = values.gather(1, last.unsqueeze(1)).squeeze(1)
        new_threshold = torch.where(found, torch.maximum(before_top_p, top_p_value), before_top_p)
        threshold[index] = new_threshold
        pending = [row for row, again in zip(pending, (needs_top_p & ~found).tolist()) if again]
        k = next((size for size in _TOP_P_CANDIDATES if size > k), vocab)
    return threshold


def _inverse_cdf_sample(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one index per row with probability proportional to the non-negative `weights` [rows, vocab].

    Two levels so that float64 cumulative sums stay small: choose a block of _BLOCK tokens by its mass, then a token
    inside it with the remainder of the same uniform. A row without mass gets index 0.
    """
    num_rows, vocab = weights.shape
    if vocab % _BLOCK:
        weights = torch.nn.functional.pad(weights, (0, _BLOCK - vocab % _BLOCK))
    blocks = weights.reshape(num_rows, -1, _BLOCK)
    block_cumulative = blocks.sum(dim=-1).double().cumsum(dim=-1)
    total = block_cumulative[:, -1:]
    target = uniforms.unsqueeze(1) * total
    # The last block with mass bounds the choice against rounding at the top of the range.
    last_block = (block_cumulative < total).sum(dim=-1, keepdim=True)
    block = torch.minimum(torch.searchsorted(block_cumulative, target, right=True), last_block)
    previous = block_cumulative.gather(1, (block - 1).clamp(min=0))
    before = torch.where(block > 0, previous, torch.zeros_like(previous))

    inner = blocks[torch.arange(num_rows, device=weights.device), block.squeeze(1)].double().cumsum(dim=-1)
    inner_total = inner[:, -1:]
    # The block's float64 mass can differ from its float32 sum by rounding, so carry the position as a fraction.
    fraction = ((target - before) / inner_total).clamp(0.0, 1.0)
    last_token = (inner < inner_total).sum(dim=-1, keepdim=True)
    token = torch.minimum(torch.searchsorted(inner, fraction * inner_total, right=True), last_token)
    return (block * _BLOCK + token).squeeze(1)


def _gather_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, num_top: Sequence[int]) -> list[TokenLogprobs]:
    """Logprob, rank and top alternatives of each row's sampled token from the raw log-softmax."""
    token_logprob = logprobs.gather(1, sampled.unsqueeze(1))
    # vLLM's rank: how many tokens are at least as likely as the sampled one.
    ranks = (logprobs >= token_logprob).sum(dim=-1).tolist()
    most = max(num_top)
    top_ids: list[list[int]] = [[] for _ in num_top]
    top_values: list[list[float]] = [[] for _ in num_top]
    if most > 0:
        values, ids = logprobs.topk(min(most, logprobs.shape[1]), dim=-1)
        top_ids, top_values = ids.tolist(), values.tolist()
    return [
        TokenLogprobs(
            token_id=token_id,
            logprob=value,
            rank=rank,
            top_logprobs=list(zip(top_ids[j][:n], top_values[j][:n])),
        )
        for j, (token_id, value, rank, n) in enumerate(
            zip(sampled.tolist(), token_logprob.squeeze(1).tolist(), ranks, num_top)
        )
    ]
