"""IncrementalDetokenizer on the real SmolLM2 tokenizer: incremental text equals a full decode (multi-byte
characters split across byte-level tokens never show as U+FFFD), stop strings, and streamed deltas."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from executor.detokenizer import IncrementalDetokenizer, ids_decoder

FFFD = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@dataclass
class Run:
    detokenizer: IncrementalDetokenizer
    deltas: list[str] = field(default_factory=list)
    snapshots: list[str] = field(default_factory=list)  # output_text after every token
    stop: str | None = None
    num_tokens_used: int = 0

    @property
    def streamed(self) -> str:
        return "".join(self.deltas)


def detokenize(tokenizer: Any, prompt: str | list[int], output_ids: list[int], **options: Any) -> Run:
    """Feed output_ids one at a time the way the engine does, taking a streaming delta after each token."""
    prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    run = Run(IncrementalDetokenizer(tokenizer, prompt_ids, **options))
    for index, token_id in enumerate(output_ids):
        run.stop = run.detokenizer.add_token(token_id)
        run.num_tokens_used = index + 1
        finished = run.stop is not None or index == len(output_ids) - 1
        run.snapshots.append(run.detokenizer.output_text)
        run.deltas.append(run.detokenizer.take_delta(finished))
        if run.stop is not None:
            break
    return run


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def assert_matches_full_decode(
    tokenizer: Any, run: Run, output_ids: list[int], skip_special_tokens: bool = True
) -> None:
    expected = tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
    assert run.detokenizer.output_text == expected
    assert run.streamed == expected
    assert all(FFFD not in text for text in run.snapshots)
    assert all(FFFD not in delta for delta in run.deltas)
    # Text only ever grows: what was shown is never taken back.
    for earlier, later in zip(run.snapshots, run.snapshots[1:]):
        assert later.startswith(earlier)


# --- incremental text == full decode ----------------------------------------------------------------------------------


def test_english_with_spaces_and_punctuation(tokenizer: Any) -> None:
    text = " jumps over the lazy dog.  It's 3.14 -- isn't it?   Yes!"
    output_ids = encode(tokenizer, text)
    run = detokenize(tokenizer, "The quick brown fox", output_ids)
    assert_matches_full_decode(tokenizer, run, output_ids)
    assert run.detokenizer.output_text == text
    assert run.stop is None
    # English never needs to wait: every token's text shows at once.
    for index, snapshot in enumerate(run.snapshots):
        assert snapshot == tokenizer.decode(output_ids[: index + 1])


@pytest.mark.parametrize(
    "text",
    [
        "你好，世界！这是一个测试。",
        "🎉👍🏽 emoji 🧑‍🚀 and ë, ß, Ω",
        " 日本語のテキスト🙂と中文混合",
    ],
)
def test_multibyte_characters_split_across_tokens(tokenizer: Any, text: str) -> None:
    output_ids = encode(tokenizer, text)
    # The tokenizer really does split characters: decoding a lone token gives U+FFFD.
    assert any(FFFD in tokenizer.decode([token_id]) for token_id in output_ids)
    run = detokenize(tokenizer, "Say something:", output_ids)
    assert_matches_full_decode(tokenizer, run, output_ids)
    assert run.detokenizer.output_text == text


def test_multibyte_prompt_and_output(tokenizer: Any) -> None:
    output_ids = encode(tokenizer, "再见🎉")
    run = detokenize(tokenizer, "中文提示：你好🙂", output_ids)
    assert_matches_full_decode(tokenizer, run, output_ids)


def test_code_with_newlines_and_indentation(tokenizer: Any) -> None:
    text = 'def f(x):\n    if x:\n        return [x, {"a": 1}]\n\treturn None\n\n\nclass A:\n  pass\n'
    output_ids = encode(tokenizer, text)
    run = detokenize(tokenizer, "```python\n", output_ids)
    assert_matches_full_decode(tokenizer, run, output_ids)
    assert run.detokenizer.output_text == text


def test_long_prompt_and_empty_prompt(tokenizer: Any) -> None:
    output_ids = encode(tokenizer, " and then it ended.")
    long_prompt = " ".join(["word"] * 200)
    for prompt in (long_prompt, []):
        run = detokenize(tokenizer, prompt, output_ids)
        assert_matches_full_decode(tokenizer, run, output_ids)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens(tokenizer: Any, skip_special_tokens: bool) -> None:
    im_end, im_start = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>"])
    output_ids = [*encode(tokenizer, "Hello there"), im_end, im_start, *encode(tokenizer, "user\nHi")]
    run = detokenize(tokenizer, "<|im_start|>assistant\n", output_ids, skip_special_tokens=skip_special_tokens)
    assert_matches_full_decode(tokenizer, run, output_ids, skip_special_tokens)
    text = run.detokenizer.output_text
    if skip_special_tokens:
        assert text == "Hello thereuser\nHi"
    else:
        assert text == "Hello there<|im_end|><|im_start|>user\nHi"


def test_stop_string_on_special_token_text(tokenizer: Any) -> None:
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    output_ids = [*encode(tokenizer, "Done."), im_end, *encode(tokenizer, " more")]
    run = detokenize(tokenizer, "x", output_ids, skip_special_tokens=False, stop=["<|im_end|>"])
    assert run.stop == "<|im_end|>"
    assert run.detokenizer.output_text == "Done."
    assert run.streamed == "Done."
    skipped = detokenize(tokenizer, "x", output_ids, skip_special_tokens=True, stop=["<|im_end|>"])
    assert skipped.stop is None
    assert skipped.detokenizer.output_text == "Done. more"


# --- stop strings -----------------------------------------------------------------------------------------------------

STORY = " Once upon a time, a fox met a dog. The fox said hello. The end."


def test_stop_string_cuts_output_before_it(tokenizer: Any) -> None:
    output_ids = encode(tokenizer, STORY)
    run = detokenize(tokenizer, "Tell me a story.", output_ids, stop=["said"])
    assert run.stop == "said"
    assert run.detokenizer.output_text == " Once upon a time, a fox met a dog. The fox "
    assert run.streamed == run.detokenizer.output_text
    assert run.num_tokens_used < len(output_ids)  # reported on the token that completed it


def test_stop_string_kept_with_include_stop_str_in_output(tokenizer: Any) -> None:
    output_ids = encode(tokenizer, STORY)
    run = detokenize(tokenizer, "Tell me a story.", output_ids, stop=["said"], include_stop_str_in_output=True)
    assert run.stop == "said"
    assert run.detokenizer.output_text == " Once upon a time, a fox met a dog. The fox said"
    assert run.streamed == run.detokenizer.output_text


def test_stop_string_inside_a_token(tokenizer: Any) -> None:
    output_ids = encode(tokenizer, STORY)
    # "pon" sits inside the text of the " upon" token; the rest of that token's text is dropped too.
    run = detokenize(tokenizer, "x", output_ids, stop=["pon"])
    assert run.detokenizer.output_text == " Once u"
    run = detokenize(tokenizer, "x", output_ids, stop=["pon"], include_stop_str_in_output=True)
    assert run.detokenizer.output_text == " Once upon"
    assert run.streamed == " Once upon"


def test_earliest_of_several_stop_strings_wins(tokenizer: Any) -> None:
    output_ids = encode(tokenizer, STORY)
    run = detokenize(tokenizer, "x", output_ids, stop=["hello", "dog", "fox"])
    assert run.stop == "fox"
    assert run.detokenizer.output_text == " Once upon a time, a "
    # Both complete on the same token (" dog"): the one that starts first wins, whatever the list order.
    for stop in (["dog", "a dog"], ["a dog", "dog"]):
        run = detokenize(tokenizer, "x", output_ids, stop=stop)
        assert run.stop == "a dog"
        assert run.detokenizer.output_text == " Once upon a time, a fox met "


def test_stop_string_spanning_several_tokens(tokenizer: Any) -> None:
    output_ids = encode(tokenizer, STORY)
    stop = "fox met a dog. The"
    assert len(encode(tokenizer, " " + stop)) >= 5
    run = detokenize(tokenizer, "x", output_ids, stop=[stop])
    assert run.stop == stop
    assert run.detokenizer.output_text == " Once upon a time, a "
    assert run.streamed == " Once upon a time, a "
    # No delta ever showed the beginning of the stop string.
    assert all("fox" not in delta for delta in run.deltas)


def test_stop_string_never_leaks_through_deltas(tokenizer: Any) -> None:
    text = " alpha beta gamma delta epsilon zeta eta theta"
    output_ids = encode(tokenizer, text)
    stop = "delta epsilon"
    run = detokenize(tokenizer, "x", output_ids, stop=[stop])
    assert run.stop == stop
    assert run.detokenizer.output_text == " alpha beta gamma "
    emitted = ""
    for delta in run.deltas:
        emitted += delta
        assert "delta" not in emitted
    assert emitted == run.detokenizer.output_text


def test_held_back_text_is_released_when_the_stop_string_does_not_complete(tokenizer: Any) -> None:
    text = " the cat sat on the mat, the cat"
    output_ids = encode(tokenizer, text)
    run = detokenize(tokenizer, "x", output_ids, stop=["the dog"])
    assert run.stop is None
    assert run.detokenizer.output_text == text
    assert run.streamed == text
    # While running, at most len(stop) - 1 characters are held back.
    for index in range(len(run.deltas) - 1):
        emitted = "".join(run.deltas[: index + 1])
        assert len(run.snapshots[index]) - len(emitted) <= len("the dog") - 1


def test_stop_string_not_matched_in_the_prompt(tokenizer: Any) -> None:
    output_ids = encode(tokenizer, " and more words")
    run = detokenize(tokenizer, "STOP here STOP", output_ids, stop=["STOP"])
    assert run.stop is None
    assert run.detokenizer.output_text == " and more words"


def test_stop_string_with_multibyte_characters(tokenizer: Any) -> None:
    text = "今天天气很好🎉我们去公园吧"
    output_ids = encode(tokenizer, text)
    run = detokenize(tokenizer, "x", output_ids, stop=["🎉我们"])
    assert run.stop == "🎉我们"
    assert run.detokenizer.output_text == "今天天气很好"
    assert run.streamed == "今天天气很好"
    assert all(FFFD not in delta for delta in run.deltas)


def test_single_character_stop_string_streams_without_holdback(tokenizer: Any) -> None:
    output_ids = encode(tokenizer, " one two; three")
    run = detokenize(tokenizer, "x", output_ids, stop=[";"])
    assert run.stop == ";"
    assert run.detokenizer.output_text == " one two"
    # Nothing to hold back for a 1-char stop string: each delta is that token's full text.
    assert run.deltas[:2] == [" one", " two"]


# --- the decode it calls -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_rust_decode_gives_transformers_text_on_random_ids(tokenizer: Any, skip_special_tokens: bool) -> None:
    """SmolLM2's tokenizer takes the direct path; random windows of ids (special tokens and split UTF-8 bytes
    among them) decode to what `tokenizer.decode` gives."""
    decode = ids_decoder(tokenizer, skip_special_tokens)
    assert decode.__code__.co_names == ("decode",) and "backend" in decode.__code__.co_freevars
    generator = random.Random(5)
    specials = tokenizer.all_special_ids
    for _ in range(200):
        ids = [generator.randrange(tokenizer.vocab_size) for _ in range(generator.randrange(1, 9))]
        ids.insert(generator.randrange(len(ids) + 1), generator.choice(specials))
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
        assert decode(ids) == expected


def test_a_tokenizer_with_its_own_decode_keeps_it(tokenizer: Any) -> None:
    """A tokenizer class that overrides `_decode` is asked through `decode`, so its override applies."""

    class Shouting(type(tokenizer)):
        def _decode(self, token_ids: Any, **kwargs: Any) -> str:
            return super()._decode(token_ids, **kwargs).upper()

    shouting = copy.copy(tokenizer)
    shouting.__class__ = Shouting
    run = detokenize(shouting, "Say", encode(tokenizer, " hello there"))
    assert run.streamed == " HELLO THERE"
