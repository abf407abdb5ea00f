"""N-gram drafts for speculative decoding: the tokens that followed the latest earlier occurrence of a request's last
few tokens in its own prompt and output (prompt lookup decoding)."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_ITEM_BYTES = 4  # tokens are searched as int32 bytes, so `bytes.rfind` does the scan in C


def propose_ngram_drafts(token_ids: Sequence[int], num_drafts: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to `num_drafts` tokens predicted to follow `token_ids`, or [] when no suffix recurs.

    Suffixes of `max_ngram` down to `min_ngram` tokens are tried, longest first; the latest earlier occurrence of
    the first that recurs is taken. The drafts copy what followed it, running on into the drafts themselves where
    the copy reaches the end (a loop of period p continues past its last p tokens).
    """
    num_tokens = len(token_ids)
    if num_drafts < 1 or num_tokens < 2:
        return []
    data = array("i", token_ids).tobytes()
    for ngram in range(min(max_ngram, num_tokens - 1), min_ngram - 1, -1):
        suffix = data[(num_tokens - ngram) * _ITEM_BYTES :]
        # An occurrence must end before the last token: the suffix itself is not one.
        end = (num_tokens - 1) * _ITEM_BYTES
        found = data.rfind(suffix, 0, end)
        while found > 0 and found % _ITEM_BYTES:
            # Matched across token boundaries: search again left of it.
            found = data.rfind(suffix, 0, found + len(suffix) - 1)
        if found < 0 or found % _ITEM_BYTES:
            continue
        follow = found // _ITEM_BYTES + ngram
        drafts: list[int] = []
        for offset in range(num_drafts):
            source = follow + offset
            drafts.append(token_ids[source] if source < num_tokens else drafts[source - num_tokens])
        return drafts
    return []
