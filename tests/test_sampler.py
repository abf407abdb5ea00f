"""Sampler behaviour: greedy, temperature / top_k / top_p / min_p, seeds, penalties, bias, min_tokens, logprobs."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from configs.sampling_params import SamplingParams
from model_executor.sampler import Sampler, SamplingRow, _drop_thresholds

EOS = 3


@pytest.fixture(autouse=True)
def _seed_global_rng() -> None:
    # Unseeded rows draw from the global generator; pin it so failures reproduce.
    torch.manual_seed(1234)


def make_row(params: SamplingParams, prompt: Sequence[int] = (1, 2), output: Sequence[int] = ()) -> SamplingRow:
    """Build a row the way the model runner does, including a fresh generator for seeded requests."""
    generator = None
    if params.seed is not None:
        generator = torch.Generator()
        generator.manual_seed(params.seed)
    return SamplingRow(params=params, prompt_token_ids=list(prompt), output_token_ids=list(output), generator=generator)


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow], eos: Sequence[int] = (EOS,)) -> list[int]:
    return Sampler(eos)(logits.clone(), rows).sampled_token_ids


def logits_from_probs(probs: Sequence[float], vocab: int, positions: Sequence[int]) -> torch.Tensor:
    """One row of logits whose softmax puts probs[i] on token positions[i] and nothing elsewhere."""
    logits = torch.full((vocab,), float("-inf"))
    logits[list(positions)] = torch.tensor(probs).log()
    return logits


def draw_many(logits_row: torch.Tensor, params: SamplingParams, draws: int) -> Counter[int]:
    """Sample `draws` independent tokens from one distribution as one unseeded batch."""
    rows = [make_row(params) for _ in range(draws)]
    return Counter(sample(logits_row.expand(draws, -1), rows))


# --- greedy -----------------------------------------------------------------------------------------------------------


def test_greedy_is_argmax_and_fast_path_reports_no_logprobs() -> None:
    logits = torch.randn(8, 5000)
    out = Sampler([EOS])(logits.clone(), [make_row(SamplingParams(temperature=0.0)) for _ in range(8)])
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8


def test_greedy_ties_take_the_first_maximum_as_argmax_does() -> None:
    # Logits rounded to a few values: most rows hold their maximum several times, at positions past the vector width.
    logits = (torch.randn(64, 49152, generator=torch.Generator().manual_seed(3)) * 2).round().clamp(max=6.0)
    logits[5, 40000:] = 9.0  # the maximum only in a long run at the end
    logits[6, :] = 1.0  # every entry equal
    first_maximum = [row.tolist().index(row.max().item()) for row in logits]
    assert sum(1 for row in logits if (row == row.max()).sum() > 1) >= 60
    greedy = [make_row(SamplingParams(temperature=0.0)) for _ in range(64)]
    assert Sampler([EOS])(logits.clone(), greedy).sampled_token_ids == first_maximum
    # The mixed path (a random row beside greedy ones) takes the same index for its greedy rows.
    mixed = [*greedy[:63], make_row(SamplingParams(temperature=1.0, seed=1))]
    assert Sampler([EOS])(logits.clone(), mixed).sampled_token_ids[:63] == first_maximum[:63]
    assert first_maximum == logits.argmax(dim=-1).tolist()


def test_greedy_rows_are_unaffected_by_their_neighbours() -> None:
    logits = torch.randn(6, 3000)
    greedy = SamplingParams(temperature=0.0)
    noisy = [
        SamplingParams(temperature=1.3, top_p=0.5),
        SamplingParams(temperature=0.7, presence_penalty=1.5, logit_bias={7: 50.0}),
        SamplingParams(temperature=1.0, top_k=3, seed=9, logprobs=4),
    ]
    rows = [make_row(greedy), make_row(noisy[0], output=[5, 6]), make_row(greedy)]
    rows += [make_row(noisy[1], output=[5]), make_row(greedy), make_row(noisy[2])]
    sampled = sample(logits, rows)
    expected = logits.argmax(dim=-1)
    assert [sampled[i] for i in (0, 2, 4)] == [expected[i].item() for i in (0, 2, 4)]


# --- temperature and the filters --------------------------------------------------------------------------------------


def test_random_sampling_follows_the_tempered_softmax() -> None:
    # 700 tokens: the vocabulary is not a multiple of the sampler's block width, so the padded tail is exercised too.
    vocab, draws, temperature = 700, 20000, 0.7
    logits = torch.full((vocab,), -20.0)
    heavy = [0, 255, 256, 511, 699]
    logits[heavy] = torch.tensor([1.0, 0.5, 0.0, -0.5, 0.8])
    probs = torch.softmax(logits / temperature, dim=-1)
    counts = draw_many(logits, SamplingParams(temperature=temperature), draws)
    assert set(counts) <= set(heavy)
    for token in heavy:
        p = probs[token].item()
        sigma = math.sqrt(draws * p * (1 - p))
        assert abs(counts[token] - draws * p) < 5 * sigma, (token, counts[token], draws * p)


def test_top_k_only_ever_draws_the_k_best() -> None:
    logits = torch.randn(2000)
    best = set(logits.topk(5).indices.tolist())
    counts = draw_many(logits * 0.2, SamplingParams(temperature=1.0, top_k=5), 3000)
    assert set(counts) == best


def test_top_p_keeps_exactly_the_nucleus() -> None:
    vocab = 1000
    positions = [700, 3, 450, 999, 64]
    # Cumulative mass 0.5, 0.7, 0.85 >= 0.8: the nucleus is the first three tokens.
    logits = logits_from_probs([0.5, 0.2, 0.15, 0.1, 0.05], vocab, positions)
    counts = draw_many(logits, SamplingParams(temperature=1.0, top_p=0.8), 3000)
    assert set(counts) == {700, 3, 450}
    # Renormalised inside the nucleus: 0.5 / 0.85 of the draws land on the top token.
    assert abs(counts[700] / 3000 - 0.5 / 0.85) < 0.04


def test_wide_top_p_nucleus_beyond_the_candidate_sets() -> None:
    # A nearly flat distribution whose nucleus holds thousands of tokens forces the full-sort fallback.
    vocab = 6000
    logits = -torch.arange(vocab, dtype=torch.float32) / 3000.0
    logits = logits[torch.randperm(vocab)]
    probs = torch.softmax(logits, dim=-1)
    ordered = probs.sort(descending=True)
    nucleus_size = int((ordered.values.cumsum(0) < 0.5).sum()) + 1
    assert nucleus_size > 1024
    nucleus = set(ordered.indices[:nucleus_size].tolist())
    counts = draw_many(logits, SamplingParams(temperature=1.0, top_p=0.5), 4000)
    assert set(counts) <= nucleus
    # The least likely tenth of the nucleus is still reachable, so the cut is not too tight.
    tail = set(ordered.indices[nucleus_size - nucleus_size // 10 : nucleus_size].tolist())
    assert set(counts) & tail


def test_min_p_drops_tokens_below_the_relative_threshold() -> None:
    vocab = 500
    positions = [10, 20, 30, 40, 50]
    # min_p 0.2 of the top probability 0.4 is 0.08: tokens at 0.06 and 0.04 must never appear.
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.06, 0.04], vocab, positions)
    counts = draw_many(logits, SamplingParams(temperature=1.0, min_p=0.2), 3000)
    assert set(counts) == {10, 20, 30}


def reference_kept(logits_row: torch.Tensor, params: SamplingParams) -> set[int]:
    """vLLM's order on the full sorted distribution: min_p, then top_k, then top_p on what is left."""
    probs = torch.softmax(logits_row / params.temperature, dim=-1).double()
    keep = probs >= params.min_p * probs.max()
    order = probs.argsort(descending=True)
    if params.top_k:
        keep[order[params.top_k :]] = False
    kept_probs = torch.where(keep, probs, 0.0)
    sorted_kept = kept_probs[order]
    exclusive = sorted_kept.cumsum(0) - sorted_kept
    in_nucleus = (exclusive < params.top_p * sorted_kept.sum()) & (sorted_kept > 0)
    return set(order[in_nucleus].tolist())


@pytest.mark.parametrize("vocab", [50, 3000])
def test_filter_thresholds_match_a_full_sort_reference(vocab: int) -> None:
    configs = [
        SamplingParams(top_k=7),
        SamplingParams(top_p=0.3),
        SamplingParams(top_p=0.97, temperature=2.0),
        SamplingParams(min_p=0.05),
        SamplingParams(top_k=40, top_p=0.6, min_p=0.01),
        SamplingParams(top_k=20, top_p=0.99),
        SamplingParams(temperature=0.5),
        # min_p keeps more tokens than the first candidate set: the kept mass needs a full-vocabulary sum.
        SamplingParams(top_p=0.3, min_p=0.01),
        SamplingParams(top_p=0.95, min_p=0.3),
    ]
    logits = torch.randn(len(configs), vocab) * 2.0
    temperature = torch.tensor([p.temperature for p in configs]).unsqueeze(1)
    weights = torch.exp(logits / temperature - (logits / temperature).amax(dim=-1, keepdim=True))
    threshold = _drop_thresholds(weights, configs)
    assert threshold is not None
    for i, params in enumerate(configs):
        kept = set((weights[i] >= threshold[i]).nonzero().squeeze(1).tolist())
        assert kept == reference_kept(logits[i], params), params


# --- seeds ------------------------------------------------------------------------------------------------------------


def run_steps(seed_params: SamplingParams, logits: torch.Tensor, position: int, neighbours: int) -> list[int]:
    """Sample one seeded request for several steps at `position` among unseeded neighbours; return its tokens."""
    target = make_row(seed_params)
    tokens = []
    for step in range(logits.shape[0]):
        rows = [make_row(SamplingParams(temperature=1.0, top_p=0.9)) for _ in range(neighbours)]
        rows.insert(position, target)
        batch = torch.randn(len(rows), logits.shape[1])
        batch[position] = logits[step]
        tokens.append(sample(batch, rows)[position])
        target.output_token_ids = [*target.output_token_ids, tokens[-1]]
    return tokens


def test_same_seed_gives_same_tokens_whatever_the_batch() -> None:
    logits = torch.randn(6, 4000) * 0.5
    params = SamplingParams(temperature=1.0, seed=42)
    alone = run_steps(params, logits, position=0, neighbours=0)
    assert run_steps(params, logits, position=0, neighbours=0) == alone
    assert run_steps(params, logits, position=3, neighbours=5) == alone
    assert run_steps(params, logits, position=1, neighbours=1) == alone
    filtered = SamplingParams(temperature=0.9, top_k=50, top_p=0.8, seed=42)
    assert run_steps(filtered, logits, position=0, neighbours=0) == run_steps(filtered, logits, 2, 4)


def test_different_seeds_draw_differently() -> None:
    flat = torch.zeros(5, 1000)
    first = run_steps(SamplingParams(seed=1), flat, position=0, neighbours=0)
    second = run_steps(SamplingParams(seed=2), flat, position=0, neighbours=0)
    assert first != second
    assert len(set(first)) > 1


def test_seeded_generator_advances_across_steps() -> None:
    flat = torch.zeros(1, 1000)
    row = make_row(SamplingParams(seed=5))
    tokens = [sample(flat, [row])[0] for _ in range(5)]
    assert len(set(tokens)) > 1


# --- logits processors ------------------------------------------------------------------------------------------------


def test_penalties_follow_the_formulas() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0, 4.0, -0.5, 3.0, 1.5]] * 2)
    prompt, output = [0, 1, 9], [2, 2, 3, 1]
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.25)
    rows = [make_row(params, prompt, output), make_row(SamplingParams(), prompt, output)]
    processed = Sampler([EOS]).apply_logits_processors(logits.clone(), rows)

    expected = logits[0].clone()
    for token in set(prompt) | set(output):
        value = expected[token]
        expected[token] = value / 1.5 if value > 0 else value * 1.5
    for token, count in Counter(output).items():
        expected[token] -= 0.4 * count + 0.25
    torch.testing.assert_close(processed[0], expected)
    # A row without penalties in the same batch is left alone.
    torch.testing.assert_close(processed[1], logits[1])


def test_penalties_flip_the_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.5, 0.0]])
    # Token 1 was generated twice: 5.0 - 2 * 0.5 - 0 > 4.5 fails only once presence adds 0.1.
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.1)
    assert sample(logits, [make_row(params, output=[1, 1])], eos=[]) == [2]
    assert sample(logits, [make_row(SamplingParams(temperature=0.0), output=[1, 1])], eos=[]) == [1]
    # Repetition penalty 1.2 on a prompt token: 5.0 / 1.2 = 4.17 < 4.5.
    params = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    assert sample(logits, [make_row(params, prompt=[1])], eos=[]) == [2]
    assert sample(logits, [make_row(params, prompt=[0])], eos=[]) == [1]


def test_negative_logits_are_multiplied_by_the_repetition_penalty() -> None:
    logits = torch.tensor([[-1.0, -1.1, -5.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    processed = Sampler([]).apply_logits_processors(logits.clone(), [make_row(params, prompt=[0], output=[0])])
    torch.testing.assert_close(processed, torch.tensor([[-2.0, -1.1, -5.0]]))


def test_logit_bias_forces_a_token() -> None:
    logits = torch.randn(3, 800)
    rows = [
        make_row(SamplingParams(temperature=0.0, logit_bias={123: 100.0})),
        make_row(SamplingParams(temperature=1.0, logit_bias={77: 100.0, 5: -100.0})),
        make_row(SamplingParams(temperature=1.0, logit_bias={77: 100.0}, seed=3)),
    ]
    assert sample(logits, rows) == [123, 77, 77]
    # A large negative bias bans the favourite.
    favourite = int(logits[0].argmax())
    banned = make_row(SamplingParams(temperature=0.0, logit_bias={favourite: -100.0}))
    assert sample(logits[:1], [banned]) != [favourite]


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached() -> None:
    vocab, stop = 20, 11
    logits = torch.zeros(1, vocab)
    logits[0, EOS], logits[0, stop], logits[0, 4] = 10.0, 9.0, 1.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop])
    assert sample(logits, [make_row(params, output=[4, 4])]) == [4]
    assert sample(logits, [make_row(params, output=[4, 4, 4])]) == [EOS]
    # EOS stays suppressed under ignore_eos; the stop token is then the favourite once EOS is gone.
    ignoring = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert sample(logits, [make_row(ignoring, output=[4])]) == [stop]
    # Random rows never draw a suppressed token either.
    random_params = SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[stop])
    counts = draw_many(logits[0], random_params, 500)
    assert EOS not in counts and stop not in counts


def test_min_tokens_covers_every_eos_id() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 7], logits[0, 8], logits[0, 1] = 5.0, 4.0, 1.0
    params = SamplingParams(temperature=0.0, min_tokens=1)
    assert sample(logits, [make_row(params)], eos=[7, 8]) == [1]


# --- logprobs ---------------------------------------------------------------------------------------------------------


def test_logprobs_come_from_the_raw_logits() -> None:
    vocab = 20
    logits = torch.randn(3, vocab) * 2
    raw = torch.log_softmax(logits, dim=-1)
    rows = [
        make_row(SamplingParams(temperature=0.0, logprobs=vocab)),
        # Bias and penalties change the choice, not the reported distribution.
        make_row(SamplingParams(temperature=1.0, logprobs=3, logit_bias={4: 100.0}, presence_penalty=2.0), output=[4]),
        make_row(SamplingParams(temperature=0.5, logprobs=0)),
    ]
    out = Sampler([EOS])(logits.clone(), rows)
    for i, entry in enumerate(out.logprobs):
        assert entry is not None
        token = out.sampled_token_ids[i]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(raw[i, token].item(), abs=1e-5)
        # No ties in random normal logits: rank is one plus the number of strictly more likely tokens.
        assert entry.rank == 1 + int((raw[i] > raw[i, token]).sum())
        assert len(entry.top_logprobs) == rows[i].params.logprobs
        values = [value for _, value in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        for token_id, value in entry.top_logprobs:
            assert value == pytest.approx(raw[i, token_id].item(), abs=1e-5)
    assert out.sampled_token_ids[1] == 4
    top = out.logprobs[0]
    assert top is not None and top.rank == 1
    assert [t for t, _ in top.top_logprobs] == raw[0].argsort(descending=True).tolist()
    assert sum(math.exp(value) for _, value in top.top_logprobs) == pytest.approx(1.0, abs=1e-5)


def test_logprobs_rank_of_an_unlikely_draw() -> None:
    vocab = 1000
    logits = torch.randn(1, vocab) * 0.1
    row = make_row(SamplingParams(temperature=1.0, logprobs=5, seed=11))
    out = Sampler([EOS])(logits.clone(), [row])
    entry = out.logprobs[0]
    assert entry is not None
    token = out.sampled_token_ids[0]
    assert entry.rank == int((logits[0] >= logits[0, token]).sum())
    assert entry.rank > 5  # a near-flat distribution almost never samples its top five
    assert len(entry.top_logprobs) == 5


# --- mixed batches ----------------------------------------------------------------------------------------------------


def mixed_params() -> list[tuple[SamplingParams, list[int]]]:
    """(params, output so far) for one row of each kind."""
    return [
        (SamplingParams(temperature=0.0), [1, 2]),
        (SamplingParams(temperature=0.8, seed=7), [3]),
        (SamplingParams(temperature=0.9, top_p=0.7, seed=8, logprobs=2), []),
        (SamplingParams(temperature=0.0, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3), [5, 5]),
        (SamplingParams(temperature=1.2, top_k=10, min_p=0.02, seed=9, logit_bias={6: 2.0}), [6]),
        (SamplingParams(temperature=0.0, logprobs=5, min_tokens=4), [EOS, 1]),
        (SamplingParams(temperature=1.0, top_k=3, top_p=0.9, seed=10, repetition_penalty=1.5, logprobs=1), [8, 9]),
    ]


def test_mixed_batch_matches_each_row_alone() -> None:
    vocab = 3000
    specs = mixed_params()
    logits = torch.randn(len(specs), vocab) * 2
    logits[:, EOS] += 6.0  # make the min_tokens row's suppression matter
    batch = Sampler([EOS])(logits.clone(), [make_row(p, output=o) for p, o in specs])
    for i, (params, output) in enumerate(specs):
        alone = Sampler([EOS])(logits[i : i + 1].clone(), [make_row(params, output=output)])
        assert batch.sampled_token_ids[i] == alone.sampled_token_ids[0], params
        assert batch.logprobs[i] == alone.logprobs[0], params
    assert batch.sampled_token_ids[5] != EOS
    assert [entry is None for entry in batch.logprobs] == [p.logprobs is None for p, _ in specs]


def test_rejects_mismatched_rows() -> None:
    with pytest.raises(ValueError):
        Sampler([EOS])(torch.zeros(2, 10), [make_row(SamplingParams())])
