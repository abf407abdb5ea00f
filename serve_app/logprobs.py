"""OpenAI's two logprob shapes (completions and chat) from the sampler's TokenLogprobs."""

from __future__ import annotations

from typing import Any

from serve_app.protocol import ChatLogprobEntry, ChatLogprobs, ChatTokenLogprob, CompletionLogprobs

# JSON has no -inf (the logprob of a token the grammar masks out): vLLM's responses carry this floor instead.
LOGPROB_FLOOR = -9999.0


def json_logprob(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


class LogprobFormatter:
    """Turns token ids into their texts (cached per id) in the completion or chat logprob shape."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.token_texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self.token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self.token_texts[token_id] = text
        return text

    def completion(self, entries: list[Any], text_offset: int = 0) -> CompletionLogprobs:
        """`text_offset`: where the first token's text starts in the completion's text."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for entry in entries:
            token = self.text(entry.token_id)
            tokens.append(token)
            logprob = json_logprob(entry.logprob)
            token_logprobs.append(logprob)
            top = {self.text(token_id): json_logprob(top_logprob) for token_id, top_logprob in entry.top_logprobs}
            top.setdefault(token, logprob)
            top_logprobs.append(top)
            offsets.append(text_offset)
            text_offset += len(token)
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs, text_offset=offsets
        )

    def chat(self, entries: list[Any]) -> ChatLogprobs:
        def token_logprob(token_id: int, logprob: float) -> ChatTokenLogprob:
            token = self.text(token_id)
            return ChatTokenLogprob(token=token, logprob=json_logprob(logprob), bytes=list(token.encode()))

        content = []
        for entry in entries:
            sampled = self.text(entry.token_id)
            content.append(
                ChatLogprobEntry(
                    token=sampled,
                    logprob=json_logprob(entry.logprob),
                    bytes=list(sampled.encode()),
                    top_logprobs=[token_logprob(token_id, logprob) for token_id, logprob in entry.top_logprobs],
                )
            )
        return ChatLogprobs(content=content)
