"""Structured outputs with xgrammar: each distinct constraint compiled once, in a background thread of the scheduler's
process (the request waits in the queue meanwhile, so no step waits for a compile); the compiled grammar shipped once
to the sampling rank, which holds a matcher per request and applies the allowed-token bitmask of the whole batch to
the logits in one op.

xgrammar over llguidance by measurement (docs/perf-log/2026-11-27.md): its per-token mask, paid every step for every
constrained row, is the cheaper one, and its compile is cached per constraint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from configs.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Separators of the compact JSON the grammar allows when free whitespace is off (what json.dumps writes).
COMPACT_SEPARATORS = (", ", ": ")
# Free whitespace allowed in one place when it is on: bounded, so a model cannot pad forever.
MAX_WHITESPACE = 8
# Compiled grammars kept (in the scheduler and on the sampling rank) for constraints no request uses any more.
GRAMMAR_CACHE_SIZE = 64


def grammar_key(spec: StructuredOutputsParams) -> str:
    """A short name of the compiled grammar a constraint gives: equal constraints share one."""
    return hashlib.sha256(repr(spec.key).encode()).hexdigest()[:32]


def choice_grammar(options: Sequence[str]) -> str:
    """EBNF whose root is exactly one of the options (JSON string literals are valid EBNF string literals)."""
    return "root ::= " + " | ".join(json.dumps(option, ensure_ascii=False) for option in options)


def _bounded_strings_as_patterns(schema: Any) -> Any:
    """The schema with each length-bounded plain string given as a pattern of the same bounds without control
    characters, quotes or backslashes: xgrammar 0.2.8 lets control bytes into a maxLength string (invalid JSON,
    mlc-ai/xgrammar#800), while its pattern strings are escaped correctly."""
    if isinstance(schema, list):
        return [_bounded_strings_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rewritten = {key: _bounded_strings_as_patterns(value) for key, value in schema.items()}
    bounded = "minLength" in schema or "maxLength" in schema
    plain = not any(key in schema for key in ("pattern", "format", "enum", "const"))
    if schema.get("type") == "string" and bounded and plain:
        low, high = rewritten.pop("minLength", 0), rewritten.pop("maxLength", "")
        rewritten["pattern"] = f'^[^\\x00-\\x1f"\\\\]{{{low},{high}}}$'
    return rewritten


def _schema_text(schema: str | dict[str, Any]) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as error:
            raise ValueError(f"the JSON schema is not valid JSON: {error}") from error
    return json.dumps(_bounded_strings_as_patterns(schema))


def _json_options(spec: StructuredOutputsParams) -> dict[str, Any]:
    if spec.disable_any_whitespace:
        return {"any_whitespace": False, "separators": COMPACT_SEPARATORS}
    return {"any_whitespace": True, "max_whitespace_cnt": MAX_WHITESPACE}


# Constraints that passed `check_structured_outputs` (most recent last): an agent repeats its schemas.
_checked_constraints: OrderedDict[tuple[str, str, bool], None] = OrderedDict()
_checked_lock = threading.Lock()


def check_structured_outputs(spec: StructuredOutputsParams) -> None:
    """Raises ValueError (xgrammar's reason) when the constraint cannot be compiled: needs no tokenizer, so the
    ingress and the engine refuse a bad schema, regex or grammar before anything is scheduled. A constraint that
    passed is remembered (GRAMMAR_CACHE_SIZE of them), so a repeated one costs nothing."""
    key = spec.key
    with _checked_lock:
        if key in _checked_constraints:
            _checked_constraints.move_to_end(key)
            return
    _check(spec)
    with _checked_lock:
        _checked_constraints[key] = None
        while len(_checked_constraints) > GRAMMAR_CACHE_SIZE:
            _checked_constraints.popitem(last=False)


def _check(spec: StructuredOutputsParams) -> None:
    import xgrammar

    try:
        if spec.kind == "json":
            xgrammar.Grammar.from_json_schema(_schema_text(spec.json), **_json_options(spec))
        elif spec.kind == "regex":
            xgrammar.Grammar.from_regex(spec.regex)
        elif spec.kind == "grammar":
            xgrammar.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"invalid {spec.kind}: {reason}") from error


@dataclass(frozen=True, slots=True)
class CompiledConstraint:
    grammar: Any
    """xgrammar's CompiledGrammar."""
    payload: str
    """Its serialized form, as the sampling rank loads it."""


class GrammarCompiler:
    """The scheduler's side: compiles constraints for one tokenizer in a background thread, once per distinct
    constraint while any request uses it (and up to GRAMMAR_CACHE_SIZE more, least recently used dropped first).

    The tokenizer is read on the first structured request, so engines that never see one never pay for it.
    """

    def __init__(self, model_dir: Path, vocab_size: int, stop_token_ids: Sequence[int], max_threads: int = 1):
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compiler")
        self._max_threads = max_threads
        self._compiler: Any = None
        self._tokenizer_info: Any = None
        self._compiler_lock = threading.Lock()
        self._compiled: OrderedDict[str, Future] = OrderedDict()

    def submit(self, spec: StructuredOutputsParams, on_done: Callable[[], None] | None = None) -> Future:
        """A future of the CompiledConstraint of `spec`, compiled in the background unless a request had it."""
        key = grammar_key(spec)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = self._pool.submit(self._compile, spec)
        self._compiled.move_to_end(key)
        if on_done is not None:
            compiled.add_done_callback(lambda _: on_done())
        return compiled

    def evict(self, keys_in_use: Iterable[str]) -> list[str]:
        """Drop the least recently used compiled grammars no request uses, down to GRAMMAR_CACHE_SIZE; their keys."""
        in_use = set(keys_in_use)
        evicted = []
        for key in list(self._compiled):
            if len(self._compiled) <= GRAMMAR_CACHE_SIZE:
                break
            if key not in in_use and self._compiled[key].done():
                del self._compiled[key]
                evicted.append(key)
        return evicted

    def tokenizer_info_payload(self) -> str:
        """The serialized tokenizer description the sampling rank loads grammars with."""
        self._xgrammar_compiler()
        return self._tokenizer_info.serialize_json()

    def _xgrammar_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
                info = xgrammar.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                self._tokenizer_info = info
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=self._max_threads, cache_enabled=False)
            return self._compiler

    def _compile(self, spec: StructuredOutputsParams) -> CompiledConstraint:
        compiler = self._xgrammar_compiler()
        if spec.kind == "json":
            grammar = compiler.compile_json_schema(_schema_text(spec.json), **_json_options(spec))
        elif spec.kind == "json_object":
            grammar = compiler.compile_json_schema('{"type": "object"}', **_json_options(spec))
        elif spec.kind == "regex":
            grammar = compiler.compile_regex(spec.regex)
        elif spec.kind == "choice":
            grammar = compiler.compile_grammar(choice_grammar(spec.choice))
        else:
            grammar = compiler.compile_grammar(spec.grammar)
        return CompiledConstraint(grammar, grammar.serialize_json())

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarStore:
    """The sampling rank's side: the compiled grammars the scheduler shipped, loaded in a background thread while
    the step that first needs one runs its forward."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-loader")
        self._tokenizer_info: Future | None = None
        self._grammars: dict[str, Future] = {}

    def load_tokenizer_info(self, payload: str) -> None:
        import xgrammar

        self._tokenizer_info = self._pool.submit(xgrammar.TokenizerInfo.deserialize_json, payload)

    def add(self, key: str, payload: str) -> None:
        self._grammars[key] = self._pool.submit(self._load, payload)

    def _load(self, payload: str) -> Any:
        import xgrammar

        if self._tokenizer_info is None:
            raise RuntimeError("a grammar arrived before the tokenizer description it is read with")
        return xgrammar.CompiledGrammar.deserialize_json(payload, self._tokenizer_info.result())

    def get(self, key: str) -> Future:
        return self._grammars[key]

    def evict(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._grammars.pop(key, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One sequence's matcher: which tokens may come next, advanced by the tokens it samples."""

    def __init__(self, compiled: Future, replay_token_ids: Sequence[int]):
        """`compiled`: a future of xgrammar's CompiledGrammar."""
        self._compiled = compiled
        self._matcher: Any = None
        # Output tokens the matcher has not seen yet: a resumed (preempted) request's, or tokens sampled before its
        # grammar was compiled.
        self._pending: list[int] = list(replay_token_ids)
        self.failed = False

    def _ready_matcher(self) -> Any:
        if self._matcher is None:
            import xgrammar

            self._matcher = xgrammar.GrammarMatcher(self._compiled.result())
        if self._pending:
            pending, self._pending = self._pending, []
            self.accept(pending)
        return self._matcher

    def fill_bitmask(self, bitmask: torch.Tensor, first_row: int, drafts: Sequence[int]) -> None:
        """Rows first_row .. first_row + len(drafts): the allowed tokens after the known tokens and after each
        draft prefix. Rows past a draft the grammar refuses stay all-allowed: that draft cannot be accepted (the
        row before it refuses it), so what they sample is dropped."""
        matcher = self._ready_matcher()
        if self.failed or matcher.is_terminated():
            return  # past the grammar's end (ignore_eos), nothing is constrained
        matcher.fill_next_token_bitmask(bitmask, first_row)
        num_taken = 0
        for offset, draft in enumerate(drafts, start=1):
            if matcher.is_terminated() or not matcher.accept_token(draft):
                break
            num_taken += 1
            matcher.fill_next_token_bitmask(bitmask, first_row + offset)
        if num_taken:
            matcher.rollback(num_taken)

    def accept(self, token_ids: Sequence[int]) -> None:
        """The sampled tokens (accepted drafts, then the token after them); past the grammar's end, nothing."""
        if self._matcher is None:
            self._pending.extend(token_ids)
            return
        for token_id in token_ids:
            if self.failed or self._matcher.is_terminated():
                return
            if not self._matcher.accept_token(token_id):
                # Only a token the mask allowed is sampled; a refusal means the two disagree: stop constraining.
                logger.error("structured output: grammar refused sampled token %d; unconstrained from here", token_id)
                self.failed = True


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """All tokens allowed (-1: every bit set), int32 words of 32 tokens, as xgrammar fills them."""
    return torch.full((num_rows, -(-vocab_size // 32)), -1, dtype=torch.int32)


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int], forbidden: float = float("-inf")
) -> None:
    """Set the logits of the tokens each listed row's bitmask (on the CPU) forbids to `forbidden`, all rows at once:
    the words' bits unpacked in one numpy pass (bit t % 32 of little-endian word t // 32 is byte t // 8's bit t % 8),
    then one masked fill."""
    rows = list(rows)
    all_rows = rows == list(range(logits.shape[0]))
    words = bitmask.numpy() if all_rows and bitmask.shape[0] == len(rows) else bitmask.numpy()[rows]
    vocab = min(logits.shape[1], words.shape[1] * 32)
    forbidden_bits = np.unpackbits(np.invert(words.view(np.uint8)), axis=1, bitorder="little")[:, :vocab]
    mask = torch.from_numpy(forbidden_bits).view(torch.bool).to(logits.device)
    if all_rows:
        logits[:, :vocab].masked_fill_(mask, forbidden)
    else:
        index = torch.as_tensor(rows, dtype=torch.long, device=logits.device)
        logits[index, :vocab] = logits[index, :vocab].masked_fill(mask, forbidden)
