"""Chat completions: streaming, max_completion_tokens, logprobs and the chat template's options."""

from __future__ import annotations

import pytest

from tests.openai_api.common import CHAT, EOS_ID, chat, tokenize

pytestmark = pytest.mark.serve


def test_chat_completion_streamed_equals_non_streamed(client, http):
    response = chat(client, max_tokens=10, temperature=0, ignore_eos=True)
    assert response.id.startswith("chatcmpl-")
    assert response.object == "chat.completion"
    [choice] = response.choices
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 10
    assert response.usage.prompt_tokens == tokenize(http, messages=CHAT)["count"]
    chunks = list(chat(client, max_tokens=10, temperature=0, ignore_eos=True, stream=True))
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert len({chunk.id for chunk in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(chunk.choices[0].finish_reason is None for chunk in chunks[:-1])


def test_max_completion_tokens_for_chat(client):
    response = chat(client, max_completion_tokens=4, temperature=0, ignore_eos=True)
    assert response.usage.completion_tokens == 4
    assert response.choices[0].finish_reason == "length"
    # max_completion_tokens wins over the deprecated max_tokens.
    response = chat(client, max_completion_tokens=3, max_tokens=9, temperature=0, ignore_eos=True)
    assert response.usage.completion_tokens == 3
    response = chat(client, max_tokens=6, temperature=0, ignore_eos=True)
    assert response.usage.completion_tokens == 6


def test_chat_logprobs(client):
    response = chat(client, max_tokens=5, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=4)
    choice = response.choices[0]
    content = choice.logprobs.content
    assert len(content) == 5
    assert "".join(entry.token for entry in content) == choice.message.content
    for entry in content:
        assert entry.logprob <= 0.0
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 4
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert [alt.logprob for alt in entry.top_logprobs] == sorted(
            (alt.logprob for alt in entry.top_logprobs), reverse=True
        )
    plain = chat(client, max_tokens=5, temperature=0, ignore_eos=True, logprobs=True)
    assert all(entry.top_logprobs == [] for entry in plain.choices[0].logprobs.content)
    assert chat(client, max_tokens=2, temperature=0).choices[0].logprobs is None


def test_add_generation_prompt(client, http):
    with_prompt = tokenize(http, messages=CHAT, add_generation_prompt=True)
    without = tokenize(http, messages=CHAT, add_generation_prompt=False)
    assert with_prompt["count"] > without["count"]
    assert with_prompt["tokens"][: without["count"]] == without["tokens"]
    assert chat(client, max_tokens=1).usage.prompt_tokens == with_prompt["count"]
    assert chat(client, max_tokens=1, add_generation_prompt=False).usage.prompt_tokens == without["count"]


def test_continue_final_message(client, http):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, the"}]
    closed = tokenize(http, messages=messages, add_generation_prompt=False)
    # Closed, the final message ends "<|im_end|>", "\n"; continued, the prompt stops right after "Sure, the".
    assert closed["tokens"][-2] == EOS_ID
    closed_response = chat(client, messages, max_tokens=2, add_generation_prompt=False)
    assert closed_response.usage.prompt_tokens == closed["count"]
    continued_response = chat(client, messages, max_tokens=2, add_generation_prompt=False, continue_final_message=True)
    assert continued_response.usage.prompt_tokens == closed["count"] - 2
    # /tokenize must render a chat the way chat completions will.
    continued = tokenize(http, messages=messages, add_generation_prompt=False, continue_final_message=True)
    assert continued["tokens"] == closed["tokens"][:-2]


def test_text_part_content_equals_string_content(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]
    as_parts = chat(client, parts, max_tokens=6, temperature=0, ignore_eos=True)
    as_string = chat(client, CHAT, max_tokens=6, temperature=0, ignore_eos=True)
    assert as_parts.usage.prompt_tokens == as_string.usage.prompt_tokens
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content
