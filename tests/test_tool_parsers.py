"""Tool-call parsers (serve_app/tool_parsers.py): what `parse` makes of whole outputs, and that streaming the same
output in any split (every character, seeded random chunks) sends the same content, names and arguments."""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from serve_app.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    NamedToolCallParser,
    ParsedOutput,
    RequiredToolCallsParser,
    ToolParser,
    tool_parser,
)

CALL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")
WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'
WEATHER_BLOCK = f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}\n</tool_call>'
TIME_BLOCK = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
WEATHER = ("get_weather", WEATHER_ARGS)
TIME = ("get_time", '{"zone": "CET"}')
# Braces, brackets, quotes, escapes and both hermes tags inside strings; numbers and literals.
TRICKY_ARGS = (
    '{"path": "a}b.txt", "text": "say \\"hi\\" <tool_call> </tool_call> {[\\\\", '
    '"opts": {"deep": [1, {"x": "]"}], "empty": {}}, "n": -1.5e3, "ok": true, "none": null}'
)
UNICODE_ARGS = '{"ville": "Zürich 🌧", "note": "caf\\u00e9"}'


@dataclass
class Streamed:
    content: str = ""
    calls: list[list[str]] = field(default_factory=list)  # [id, name, arguments] per index
    tool_calls_seen: bool = False


def stream_text(parser: ToolParser, text: str, cuts: list[int]) -> Streamed:
    """Feeds text[:cut] for each cut, then the whole text as final, checking each call's id/name come once, first."""
    stream = parser.stream()
    streamed = Streamed()
    feeds = [(text[:cut], False) for cut in cuts] + [(text, True)]
    for prefix, final in feeds:
        delta = stream.feed(prefix, final)
        streamed.content += delta.content
        for piece in delta.tool_calls:
            if piece.index == len(streamed.calls):
                assert piece.id is not None and piece.name is not None, piece
                streamed.calls.append([piece.id, piece.name, piece.arguments])
            else:
                assert piece.index < len(streamed.calls), piece
                assert piece.id is None and piece.name is None, piece
                streamed.calls[piece.index][2] += piece.arguments
    streamed.tool_calls_seen = stream.tool_calls_seen
    return streamed


def chunkings(text: str) -> Iterator[tuple[str, list[int]]]:
    yield "whole", []
    yield "every character", list(range(1, len(text) + 1))
    rng = random.Random(len(text))
    for attempt in range(6 if text else 0):
        # Repeated cuts feed the same prefix twice: nothing new must come of it.
        cuts = sorted(rng.choices(range(1, len(text) + 1), k=rng.randint(1, max(1, len(text) // 3))))
        yield f"random chunks {attempt}", cuts


def assert_streams_match_parse(parser: ToolParser, text: str) -> ParsedOutput:
    parsed = parser.parse(text)
    for label, cuts in chunkings(text):
        streamed = stream_text(parser, text, cuts)
        assert streamed.content == (parsed.content or ""), label
        assert [(name, arguments) for _, name, arguments in streamed.calls] == [
            (call.name, call.arguments) for call in parsed.tool_calls
        ], label
        assert streamed.tool_calls_seen == bool(parsed.tool_calls), label
        assert all(CALL_ID.fullmatch(call_id) for call_id, _, _ in streamed.calls), label
    for call in parsed.tool_calls:
        assert CALL_ID.fullmatch(call.id)
        assert isinstance(json.loads(call.arguments), dict)
    assert len({call.id for call in parsed.tool_calls}) == len(parsed.tool_calls)
    if not parsed.tool_calls:
        assert parsed.content == text
    return parsed


Case = tuple[Callable[[], ToolParser], str, str | None, list[tuple[str, str]]]
CASES: dict[str, Case] = {
    "hermes single call": (HermesToolParser, WEATHER_BLOCK, None, [WEATHER]),
    "hermes two calls": (HermesToolParser, f"{WEATHER_BLOCK}\n{TIME_BLOCK}", None, [WEATHER, TIME]),
    "hermes content before calls": (
        HermesToolParser,
        f"Let me look that up.\n\n{WEATHER_BLOCK}\n{TIME_BLOCK}\n",
        "Let me look that up.",
        [WEATHER, TIME],
    ),
    "hermes content between and after calls": (
        HermesToolParser,
        f"  First.\n{WEATHER_BLOCK}\nThen. \n{TIME_BLOCK}\n\n",
        "  First.\nThen.",
        [WEATHER, TIME],
    ),
    "hermes no calls": (HermesToolParser, "Hello! How can I help?\n\n", "Hello! How can I help?\n\n", []),
    "hermes tag-like text is content": (
        HermesToolParser,
        "Use <tool_c, </tool_call> or <tool> freely, even at the end <tool_call",
        "Use <tool_c, </tool_call> or <tool> freely, even at the end <tool_call",
        [],
    ),
    "hermes empty output": (HermesToolParser, "", "", []),
    "hermes invalid JSON in block": (
        HermesToolParser,
        "Sure.\n<tool_call>\nnot json\n</tool_call>",
        "Sure.\n<tool_call>\nnot json\n</tool_call>",
        [],
    ),
    "hermes arguments not an object": (
        HermesToolParser,
        '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
        [],
    ),
    "hermes missing name": (
        HermesToolParser,
        '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',
        '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',
        [],
    ),
    "hermes nested and tricky strings": (
        HermesToolParser,
        f'<tool_call>\n{{"name": "write_file", "arguments": {TRICKY_ARGS}}}\n</tool_call>',
        None,
        [("write_file", TRICKY_ARGS)],
    ),
    "hermes unicode": (
        HermesToolParser,
        f'Voilà 👋 <tool_call>\n{{"name": "météo", "arguments": {UNICODE_ARGS}}}\n</tool_call>',
        "Voilà 👋",
        [("météo", UNICODE_ARGS)],
    ),
    "hermes arguments before name, extra key, compact": (
        HermesToolParser,
        '<tool_call>{"arguments":{"a":[1,2]},"id":7,"name":"f"}</tool_call>',
        None,
        [("f", '{"a":[1,2]}')],
    ),
    "hermes closing tag never came": (
        HermesToolParser,
        f'{WEATHER_BLOCK}<tool_call>\n{{"name": "f", "arguments": {{"a": 1}}}}\n</tool_',
        None,
        [WEATHER, ("f", '{"a": 1}')],
    ),
    "hermes cut before the second call's name": (
        HermesToolParser,
        f'{WEATHER_BLOCK}\n<tool_call>\n{{"name": "get_ti',
        '\n<tool_call>\n{"name": "get_ti',
        [WEATHER],
    ),
    "hermes cut before the only call's name": (
        HermesToolParser,
        'Hi <tool_call>\n{"na',
        'Hi <tool_call>\n{"na',
        [],
    ),
    "llama3 with python tag": (
        Llama3JsonToolParser,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        None,
        [WEATHER],
    ),
    "llama3 without python tag": (
        Llama3JsonToolParser,
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        None,
        [WEATHER],
    ),
    "llama3 two calls": (
        Llama3JsonToolParser,
        '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": "z;w}"}}',
        None,
        [("a", '{"x": 1}'), ("b", '{"y": "z;w}"}')],
    ),
    "llama3 arguments key": (Llama3JsonToolParser, '{"name": "a", "arguments": {"x": 1}}', None, [("a", '{"x": 1}')]),
    "llama3 spaces around tag, trailing semicolon": (
        Llama3JsonToolParser,
        ' \n<|python_tag|> {"name": "a", "parameters": {}};\n',
        None,
        [("a", "{}")],
    ),
    "llama3 tricky strings": (
        Llama3JsonToolParser,
        f'{{"name": "write_file", "parameters": {TRICKY_ARGS}}}',
        None,
        [("write_file", TRICKY_ARGS)],
    ),
    "llama3 plain text": (
        Llama3JsonToolParser,
        "The weather in Paris is sunny.",
        "The weather in Paris is sunny.",
        [],
    ),
    "llama3 JSON that is not a call": (Llama3JsonToolParser, '{"answer": 42}', '{"answer": 42}', []),
    "llama3 text starting like the tag": (Llama3JsonToolParser, "<|pyt hon", "<|pyt hon", []),
    "llama3 tag alone": (Llama3JsonToolParser, "<|python_tag|>", "<|python_tag|>", []),
    "required one call": (
        RequiredToolCallsParser,
        '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}]',
        None,
        [WEATHER],
    ),
    "required two calls": (
        RequiredToolCallsParser,
        '[{"name":"a","parameters":{"x":1}},{"name":"b","parameters":{"y":[1,"]"]}}]',
        None,
        [("a", '{"x":1}'), ("b", '{"y":[1,"]"]}')],
    ),
    "required empty array": (RequiredToolCallsParser, "[]", "[]", []),
    "named": (lambda: NamedToolCallParser("get_weather"), WEATHER_ARGS, None, [WEATHER]),
    "named with whitespace around": (
        lambda: NamedToolCallParser("write_file"),
        f" \n{TRICKY_ARGS}\n",
        None,
        [("write_file", TRICKY_ARGS)],
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_parse_and_every_stream_agree(case: str) -> None:
    make_parser, text, content, calls = CASES[case]
    parsed = assert_streams_match_parse(make_parser(), text)
    assert parsed.content == content
    assert [(call.name, call.arguments) for call in parsed.tool_calls] == calls


def test_arguments_stream_as_they_arrive_and_the_name_only_whole() -> None:
    stream = HermesToolParser().stream()
    head = "Let me check <tool_call>\n"
    delta = stream.feed(head + '{"name": "get_wea', final=False)
    assert (delta.content, delta.tool_calls) == ("Let me check", [])
    delta = stream.feed(head + '{"name": "get_weather", "arguments": {"city": "Par', final=False)
    [first] = delta.tool_calls
    assert (first.index, first.name, first.arguments) == (0, "get_weather", '{"city": "Par')
    assert CALL_ID.fullmatch(first.id)
    [more] = stream.feed(head + '{"name": "get_weather", "arguments": {"city": "Paris"}', final=False).tool_calls
    assert (more.index, more.id, more.name, more.arguments) == (0, None, None, 'is"}')
    assert stream.tool_calls_seen


def test_partial_tag_is_held_back_until_known() -> None:
    stream = HermesToolParser().stream()
    assert stream.feed("Hi <tool", final=False).content == "Hi"
    assert stream.feed("Hi <tool_call>\n", final=False).content == ""
    stream = HermesToolParser().stream()
    assert stream.feed("Hi <tool", final=False).content == "Hi"
    assert stream.feed("Hi <tools", final=False).content == " <tools"


def test_call_broken_after_it_was_sent() -> None:
    """Invalid JSON found once the call has started streaming: parse gives plain content, the stream cannot."""
    text = '<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>'
    assert HermesToolParser().parse(text) == ParsedOutput(text, [])
    streamed = stream_text(HermesToolParser(), text, list(range(1, len(text) + 1)))
    assert streamed.tool_calls_seen
    [[_, name, arguments]] = streamed.calls
    assert name == "f" and '{"a": }'.startswith(arguments)
    assert text.endswith(streamed.content)


def test_valid_call_then_invalid_block_is_all_content() -> None:
    text = f"{WEATHER_BLOCK}\n<tool_call>\nnot json\n</tool_call>"
    assert HermesToolParser().parse(text) == ParsedOutput(text, [])


def test_cut_inside_arguments() -> None:
    """max_tokens cuts the arguments: parse keeps no call, a stream has sent the arguments read so far."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "un'
    assert HermesToolParser().parse(text) == ParsedOutput(text, [])
    streamed = stream_text(HermesToolParser(), text, list(range(1, len(text) + 1)))
    assert [call[1:] for call in streamed.calls] == [["get_weather", '{"city": "Paris", "un']]
    llama_text = '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y"'
    assert Llama3JsonToolParser().parse(llama_text) == ParsedOutput(llama_text, [])
    required_text = '[{"name": "a", "parameters": {"x": 1}}'
    assert RequiredToolCallsParser().parse(required_text) == ParsedOutput(required_text, [])
    named_text = '{"q": "unfinished'
    assert NamedToolCallParser("search").parse(named_text) == ParsedOutput(named_text, [])


def test_calls_get_fresh_ids() -> None:
    parser = HermesToolParser()
    first, second = parser.parse(f"{WEATHER_BLOCK}{TIME_BLOCK}").tool_calls
    again = parser.parse(WEATHER_BLOCK).tool_calls[0]
    assert len({first.id, second.id, again.id}) == 3


def test_long_arguments_stream_quickly() -> None:
    """A large output fed a few characters at a time: each feed reads on from where the last stopped."""
    body = json.dumps({"text": 'x\\"{[' * 5_000})
    text = f'<tool_call>\n{{"name": "f", "arguments": {body}}}\n</tool_call>'
    started = time.monotonic()
    streamed = stream_text(HermesToolParser(), text, list(range(1, len(text) + 1, 3)))
    assert streamed.calls[0][2] == body
    assert time.monotonic() - started < 10  # rescanning from the start would take minutes


def test_tool_parser_by_name() -> None:
    assert set(TOOL_PARSERS) >= {"hermes", "llama3_json"}
    assert isinstance(tool_parser("hermes"), HermesToolParser)
    assert isinstance(tool_parser("llama3_json"), Llama3JsonToolParser)
    with pytest.raises(ValueError, match=r"valid names: hermes, llama3_json"):
        tool_parser("mistral")
