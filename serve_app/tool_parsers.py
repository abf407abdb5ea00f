"""Tool-call parsers: a model's raw output text -> OpenAI `tool_calls`, whole (`parse`) or as it streams
(`stream().feed`). Formats: `hermes` (Qwen2.5/Qwen3 `<tool_call>` blocks), `llama3_json` (Llama 3.1/3.2 JSON calls),
and the two that `tool_choice` forces: `RequiredToolCallsParser` (a JSON array of calls) and `NamedToolCallParser`
(the output is the arguments object of one known function).

Both `parse` and streams read the text with the same incremental scanner, so a stream's content pieces join to
`parse(text).content or ""` and its argument pieces to each call's `arguments`, however the text was split, as long
as the output is well formed. Content rule when calls exist: whitespace right before a `<tool_call>` block and at
the end of the output is not content (`"Let me check.\n\n<tool_call>..."` has content "Let me check."). With no
calls the content is the text unchanged. Once part of a call was sent, a stream cannot take it back: if that call
then turns out malformed, `parse` gives the whole text as content while the stream sends the rest as content.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# Qwen writes "arguments", Llama "parameters"; every format takes either.
ARGUMENT_KEYS = frozenset({"arguments", "parameters"})

_STRUCTURAL_CHAR = re.compile(r'[\[\]{}"]')
_STRING_STOP_CHAR = re.compile(r'["\\]')
_SCALAR = re.compile(r"[-+.\w]+")
_CLOSER = {"{": "}", "[": "]"}


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the arguments JSON object text exactly as the model wrote it


@dataclass(slots=True)
class ParsedOutput:
    content: str | None  # None when calls exist and no other text does
    tool_calls: list[ToolCall]  # empty: the output is plain content, and `content` the whole text


@dataclass(slots=True)
class ToolCallDelta:
    index: int  # position of the call in this completion's tool_calls
    id: str | None = None  # on the first delta of a call only
    name: str | None = None  # on the first delta of a call only, and always complete
    arguments: str = ""  # the next piece of the arguments text


@dataclass(slots=True)
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolCallStream(ABC):
    """Incremental parsing state for one completion."""

    @abstractmethod
    def feed(self, text: str, final: bool) -> StreamDelta:
        """`text` is the whole output so far (it only grows); returns what is new since the last call. `final`
        on the last call flushes everything held back."""

    @property
    @abstractmethod
    def tool_calls_seen(self) -> bool:
        """Whether any call has been sent (the finish_reason is then "tool_calls")."""


class ToolParser(ABC):
    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """The whole output at once (non-streaming responses)."""

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """Fresh incremental state for one completion."""


def _skip_space(text: str, pos: int) -> int:
    end = len(text)
    while pos < end and text[pos].isspace():
        pos += 1
    return pos


def _rstrip_end(text: str, start: int, end: int) -> int:
    """Where text[start:end] ends once its trailing whitespace is cut."""
    while end > start and text[end - 1].isspace():
        end -= 1
    return end


def _partial_tag_length(text: str, start: int, tag: str) -> int:
    """Length of the longest end of text[start:] that is a proper beginning of `tag` (it may become the tag)."""
    for size in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def _is_json(raw: str) -> bool:
    try:
        json.loads(raw)
    except (ValueError, RecursionError):
        return False
    return True


class _ValueScanner:
    """Where one JSON value starting at `start` ends, in a text that keeps growing. It follows strings, escapes and
    bracket nesting only; json.loads checks the rest once the value is whole."""

    __slots__ = ("_closers", "_in_string", "_scalar", "end", "error", "pos", "start")

    def __init__(self, text: str, start: int):
        first = text[start]
        self.start = start
        self.end: int | None = None  # one past the value's last character, once known
        self.error = False
        self._closers = [_CLOSER[first]] if first in _CLOSER else []
        self._in_string = first == '"'
        self._scalar = first not in '{["'
        self.pos = start if self._scalar else start + 1  # text[start:pos] has been read

    def advance(self, text: str) -> None:
        if self._scalar:
            match = _SCALAR.match(text, self.pos)
            if match:
                self.pos = match.end()
            if self.pos < len(text):  # a number or literal ends at the first character that cannot be in it
                self.error = self.pos == self.start
                self.end = None if self.error else self.pos
            return
        while self.end is None:
            if self._in_string:
                match = _STRING_STOP_CHAR.search(text, self.pos)
                if match is None:
                    self.pos = len(text)
                    return
                at = match.start()
                if text[at] == "\\":
                    if at + 1 == len(text):  # the escaped character has not arrived yet
                        self.pos = at
                        return
                    self.pos = at + 2
                    continue
                self._in_string = False
                self.pos = at + 1
            else:
                match = _STRUCTURAL_CHAR.search(text, self.pos)
                if match is None:
                    self.pos = len(text)
                    return
                at = match.start()
                char = text[at]
                if char == '"':
                    self._in_string = True
                elif char in _CLOSER:
                    self._closers.append(_CLOSER[char])
                elif self._closers.pop() != char:
                    self.error = True
                    self.pos = at
                    return
                self.pos = at + 1
            if not self._closers and not self._in_string:
                self.end = self.pos


class _CallObjectScanner:
    """Reads one call object `{"name": "f", "arguments": {...}}` (keys in any order, other keys skipped) from a
    growing text: where its name and arguments are, and where it ends. A repeated name or arguments key, a name
    that is not a string or arguments that are not an object is an error."""

    __slots__ = ("_key", "_state", "_value", "args_end", "args_start", "end", "error", "name", "pos", "start")

    def __init__(self, start: int):
        self.start = start  # the opening brace
        self.pos = start + 1  # text[start:pos] has been read; on error, the offending character
        self.end: int | None = None
        self.error = False
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self._state = "key_or_close"
        self._key: str | None = None
        self._value: _ValueScanner | None = None  # the key or value being read

    @property
    def args_scanned(self) -> int | None:
        """How far the arguments text has been read (None until it starts)."""
        if self.args_end is not None or self.args_start is None:
            return self.args_end
        return self._value.pos

    def is_valid_call(self, text: str) -> bool:
        return (
            not self.error
            and self.end is not None
            and self.name is not None
            and self.args_end is not None
            and _is_json(text[self.start : self.end])
        )

    def advance(self, text: str) -> None:
        while self.end is None and not self.error:
            if self._value is not None:
                if not self._read_value(text):
                    return
                continue
            at = _skip_space(text, self.pos)
            self.pos = at
            if at == len(text):
                return
            char = text[at]
            state = self._state
            if state in ("key_or_close", "comma_or_close") and char == "}":
                self.end = self.pos = at + 1
            elif state in ("key_or_close", "key") and char == '"':
                self._value = _ValueScanner(text, at)
            elif state == "colon" and char == ":":
                self.pos = at + 1
                self._state = "value"
            elif state == "value" and self._start_value(text, at):
                self._value = _ValueScanner(text, at)
            elif state == "comma_or_close" and char == ",":
                self.pos = at + 1
                self._state = "key"
            else:
                self.error = True

    def _start_value(self, text: str, at: int) -> bool:
        """Checks the first character of a value (noting where arguments begin); False if it cannot start here."""
        char = text[at]
        if self._key == "name":
            return self.name is None and char == '"'
        if self._key in ARGUMENT_KEYS:
            if self.args_start is not None or char != "{":
                return False
            self.args_start = at
            return True
        return char in '{["' or _SCALAR.match(text, at) is not None

    def _read_value(self, text: str) -> bool:
        """Reads on in the key or value under way; True once it is whole and the object can go on."""
        value = self._value
        value.advance(text)
        self.pos = value.pos
        if value.error:
            self.error = True
        if value.end is None or self.error:
            return False
        self._value = None
        raw = text[value.start : value.end]
        if self._state == "value":
            self._state = "comma_or_close"
            if self._key == "name":
                self.name = self._decode_string(raw)
            elif self._key in ARGUMENT_KEYS:
                self.args_end = value.end
        else:
            self._state = "colon"
            self._key = self._decode_string(raw)
        return not self.error

    def _decode_string(self, raw: str) -> str | None:
        try:
            return json.loads(raw)
        except ValueError:
            self.error = True
            return None


class _BareArgumentsScanner:
    """The named-function format: the output is the arguments object itself, and the name is known up front."""

    __slots__ = ("_value", "args_start", "name", "start")

    def __init__(self, text: str, start: int, name: str):
        self.start = self.args_start = start
        self.name = name
        self._value = _ValueScanner(text, start)

    @property
    def pos(self) -> int:
        return self._value.pos

    @property
    def end(self) -> int | None:
        return self._value.end

    @property
    def error(self) -> bool:
        return self._value.error

    @property
    def args_end(self) -> int | None:
        return self._value.end

    @property
    def args_scanned(self) -> int:
        return self._value.pos

    def advance(self, text: str) -> None:
        self._value.advance(text)

    def is_valid_call(self, text: str) -> bool:
        return not self.error and self.end is not None and _is_json(text[self.start : self.end])


@dataclass(slots=True)
class _CallProgress:
    index: int
    id: str
    name: str
    args_sent: int  # text index up to which the arguments have been sent
    arguments: str | None = None  # set once the call is whole and valid


class _ScanningStream(ToolCallStream):
    """What the formats share: sending a call as it is read, holding back text that may yet be a call, and falling
    back to plain content. Subclasses implement `_step`, which reads on from where the last feed stopped."""

    # Hermes keeps the calls before a block that max_tokens cut; the other formats are one JSON text.
    keeps_calls_when_cut = False

    def __init__(self, state: str, holding: bool):
        self._text = ""
        self._delta = StreamDelta()
        self._state = state
        self._pos = 0  # where the format's own reading resumes
        # text[:_settled] was sent or dropped on purpose; with _holding, the text after it may still be a call
        self._settled = 0
        self._holding = holding
        self._hold_start = 0  # where the text of the call being read (with the whitespace before it) begins
        self._scanner: _CallObjectScanner | _BareArgumentsScanner | None = None
        self._open_call: _CallProgress | None = None  # sent in part, not yet whole
        self._calls: list[_CallProgress] = []
        self._plain = self._failed = self._cut_short = False

    @property
    def tool_calls_seen(self) -> bool:
        return bool(self._calls)

    def feed(self, text: str, final: bool) -> StreamDelta:
        if len(text) < len(self._text):
            raise ValueError("feed() takes the whole output so far, which only grows")
        self._text = text
        self._delta = delta = StreamDelta()
        if not self._plain:
            self._step(final)
        if self._plain and self._settled < len(text):
            self._send_content(text[self._settled :])
            self._settled = len(text)
        return delta

    def parsed(self, content: str) -> ParsedOutput:
        """The whole-output answer, after a single final feed whose content was `content`."""
        text = self._text
        calls = [ToolCall(call.id, call.name, call.arguments) for call in self._calls if call.arguments is not None]
        if self._failed or not calls:
            return ParsedOutput(text, [])
        if self._cut_short:
            if not self.keeps_calls_when_cut:
                return ParsedOutput(text, [])
            if self._open_call is not None:  # the cut call was sent in part; as a whole it is content
                content += text[self._hold_start :]
        return ParsedOutput(content if content.strip() else None, calls)

    @abstractmethod
    def _step(self, final: bool) -> None:
        """Reads on through self._text, sending what is settled."""

    def _send_content(self, piece: str) -> None:
        self._delta.content += piece

    def _send_arguments(self, call: _CallProgress, piece: str, first: bool) -> None:
        tool_calls = self._delta.tool_calls
        if first:
            tool_calls.append(ToolCallDelta(call.index, call.id, call.name, piece))
        elif piece and tool_calls and tool_calls[-1].index == call.index:
            tool_calls[-1].arguments += piece
        elif piece:
            tool_calls.append(ToolCallDelta(call.index, arguments=piece))

    def _begin_call(self, scanner: _CallObjectScanner | _BareArgumentsScanner) -> None:
        self._holding = True
        self._hold_start = self._settled
        self._scanner = scanner
        self._state = "call"

    def _fail(self, at: int | None = None) -> None:
        """Malformed: the rest is plain content, from where the held-back text starts, else from `at`."""
        logger.debug("malformed tool call output (at index %s); the rest is plain content", at)
        self._failed = self._plain = True
        if at is not None and not self._holding:
            self._settled = at

    def _cut(self) -> None:
        """The output ended inside a call: text still held back is content."""
        self._cut_short = True
        if self._holding:
            self._plain = True

    def _read_call(self, final: bool) -> bool:
        """Reads on in the current call; True once it is whole, valid and sent."""
        text, scanner = self._text, self._scanner
        scanner.advance(text)
        finished = scanner.error or scanner.end is not None
        if finished and not scanner.is_valid_call(text):
            self._fail()
            return False
        call = self._open_call
        first = call is None
        if first:
            # A call is sent once its name is whole and its arguments have begun as an object.
            if scanner.name is None or scanner.args_start is None:
                if final:
                    self._cut()
                return False
            call = _CallProgress(len(self._calls), new_tool_call_id(), scanner.name, scanner.args_start)
            self._calls.append(call)
            self._open_call = call
            self._holding = False
        scanned = scanner.args_scanned
        self._send_arguments(call, text[call.args_sent : scanned], first)
        call.args_sent = scanned
        self._settled = scanner.pos
        if not finished:
            if final:
                self._cut()
            return False
        call.arguments = text[scanner.args_start : scanner.args_end]
        self._open_call = None
        return True

    def _read_tail(self) -> None:
        """After the last call only whitespace may follow."""
        at = _skip_space(self._text, self._pos)
        if at < len(self._text):
            self._fail(at)


class _HermesStream(_ScanningStream):
    keeps_calls_when_cut = True

    def __init__(self):
        super().__init__("content", holding=False)

    def _step(self, final: bool) -> None:
        text = self._text
        while not self._plain:
            if self._state == "content":
                if not self._read_content(final):
                    return
            elif self._state == "block_open":
                at = _skip_space(text, self._pos)
                if at == len(text):
                    if final:
                        self._cut()
                    return
                if text[at] != "{":
                    self._fail(at)
                    return
                self._scanner = _CallObjectScanner(at)
                self._state = "call"
            elif self._state == "call":
                if not self._read_call(final):
                    return
                self._pos = self._scanner.end
                self._state = "block_close"
            else:
                at = _skip_space(text, self._pos)
                if text.startswith(HERMES_CLOSE, at):
                    self._settled = at + len(HERMES_CLOSE)
                    self._state = "content"
                elif HERMES_CLOSE.startswith(text[at : at + len(HERMES_CLOSE)]):
                    if final:  # a whole call whose closing tag never came
                        self._settled = len(text)
                    return
                else:
                    self._fail(at)
                    return

    def _read_content(self, final: bool) -> bool:
        """Sends plain text up to the next `<tool_call>`; True if one was found."""
        text, start = self._text, self._settled
        tag = text.find(HERMES_OPEN, start)
        if tag != -1:
            end = _rstrip_end(text, start, tag)  # whitespace right before a call is not content
            self._send_content(text[start:end])
            self._settled = self._hold_start = end
            self._holding = True
            self._pos = tag + len(HERMES_OPEN)
            self._state = "block_open"
            return True
        if not final:
            # Trailing whitespace waits to see whether a call follows, a partial "<tool_c" whether it is one.
            end = _rstrip_end(text, start, len(text) - _partial_tag_length(text, start, HERMES_OPEN))
        elif self._calls:
            end = _rstrip_end(text, start, len(text))
        else:
            end = len(text)
        self._send_content(text[start:end])
        self._settled = end
        return False


class _Llama3JsonStream(_ScanningStream):
    def __init__(self):
        super().__init__("start", holding=True)

    def _step(self, final: bool) -> None:
        text = self._text
        while not self._plain:
            if self._state == "start":
                at = _skip_space(text, 0)
                if text.startswith(PYTHON_TAG, at):
                    at = _skip_space(text, at + len(PYTHON_TAG))
                elif not final and PYTHON_TAG.startswith(text[at : at + len(PYTHON_TAG)]):
                    return  # nothing yet, or the tag still arriving
                if at == len(text) and not final:
                    return
                if at == len(text) or text[at] != "{":
                    self._plain = True
                    return
                self._begin_call(_CallObjectScanner(at))
            elif self._state == "call":
                if not self._read_call(final):
                    return
                self._pos = self._scanner.end
                self._state = "between"
            else:
                at = _skip_space(text, self._pos)
                if at == len(text):
                    return  # at the end, the calls so far are all (a trailing ";" is harmless)
                if self._state == "between" and text[at] == ";":
                    self._pos = at + 1
                    self._state = "after_semicolon"
                elif self._state == "after_semicolon" and text[at] == "{":
                    self._begin_call(_CallObjectScanner(at))
                else:
                    self._fail(at)
                    return


class _WholeOutputStream(_ScanningStream):
    """A forced format whose whole output is JSON (`required`, named): calls, then only whitespace."""

    # The state after a call's object ends.
    after_call = "tail"

    def __init__(self):
        super().__init__("start", holding=True)

    def _step(self, final: bool) -> None:
        text = self._text
        while not self._plain:
            if self._state == "call":
                if not self._read_call(final):
                    return
                self._pos = self._scanner.end
                self._state = self.after_call
                continue
            if self._state == "tail":
                self._read_tail()
                return
            at = _skip_space(text, self._pos)
            if at == len(text):
                if final:
                    self._cut()
                return
            if not self._read_structure(text, at):
                self._fail(at)
                return

    @abstractmethod
    def _read_structure(self, text: str, at: int) -> bool:
        """Take the structural character at `at` (a call begins, a separator); False: the output is not the format."""


class _RequiredStream(_WholeOutputStream):
    after_call = "between"

    def _read_structure(self, text: str, at: int) -> bool:
        char = text[at]
        if self._state == "start" and char == "[":
            self._pos = at + 1
            self._state = "element"
        elif self._state == "element" and char == "{":
            self._begin_call(_CallObjectScanner(at))
        elif self._state == "between" and char in ",]":
            self._pos = at + 1
            self._state = "element" if char == "," else "tail"
        else:
            return False
        return True


class _NamedStream(_WholeOutputStream):
    def __init__(self, name: str):
        super().__init__()
        self._name = name

    def _read_structure(self, text: str, at: int) -> bool:
        if text[at] != "{":
            return False
        self._begin_call(_BareArgumentsScanner(text, at, self._name))
        return True


class _ScanningParser(ToolParser):
    def parse(self, text: str) -> ParsedOutput:
        stream = self.stream()
        return stream.parsed(stream.feed(text, final=True).content)

    @abstractmethod
    def stream(self) -> _ScanningStream: ...


class HermesToolParser(_ScanningParser):
    """Qwen2.5/Qwen3: optional text, then `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks."""

    def stream(self) -> _ScanningStream:
        return _HermesStream()


class Llama3JsonToolParser(_ScanningParser):
    """Llama 3.1/3.2: optional `<|python_tag|>`, then `{"name": ..., "parameters": {...}}` objects joined by ";"."""

    def stream(self) -> _ScanningStream:
        return _Llama3JsonStream()


class RequiredToolCallsParser(_ScanningParser):
    """tool_choice "required": the output is a JSON array of one or more `{"name": ..., "parameters": {...}}`."""

    def stream(self) -> _ScanningStream:
        return _RequiredStream()


class NamedToolCallParser(_ScanningParser):
    """tool_choice naming a function: the whole output is that function's arguments object."""

    def __init__(self, name: str):
        self.name = name

    def stream(self) -> _ScanningStream:
        return _NamedStream(self.name)


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def tool_parser(name: str) -> ToolParser:
    """The `--tool-call-parser NAME` parser."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; valid names: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()
