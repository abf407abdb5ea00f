"""Completions: response shape and usage, prompt forms, n, streaming, max_tokens, logprobs, echo and extras."""

from __future__ import annotations

import pytest

from tests.openai_api.common import CHAT, EOS_ID, MODEL, PROMPT, REPEATING_PROMPT, chat, complete, greedy_text, tokenize

pytestmark = pytest.mark.serve


def test_completion_shape_and_usage(client, http):
    response = complete(client, PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    assert response.id.startswith("cmpl-")
    assert response.object == "text_completion"
    assert response.model == MODEL
    [choice] = response.choices
    assert choice.index == 0
    assert choice.finish_reason == "length"
    assert choice.text
    prompt_tokens = tokenize(http, prompt=PROMPT)["count"]
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == 8
    assert response.usage.total_tokens == prompt_tokens + 8


def test_prompt_forms_give_one_choice_per_prompt_times_n(client, http):
    prompts = ["Once upon a time", "Hello, my name is"]
    expected = [greedy_text(client, prompt, max_tokens=5) for prompt in prompts]
    assert expected[0] != expected[1]
    token_prompts = [tokenize(http, prompt=prompt)["tokens"] for prompt in prompts]
    for form in (prompts, token_prompts):
        response = complete(client, form, n=2, max_tokens=5, temperature=0, ignore_eos=True)
        assert sorted(choice.index for choice in response.choices) == [0, 1, 2, 3]
        for choice in response.choices:
            assert choice.text == expected[choice.index // 2], choice.index
        assert response.usage.completion_tokens == 4 * 5
        assert response.usage.prompt_tokens == sum(len(tokens) for tokens in token_prompts)
    for form in (prompts[1], token_prompts[1]):
        response = complete(client, form, n=2, max_tokens=5, temperature=0, ignore_eos=True)
        assert sorted(choice.index for choice in response.choices) == [0, 1]
        assert [choice.text for choice in response.choices] == [expected[1]] * 2


def test_token_id_prompt_equals_string_prompt(client, http):
    tokens = tokenize(http, prompt=REPEATING_PROMPT)["tokens"]
    assert greedy_text(client, tokens, max_tokens=12) == greedy_text(client, REPEATING_PROMPT, max_tokens=12)


def test_n_samples_distinct_completions(client):
    # Sibling completions that finish in the same engine step must all come back: with n=3 the two gated
    # siblings always do. A short timeout, as a lost completion means the request never answers.
    quick = client.with_options(timeout=20)
    response = complete(quick, PROMPT, n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    assert sorted(choice.index for choice in response.choices) == [0, 1, 2]
    assert len({choice.text for choice in response.choices}) == 3
    assert response.usage.completion_tokens == 3 * 8
    again = complete(quick, PROMPT, n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    assert sorted((c.index, c.text) for c in again.choices) == sorted((c.index, c.text) for c in response.choices)
    chat_response = chat(quick, n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    assert sorted(choice.index for choice in chat_response.choices) == [0, 1, 2]
    assert len({choice.message.content for choice in chat_response.choices}) == 3


def test_n_2_samples_distinct_completions(client):
    response = complete(client, PROMPT, n=2, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    assert sorted(choice.index for choice in response.choices) == [0, 1]
    assert len({choice.text for choice in response.choices}) == 2
    assert response.usage.completion_tokens == 2 * 8
    single = complete(client, PROMPT, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    # Completion i draws from seed + i: the first one is the n=1 answer.
    assert [c.text for c in response.choices if c.index == 0] == [single.choices[0].text]


def test_stream_with_n_2_covers_both_indexes(client):
    expected = greedy_text(client, PROMPT, max_tokens=6)
    texts: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, str] = {}
    for chunk in complete(client, PROMPT, n=2, max_tokens=6, temperature=0, ignore_eos=True, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                assert choice.index not in finishes
                finishes[choice.index] = choice.finish_reason
    assert texts == {0: expected, 1: expected}
    assert finishes == {0: "length", 1: "length"}
    chat_texts: dict[int, str] = {0: "", 1: ""}
    for chunk in chat(client, n=2, max_tokens=6, temperature=0, ignore_eos=True, stream=True):
        for choice in chunk.choices:
            chat_texts[choice.index] += choice.delta.content or ""
    assert chat_texts[0] == chat_texts[1] != ""


def test_stream_usage_only_when_asked(client, http):
    prompt_tokens = tokenize(http, prompt=PROMPT)["count"]
    chunks = list(complete(client, PROMPT, max_tokens=5, temperature=0, ignore_eos=True, stream=True))
    assert all(chunk.usage is None for chunk in chunks)
    chunks = list(
        complete(
            client,
            PROMPT,
            n=2,
            max_tokens=5,
            temperature=0,
            ignore_eos=True,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 2 * 5
    assert chunks[-1].usage.prompt_tokens == prompt_tokens
    assert chunks[-1].usage.total_tokens == prompt_tokens + 10
    chat_chunks = list(chat(client, max_tokens=4, temperature=0, ignore_eos=True, stream=True))
    assert all(chunk.usage is None for chunk in chat_chunks)
    chat_chunks = list(
        chat(client, max_tokens=4, temperature=0, ignore_eos=True, stream=True, stream_options={"include_usage": True})
    )
    assert chat_chunks[-1].choices == []
    assert chat_chunks[-1].usage.completion_tokens == 4
    assert chat_chunks[-1].usage.prompt_tokens == tokenize(http, messages=CHAT)["count"]
    assert all(chunk.usage is None for chunk in chat_chunks[:-1])


def test_max_tokens_is_exact_with_ignore_eos(client):
    for max_tokens in (1, 7):
        response = complete(client, PROMPT, max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
        assert response.usage.completion_tokens == max_tokens
        assert len(response.choices[0].logprobs.tokens) == max_tokens
        assert response.choices[0].finish_reason == "length"


def test_completion_logprobs(client):
    for top in (0, 3):
        response = complete(client, PROMPT, max_tokens=6, temperature=0, ignore_eos=True, logprobs=top)
        choice = response.choices[0]
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
        assert len(logprobs.text_offset) == 6
        assert "".join(logprobs.tokens) == choice.text
        assert logprobs.text_offset[0] == 0
        for i in range(5):
            assert logprobs.text_offset[i + 1] == logprobs.text_offset[i] + len(logprobs.tokens[i])
        for token, token_logprob, top_logprobs in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
            assert token_logprob <= 0.0
            assert len(top_logprobs) in (max(top, 1), top + 1)
            assert top_logprobs[token] == pytest.approx(token_logprob)
            assert all(value <= 0.0 for value in top_logprobs.values())
            # Greedy picks the most likely token.
            assert token_logprob == pytest.approx(max(top_logprobs.values()))
    streamed_tokens, streamed_offsets = [], []
    for chunk in complete(client, PROMPT, max_tokens=6, temperature=0, ignore_eos=True, logprobs=2, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed_tokens += chunk.choices[0].logprobs.tokens
            streamed_offsets += chunk.choices[0].logprobs.text_offset
    assert streamed_tokens == logprobs.tokens
    assert streamed_offsets == logprobs.text_offset


def test_echo_prepends_the_prompt(client, http):
    expected = greedy_text(client, PROMPT, max_tokens=5)
    echoed = complete(client, PROMPT, echo=True, max_tokens=5, temperature=0, ignore_eos=True)
    assert echoed.choices[0].text == PROMPT + expected
    tokens = tokenize(http, prompt=PROMPT)["tokens"]
    echoed_ids = complete(client, tokens, echo=True, max_tokens=5, temperature=0, ignore_eos=True)
    assert echoed_ids.choices[0].text.startswith(PROMPT)
    chunks = list(complete(client, PROMPT, echo=True, max_tokens=5, temperature=0, ignore_eos=True, stream=True))
    assert chunks[0].choices[0].text == PROMPT
    assert "".join(chunk.choices[0].text for chunk in chunks) == PROMPT + expected


def test_skip_special_tokens(client):
    forced = {"logit_bias": {str(EOS_ID): 100}, "ignore_eos": True, "max_tokens": 3, "temperature": 0}
    shown = complete(client, PROMPT, skip_special_tokens=False, **forced)
    assert shown.choices[0].text == "<|im_end|>" * 3
    hidden = complete(client, PROMPT, **forced)
    assert "<|im_end|>" not in hidden.choices[0].text
    assert hidden.choices[0].text == ""
    chat_shown = chat(client, skip_special_tokens=False, **forced)
    assert chat_shown.choices[0].message.content == "<|im_end|>" * 3


def test_user_field_is_accepted(client):
    expected = greedy_text(client, PROMPT, max_tokens=4)
    assert greedy_text(client, PROMPT, max_tokens=4, user="user-1234") == expected
    assert chat(client, max_tokens=2, user="user-1234").usage.completion_tokens <= 2
