"""Incremental detokenization with stop strings.

Text is produced a token at a time by decoding a small window of ids and emitting only what is new, so
multi-byte UTF-8 characters split across tokens appear once complete, and BPE / SentencePiece leading spaces
come out as a full decode would produce them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

try:
    from transformers.tokenization_utils_tokenizers import TokenizersBackend
except ImportError:  # transformers 4: the fast tokenizers' base class had another name
    TokenizersBackend = None

# Prompt tokens kept as left context: SentencePiece decoders drop a leading space at the start of a decode.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


def ids_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[Sequence[int]], str]:
    """`tokenizer.decode` of a list of ids without tokenization-space clean-up. A fast tokenizer that keeps
    transformers' own decode goes straight to its Rust tokenizer: the same text, without the wrapper's
    per-call conversions, which a server pays twice per streamed token."""
    kind = type(tokenizer)
    if (
        TokenizersBackend is not None
        and isinstance(tokenizer, TokenizersBackend)
        and kind.decode is PreTrainedTokenizerBase.decode
        and kind._decode is TokenizersBackend._decode
    ):
        backend = tokenizer.backend_tokenizer
        return lambda token_ids: backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
    return lambda token_ids: tokenizer.decode(
        token_ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ):
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.token_ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""
        self.num_emitted_chars = 0
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self._decode = ids_decoder(tokenizer, skip_special_tokens)

    def add_token(self, token_id: int) -> str | None:
        """Append one generated token; returns the stop string if the text now contains one (text cut there)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        # An incomplete UTF-8 sequence decodes to U+FFFD: wait for the bytes that complete it.
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return None
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.output_text += delta
        return self._check_stop_strings(len(delta))

    def _check_stop_strings(self, delta_len: int) -> str | None:
        if not self.stop:
            return None
        # Only a match overlapping the new text is new; it can start at most max_stop_len - 1 chars earlier.
        search_from = max(0, len(self.output_text) - delta_len - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.output_text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.output_text = self.output_text[: index + len(stop) if self.include_stop_str_in_output else index]
        return stop

    def take_delta(self, finished: bool) -> str:
        """Text not handed out yet; while running, holds back a tail that could still become a stop string."""
        end = len(self.output_text)
        if not finished and self.max_stop_len > 1:
            end = max(self.num_emitted_chars, end - (self.max_stop_len - 1))
        delta = self.output_text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return delta
