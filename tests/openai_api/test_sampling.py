"""Sampling parameters, each checked for its effect on the output."""

from __future__ import annotations

import pytest

from tests.openai_api.common import (
    EOS_ID,
    PROMPT,
    REPEATING_PROMPT,
    chat,
    complete,
    greedy_text,
    single_token_id,
    stop_reason,
    tokenize,
)

pytestmark = pytest.mark.serve


def test_temperature_zero_is_deterministic(client, greedy_reference):
    assert greedy_text(client, PROMPT, max_tokens=24) == greedy_reference["text"]
    assert greedy_text(client, PROMPT, max_tokens=24) == greedy_reference["text"]
    first = chat(client, max_tokens=8, temperature=0, ignore_eos=True).choices[0].message.content
    assert chat(client, max_tokens=8, temperature=0, ignore_eos=True).choices[0].message.content == first


def test_seed_reproduces_and_differs_across_seeds(client):
    def sampled(seed: int) -> str:
        return complete(client, PROMPT, temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True).choices[0].text

    assert sampled(1234) == sampled(1234)
    assert sampled(1234) != sampled(1235)
    greedy = greedy_text(client, PROMPT, max_tokens=12)
    assert sampled(1234) != greedy


@pytest.mark.parametrize("setting", [{"top_p": 1e-6}, {"top_k": 1}, {"min_p": 1.0}])
def test_filters_that_keep_one_token_equal_greedy(client, greedy_reference, setting):
    response = complete(client, PROMPT, temperature=1.0, max_tokens=24, ignore_eos=True, **setting)
    assert response.choices[0].text == greedy_reference["text"]


def test_stop_strings(client, greedy_reference):
    text = greedy_reference["text"]
    stop = text[20:25]
    assert stop.strip() and len(text) > 30
    cut = text.find(stop)
    assert cut > 0
    for stop_value in (stop, ["\x00never\x00", stop]):
        response = complete(client, PROMPT, max_tokens=24, temperature=0, ignore_eos=True, stop=stop_value)
        choice = response.choices[0]
        assert choice.text == text[:cut]
        assert choice.finish_reason == "stop"
        assert stop_reason(choice) == stop
        assert response.usage.completion_tokens < 24
    included = complete(
        client, PROMPT, max_tokens=24, temperature=0, ignore_eos=True, stop=stop, include_stop_str_in_output=True
    )
    assert included.choices[0].text == text[: cut + len(stop)]
    assert included.choices[0].finish_reason == "stop"
    streamed = complete(client, PROMPT, max_tokens=24, temperature=0, ignore_eos=True, stop=[stop], stream=True)
    chunks = list(streamed)
    assert "".join(chunk.choices[0].text for chunk in chunks) == text[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"
    chat_text = chat(client, max_tokens=16, temperature=0, ignore_eos=True).choices[0].message.content
    chat_stop = chat_text[8:12]
    assert chat_stop.strip()
    chat_choice = chat(client, max_tokens=16, temperature=0, ignore_eos=True, stop=chat_stop).choices[0]
    assert chat_choice.message.content == chat_text[: chat_text.find(chat_stop)]
    assert chat_choice.finish_reason == "stop"


def test_stop_token_ids_end_at_first_occurrence(client, http, greedy_reference):
    tokens = greedy_reference["tokens"]
    for position in range(3, len(tokens)):
        piece = tokens[position]
        if not (piece.strip() and piece.isascii()) or piece in tokens[:position]:
            continue
        ids = tokenize(http, prompt=piece, add_special_tokens=False)["tokens"]
        if len(ids) == 1:
            break
    else:
        pytest.fail(f"no usable token in {tokens}")
    [token_id] = ids
    response = complete(
        client, PROMPT, max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[token_id], logprobs=0
    )
    choice = response.choices[0]
    assert response.usage.completion_tokens == position + 1
    assert choice.logprobs.tokens == tokens[: position + 1]
    assert choice.finish_reason == "stop"
    assert stop_reason(choice) == token_id
    assert greedy_reference["text"].startswith(choice.text)
    assert choice.text.endswith(piece)


def test_ignore_eos(client):
    # logit_bias makes EOS the certain next token.
    forced_eos = {"logit_bias": {str(EOS_ID): 100}, "max_tokens": 5, "temperature": 0}
    stopped = complete(client, PROMPT, **forced_eos)
    assert stopped.usage.completion_tokens == 1
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == ""
    ignored = complete(client, PROMPT, ignore_eos=True, **forced_eos)
    assert ignored.usage.completion_tokens == 5
    assert ignored.choices[0].finish_reason == "length"


def test_min_tokens_holds_back_stop_tokens(client, http):
    hello = single_token_id(http, " hello")
    forced = {"logit_bias": {str(hello): 100}, "stop_token_ids": [hello], "max_tokens": 10, "temperature": 0}
    at_once = complete(client, PROMPT, **forced)
    assert at_once.usage.completion_tokens == 1
    assert at_once.choices[0].text == " hello"
    assert stop_reason(at_once.choices[0]) == hello
    held = complete(client, PROMPT, min_tokens=4, **forced)
    assert held.usage.completion_tokens == 5
    assert held.choices[0].finish_reason == "stop"
    assert stop_reason(held.choices[0]) == hello
    assert held.choices[0].text.endswith(" hello")
    assert " hello" not in held.choices[0].text[: -len(" hello")]
    # EOS too is held back until min_tokens.
    eos_held = complete(client, PROMPT, logit_bias={str(EOS_ID): 100}, min_tokens=3, max_tokens=10, temperature=0)
    assert eos_held.usage.completion_tokens == 4
    assert eos_held.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "penalty", [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 1.5}]
)
def test_penalties_change_a_repeating_greedy_output(client, penalty):
    reference = complete(client, REPEATING_PROMPT, max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    tokens = reference.choices[0].logprobs.tokens
    first_repeat = next(i for i, token in enumerate(tokens) if token in tokens[:i])
    penalized = complete(
        client, REPEATING_PROMPT, max_tokens=24, temperature=0, ignore_eos=True, logprobs=0, **penalty
    ).choices[0]
    assert penalized.text != reference.choices[0].text
    assert len(set(penalized.logprobs.tokens)) > len(set(tokens))
    if "repetition_penalty" not in penalty:
        # Output penalties only touch tokens already generated: identical up to the first repeat.
        assert penalized.logprobs.tokens[:first_repeat] == tokens[:first_repeat]


def test_logit_bias_forces_a_token(client, http):
    hello = single_token_id(http, " hello")
    response = complete(client, PROMPT, logit_bias={str(hello): 100}, max_tokens=6, temperature=1.0, ignore_eos=True)
    assert response.choices[0].text == " hello" * 6
    reply = chat(client, logit_bias={str(hello): 100}, max_tokens=4, temperature=0, ignore_eos=True)
    assert reply.choices[0].message.content == " hello" * 4
    # A strong negative bias bans the greedy first token.
    first = greedy_text(client, PROMPT, max_tokens=1)
    banned = single_token_id(http, first)
    other = complete(client, PROMPT, max_tokens=1, temperature=0, logit_bias={str(banned): -100}).choices[0]
    assert other.text != first
