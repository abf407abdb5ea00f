"""Synthetic workloads: deterministic word prompts (optionally behind a shared prefix), random-token prompts, and
Poisson arrival schedules. No dataset download, no torch at import."""

from __future__ import annotations

import math
import random

# Common English words, so prompts tokenize to ordinary tokens in every tokenizer.
COMMON_WORDS = (
    "the of and to in is was for on that with as by at from his her an were are which this be or had not but one "
    "all their they have has been who its when more there will would can about into out other than time people "
    "year way day man thing woman life child world school state family student group country problem hand part "
    "place case week company system program question work government number night point home water room mother "
    "area money story fact month lot right study book eye job word business issue side kind head house service "
    "friend father power hour game line end member law car city community name president team minute idea kid "
    "body information back parent face others level office door health person art war history party result "
    "change morning reason research girl guy moment air teacher force education river market garden winter "
    "engine letter music forest window doctor summer bridge island mountain village ocean station library"
)
WORDS = COMMON_WORDS.split()


def synthetic_prompts(num_prompts: int, input_len: int, seed: int, shared_prefix_words: int = 0) -> list[str]:
    """Deterministic prompts of random common words: the same shared prefix (if any), then `input_len` words."""
    rng = random.Random(seed)
    prefix = [rng.choice(WORDS) for _ in range(shared_prefix_words)]
    return [" ".join(prefix + [rng.choice(WORDS) for _ in range(input_len)]) for _ in range(num_prompts)]


def output_length_bounds(output_len: int, range_ratio: float) -> tuple[int, int]:
    """The smallest and largest max_tokens a request may draw: floor(output_len * (1 - r)) (at least 1) and
    ceil(output_len * (1 + r)), both included, as vllm's --random-range-ratio bounds them."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    # Floating-point noise rounded away first: 100 tokens at 0.1 reach 110, not 111.
    low = max(1, math.floor(round(output_len * (1 - range_ratio), 9)))
    high = max(1, math.ceil(round(output_len * (1 + range_ratio), 9)))
    return low, high


def output_lengths(num_requests: int, output_len: int, range_ratio: float, seed: int) -> list[int]:
    """Each request's max_tokens: `output_len` for all at ratio 0, else uniform integers within
    `output_length_bounds`."""
    low, high = output_length_bounds(output_len, range_ratio)
    if low == high:
        return [low] * num_requests
    # A generator of its own, so neither the prompts nor the arrival schedule change with the ratio.
    rng = random.Random(seed + 2)
    return [rng.randint(low, high) for _ in range(num_requests)]


def random_token_prompts(
    counts: list[int], input_len: int, seed: int = 0, vocab_size: int = 49152
) -> dict[int, list[list[int]]]:
    """count -> that many prompts of `input_len` random token ids (ids 0-2 left out: special tokens in SmolLM2's
    vocabulary), drawn from one seeded generator in the order of `counts`."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return {
        count: [torch.randint(3, vocab_size, (input_len,), generator=generator).tolist() for _ in range(count)]
        for count in counts
    }


def arrival_gaps(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait before sending each request: zeros at rate inf, else the first at once and exponential gaps
    (Poisson arrivals) after it, as vllm schedules them."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if request_rate <= 0:
        raise ValueError(f"request rate must be positive or inf, got {request_rate}")
    # A generator of its own, so the schedule doesn't depend on how many words the prompts drew.
    rng = random.Random(seed + 1)
    return [0.0] + [rng.expovariate(request_rate) for _ in range(num_requests - 1)] if num_requests else []
