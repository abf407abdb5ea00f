"""Structured outputs (JSON schema, regex, choice, EBNF): the bitmask and the matcher's drafts on their own, then the
engine on a tiny random Llama, whose random weights never write JSON or match a pattern by themselves (so every valid
output proves the mask), the same constrained tokens with drafts, preemption, TP=2, prefix caching and async
scheduling as without them, bad constraints refused, and SmolLM2 answering a chat in a schema."""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from concurrent.futures import Future
from typing import Any

import jsonschema
import pytest
import torch

from configs.sampling_params import SamplingParams, StructuredOutputsParams
from model_executor.structured_output import GrammarCompiler, RequestGrammar, allocate_bitmask, apply_bitmask
from tests.helpers import HISTORY, assert_no_leaked_blocks, with_tools_template

SPECULATIVE = {"num_speculative_tokens": 3, "disable_by_batch_size": None}
PROMPTS = [f"Record {index}: the entry reads" for index in range(16)]
CODE_PATTERN = "[a-z]{3}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe later"]
# Bounded strings and numbers: a random model fills a free string until max_tokens. A pattern, not maxLength:
# xgrammar 0.2.8 lets maxLength strings hold raw control characters (mlc-ai/xgrammar#800), which JSON forbids.
FREE_TEXT = {"type": "string", "pattern": '^[^\\x00-\\x1f"\\\\]{1,10}$'}
PERSON = {
    "type": "object",
    "properties": {
        "name": FREE_TEXT,
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
TAGS = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4}
NESTED = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "point": {
            "type": "object",
            "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
            "required": ["x", "y"],
            "additionalProperties": False,
        },
    },
    "required": ["ok", "point"],
    "additionalProperties": False,
}
# Six objects of one shape: the output repeats itself, so n-gram drafts get accepted.
ROWS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}, "flag": {"type": "boolean"}},
        "required": ["id", "flag"],
        "additionalProperties": False,
    },
    "minItems": 6,
    "maxItems": 6,
}
LABELS = {
    "type": "object",
    "properties": {"title": FREE_TEXT, "owner": FREE_TEXT},
    "required": ["title", "owner"],
    "additionalProperties": False,
}


def constrained(max_tokens: int = 32, sampling: dict[str, Any] | None = None, **spec: Any) -> SamplingParams:
    """Greedy unless `sampling` (other SamplingParams fields) says otherwise; `spec`: the StructuredOutputsParams."""
    sampling = {"temperature": 0.0, **(sampling or {})}
    return SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**spec), **sampling)


def seeded(params: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(params, temperature=1.0, seed=seed)


def token_ids_of(llm: Any, prompts: list[Any], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [completion.token_ids for output in outputs for completion in output.outputs]


def assert_valid(text: str, params: SamplingParams) -> None:
    """The text is what the request's constraint allows."""
    spec = params.structured_outputs
    if spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    elif spec.choice is not None:
        assert text in spec.choice
    elif spec.json is not None:
        schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        jsonschema.validate(json.loads(text), schema)
    elif spec.json_object:
        assert isinstance(json.loads(text), dict), text
    else:
        raise AssertionError(f"no check for {spec.kind}")


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    from executor import LLM

    return LLM(model=str(tiny_model_dir), show_progress=False, num_kv_blocks=256)


@pytest.fixture(scope="module")
def tokenizer(tiny_llm):
    return tiny_llm.tokenizer


@pytest.fixture(scope="module")
def grammar_compiler(tiny_llm):
    info = tiny_llm.engine.model_info
    compiler = GrammarCompiler(info.model_dir, info.vocab_size, sorted(info.eos_token_ids))
    yield compiler
    compiler.shutdown()


# ---------------------------------------------------------------------------------------------------------------
# The bitmask and the matcher


@pytest.mark.parametrize("vocab_size", [37, 64, 100])
def test_apply_bitmask_masks_exactly_the_forbidden_tokens_of_the_chosen_rows(vocab_size):
    generator = torch.Generator().manual_seed(vocab_size)
    num_rows = 5
    logits = torch.randn(num_rows, vocab_size, generator=generator)
    bitmask = torch.randint(-(2**31), 2**31, (num_rows, -(-vocab_size // 32)), dtype=torch.int32, generator=generator)
    bitmask[3] = 0  # a row that forbids everything
    rows = [0, 2, 3]
    expected = logits.clone()
    for row in rows:
        for token in range(vocab_size):
            # Python's >> on a negative word is arithmetic, so bit 31 reads right.
            if not (int(bitmask[row, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    masked = logits.clone()
    apply_bitmask(masked, bitmask, rows)
    assert torch.equal(masked, expected)
    assert torch.equal(masked[[1, 4]], logits[[1, 4]])  # rows not asked for are untouched
    assert torch.isinf(masked[3]).all()


def reference_row(compiled: Any, prefix: list[int], vocab_size: int) -> torch.Tensor:
    """The allowed tokens after `prefix`, from a fresh xgrammar matcher."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(compiled)
    for token_id in prefix:
        assert matcher.accept_token(token_id)
    row = allocate_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(row, 0)
    return row[0]


def completed(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def allows(row: torch.Tensor, token_id: int) -> bool:
    return bool((int(row[token_id // 32]) >> (token_id % 32)) & 1)


def test_drafts_fill_one_row_per_valid_prefix_and_the_matcher_rolls_back(grammar_compiler, tokenizer, tiny_llm):
    vocab_size = tiny_llm.engine.model_info.vocab_size
    token = {char: tokenizer.convert_tokens_to_ids(char) for char in "abcz1x"}
    compiled = grammar_compiler.submit(StructuredOutputsParams(regex="ab(c|d)[0-9]{2}x")).result(timeout=60).grammar
    grammar = RequestGrammar(completed(compiled), [token["a"]])
    all_allowed = allocate_bitmask(1, vocab_size)[0]

    # Every draft valid: row 1 is after "a", then one row per draft prefix; row 0 (another request's) stays open.
    bitmask = allocate_bitmask(5, vocab_size)
    grammar.fill_bitmask(bitmask, 1, [token["b"], token["c"], token["1"]])
    assert torch.equal(bitmask[0], all_allowed)
    for row, prefix in enumerate(["a", "ab", "abc", "abc1"], start=1):
        assert torch.equal(bitmask[row], reference_row(compiled, [token[char] for char in prefix], vocab_size)), prefix
    assert allows(bitmask[1], token["b"]) and not allows(bitmask[1], token["c"])
    assert allows(bitmask[3], token["1"]) and not allows(bitmask[3], token["x"])

    # "z" after "ab" is refused: the row after "ab" forbids it, and the rows behind it are left open.
    bitmask = allocate_bitmask(4, vocab_size)
    grammar.fill_bitmask(bitmask, 0, [token["b"], token["z"], token["c"]])
    assert torch.equal(bitmask[0], reference_row(compiled, [token["a"]], vocab_size))
    assert torch.equal(bitmask[1], reference_row(compiled, [token["a"], token["b"]], vocab_size))
    assert not allows(bitmask[1], token["z"])
    assert torch.equal(bitmask[2], all_allowed) and torch.equal(bitmask[3], all_allowed)

    # The drafts were taken back: the matcher is after "a", and takes "b" next.
    bitmask = allocate_bitmask(1, vocab_size)
    grammar.fill_bitmask(bitmask, 0, [])
    assert torch.equal(bitmask[0], reference_row(compiled, [token["a"]], vocab_size))
    grammar.accept([token["b"]])
    grammar.fill_bitmask(bitmask, 0, [])
    assert not grammar.failed
    assert torch.equal(bitmask[0], reference_row(compiled, [token["a"], token["b"]], vocab_size))


# ---------------------------------------------------------------------------------------------------------------
# The engine on a tiny random Llama


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 1234}], ids=["greedy", "seeded"])
def test_regex_output_matches_the_whole_pattern(tiny_llm, sampling):
    params = constrained(max_tokens=16, sampling=sampling, regex=CODE_PATTERN)
    outputs = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop"
        assert re.fullmatch(CODE_PATTERN, completion.text), completion.text
    assert len({output.outputs[0].text for output in outputs}) > 1
    # Unconstrained, the same model writes no such thing.
    free = tiny_llm.generate(PROMPTS, SamplingParams(max_tokens=4, **{"temperature": 0.0, **sampling}), use_tqdm=False)
    assert not any(re.fullmatch(CODE_PATTERN, output.outputs[0].text) for output in free)


def test_choice_output_is_one_of_the_options(tiny_llm):
    for output in tiny_llm.generate(PROMPTS, constrained(choice=CHOICES), use_tqdm=False):
        assert output.outputs[0].finish_reason == "stop"
        assert output.outputs[0].text in CHOICES


def test_ebnf_grammar_output_derives_from_root(tiny_llm):
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
    for output in tiny_llm.generate(PROMPTS[:8], constrained(max_tokens=40, grammar=grammar), use_tqdm=False):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop"
        assert re.fullmatch(r"\(([0-9]|x)(,([0-9]|x))*\)", completion.text), completion.text


@pytest.mark.parametrize(
    "spec",
    [
        {"json": PERSON},
        {"json": json.dumps(TAGS)},
        {"json": NESTED},
        {"json": PERSON, "disable_any_whitespace": False},
    ],
    ids=["object", "array-of-enums-as-text", "nested", "free-whitespace"],
)
def test_json_output_validates_against_the_schema(tiny_llm, spec):
    params = constrained(max_tokens=96, **spec)
    completions = [output.outputs[0] for output in tiny_llm.generate(PROMPTS[:8], params, use_tqdm=False)]
    stopped = [completion for completion in completions if completion.finish_reason == "stop"]
    assert stopped, [completion.text for completion in completions]
    for completion in stopped:
        assert_valid(completion.text, params)
    first = "[" if spec.get("json") == json.dumps(TAGS) else "{"
    assert all(completion.text.startswith(first) for completion in completions)


@pytest.mark.parametrize(
    "string_schema",
    [
        FREE_TEXT,
        # xgrammar 0.2.8 lets control bytes into maxLength strings (xgrammar#800): we compile them as patterns.
        {"type": "string", "maxLength": 10},
    ],
    ids=["pattern", "max-length"],
)
def test_a_bias_toward_a_raw_control_character_cannot_break_the_json(tiny_llm, tokenizer, string_schema):
    (vertical_tab,) = tokenizer.encode("\x0b", add_special_tokens=False)
    schema = {"type": "object", "properties": {"text": string_schema}, "required": ["text"]}
    # The bias comes after the mask: it can only raise tokens the grammar allows.
    params = constrained(max_tokens=32, sampling={"logit_bias": {vertical_tab: 100.0}}, json=schema)
    for output in tiny_llm.generate(PROMPTS[:2], params, use_tqdm=False):
        assert output.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(output.outputs[0].text), schema)  # strict: no raw U+0000-U+001F in strings


@pytest.mark.parametrize(
    ("spec", "max_tokens"), [({"json": PERSON}, 4), ({"json_object": True}, 24)], ids=["schema", "json-object"]
)
def test_a_length_cut_leaves_a_prefix_of_valid_json(tiny_llm, grammar_compiler, spec, max_tokens):
    import xgrammar

    params = constrained(max_tokens=max_tokens, **spec)
    completions = [output.outputs[0] for output in tiny_llm.generate(PROMPTS[:8], params, use_tqdm=False)]
    cut = [completion for completion in completions if completion.finish_reason == "length"]
    assert cut  # random weights fill free strings and keys until the limit
    for completion in completions:
        assert completion.text.startswith("{")
        if completion.finish_reason == "stop":
            assert_valid(completion.text, params)
    for completion in cut:
        assert len(completion.token_ids) == max_tokens
        # The tokens so far are a prefix the schema's grammar takes, short of its end.
        matcher = xgrammar.GrammarMatcher(grammar_compiler.submit(params.structured_outputs).result(timeout=60).grammar)
        assert all(matcher.accept_token(token_id) for token_id in completion.token_ids), completion.text
        assert not matcher.is_terminated()


def test_n_seeded_completions_are_each_valid_and_differ(tiny_llm):
    params = constrained(max_tokens=64, sampling={"n": 3, "temperature": 1.0, "seed": 5}, json=LABELS)
    (output,) = tiny_llm.generate(PROMPTS[:1], params, use_tqdm=False)
    texts = [completion.text for completion in output.outputs]
    assert len(texts) == 3
    for completion in output.outputs:
        assert completion.finish_reason == "stop"
        assert_valid(completion.text, params)
    assert len(set(texts)) > 1
    (again,) = tiny_llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert [completion.text for completion in again.outputs] == texts  # seeded: the same three again
    assert_no_leaked_blocks(tiny_llm)


# ---------------------------------------------------------------------------------------------------------------
# The same constrained tokens with and without the engine's other features


def mixed_constraints() -> list[SamplingParams]:
    """Eight requests: regex, choice and JSON, greedy and seeded."""
    greedy = [
        constrained(max_tokens=48, regex="(ab){20}"),
        constrained(max_tokens=100, json=ROWS),
        constrained(max_tokens=48, json=PERSON),
        constrained(choice=CHOICES),
    ]
    return [*greedy, *(seeded(params, seed=index) for index, params in enumerate(greedy))]


def test_drafts_give_the_same_constrained_tokens_and_get_accepted(tiny_llm, make_llm, tiny_model_dir):
    """Greedy tokens equal those without drafts (seeded rows draw differently with drafts: only valid)."""
    params = mixed_constraints()
    prompts = PROMPTS[: len(params)]
    speculative = make_llm(tiny_model_dir, speculative_config=SPECULATIVE)
    outputs = speculative.generate(prompts, params, use_tqdm=False)
    expected = token_ids_of(tiny_llm, prompts, params)
    for output, request_params, tokens in zip(outputs, params, expected):
        completion = output.outputs[0]
        if request_params.is_greedy:
            assert completion.token_ids == tokens
        if completion.finish_reason == "stop":
            assert_valid(completion.text, request_params)
    assert speculative.engine.scheduler.num_accepted_draft_tokens > 0
    assert_no_leaked_blocks(speculative)


def test_preemption_gives_the_same_constrained_tokens(tiny_llm, make_llm, tiny_model_dir):
    params = mixed_constraints()
    prompts = PROMPTS[: len(params)]
    # 12 blocks of 16 tokens cannot hold eight requests of up to ~110 tokens: resumed matchers replay their tokens.
    crowded = make_llm(tiny_model_dir, num_kv_blocks=12)
    assert token_ids_of(crowded, prompts, params) == token_ids_of(tiny_llm, prompts, params)
    assert crowded.engine.scheduler.num_preemptions > 0
    assert_no_leaked_blocks(crowded)


def test_prefix_cache_hits_give_the_same_constrained_tokens(tiny_llm, make_llm, tiny_model_dir):
    shared = list(range(1000, 1040))  # two and a half blocks every prompt shares
    prompts = [[*shared, 2000 + index] for index in range(4)]
    params = [constrained(max_tokens=48, json=PERSON), constrained(regex=CODE_PATTERN)] * 2
    uncached = make_llm(tiny_model_dir, enable_prefix_caching=False)
    expected = token_ids_of(uncached, prompts, params)
    kv_cache = tiny_llm.engine.scheduler.kv_cache
    hits_before = kv_cache.prefix_cache_hits
    assert token_ids_of(tiny_llm, prompts, params) == expected
    assert token_ids_of(tiny_llm, prompts, params) == expected
    assert kv_cache.prefix_cache_hits > hits_before
    assert_no_leaked_blocks(tiny_llm)


def test_tensor_and_pipeline_parallel_give_the_same_constrained_tokens(ray_cluster, tiny_llm, tiny_model_dir):
    """Only the last stage's TP rank 0 holds matchers; the other three ranks learn the tokens from the plans."""
    from executor import LLM

    params = mixed_constraints()[:4]
    prompts = PROMPTS[: len(params)]
    expected = token_ids_of(tiny_llm, prompts, params)
    llm = LLM(
        model=str(tiny_model_dir),
        show_progress=False,
        num_kv_blocks=128,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        worker_num_cpus=0.5,
        num_threads=1,
    )
    try:
        assert token_ids_of(llm, prompts, params) == expected
        assert_no_leaked_blocks(llm)
    finally:
        llm.engine.shutdown()


def test_mixed_batch_leaves_unconstrained_requests_as_they_are_alone(tiny_llm):
    plain_greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain_seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    params = [
        constrained(regex=CODE_PATTERN),
        plain_greedy,
        seeded(constrained(max_tokens=48, json=PERSON), seed=9),
        plain_seeded,
        constrained(choice=CHOICES),
        plain_greedy,
    ]
    prompts = PROMPTS[: len(params)]
    together = token_ids_of(tiny_llm, prompts, params)
    alone = [token_ids_of(tiny_llm, [prompt], request_params)[0] for prompt, request_params in zip(prompts, params)]
    assert together == alone
    texts = [tiny_llm.tokenizer.decode(tokens, skip_special_tokens=True) for tokens in together]
    for text, request_params in zip(texts, params):
        if request_params.structured_outputs is not None:
            assert_valid(text, request_params)


# ---------------------------------------------------------------------------------------------------------------
# Bad constraints


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}, r"invalid json.*no-such-type"),
        ({"json": '{"type": '}, r"invalid json.*not valid JSON"),
        ({"regex": "(ab"}, "invalid regex"),
        ({"grammar": "root ::= undefined_rule"}, r"invalid grammar.*undefined_rule"),
    ],
    ids=["unknown-type", "not-json", "regex", "ebnf"],
)
def test_a_bad_constraint_raises_value_error_and_the_engine_keeps_serving(tiny_llm, spec, message):
    good = constrained(regex=CODE_PATTERN)
    with pytest.raises(ValueError, match=message):
        tiny_llm.generate(PROMPTS[:2], [good, constrained(**spec)], use_tqdm=False)
    assert_no_leaked_blocks(tiny_llm)
    (output,) = tiny_llm.generate(PROMPTS[:1], good, use_tqdm=False)
    assert re.fullmatch(CODE_PATTERN, output.outputs[0].text)
    assert_no_leaked_blocks(tiny_llm)


def test_params_with_no_or_two_constraints_are_refused():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match=r"exactly one of.*regex, choice"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])


# ---------------------------------------------------------------------------------------------------------------
# Async scheduling in the engine actor


def test_async_scheduling_gives_the_same_constrained_tokens(ray_cluster, tiny_model_dir, tokenizer):
    """Step N+1 is planned before step N's tokens are back; the runner still feeds each matcher in order."""
    import ray

    from tests.test_engine_actor import collect_completions, start_engine

    params = {f"r{index}": request_params for index, request_params in enumerate(mixed_constraints())}
    prompts = {request_id: tokenizer.encode(PROMPTS[index]) for index, request_id in enumerate(params)}

    def run(actor: Any, client_id: str) -> dict:
        for request_id, request_params in params.items():
            ray.get(actor.add_request.remote(client_id, request_id, prompts[request_id], request_params), timeout=30)
        return collect_completions(actor, client_id, {(request_id, 0) for request_id in params})

    pipelined_engine = start_engine(tiny_model_dir)
    stepwise_engine = start_engine(tiny_model_dir, async_scheduling=False)
    try:
        pipelined, stepwise = run(pipelined_engine, "client-async"), run(stepwise_engine, "client-sync")
        for key, completion in pipelined.items():
            assert (completion["tokens"], completion["finish"]) == (stepwise[key]["tokens"], stepwise[key]["finish"])
            if completion["finish"][0] == "stop":
                assert_valid(tokenizer.decode(completion["tokens"], skip_special_tokens=True), params[key[0]])
        with pytest.raises(ValueError, match="invalid regex"):
            bad = constrained(regex="(ab")
            ray.get(pipelined_engine.add_request.remote("client-async", "bad", [5, 6], bad), timeout=30)
        stats = ray.get(pipelined_engine.stats.remote(), timeout=30)
        assert stats.num_steps_planned_ahead > stats.num_steps / 2
        assert stats.num_waiting == stats.num_running == 0 and stats.num_free_blocks == stats.num_kv_blocks
    finally:
        ray.kill(pipelined_engine)
        ray.kill(stepwise_engine)


# ---------------------------------------------------------------------------------------------------------------
# SmolLM2


@pytest.mark.slow
def test_smollm2_chat_answer_validates_against_the_schema(smollm2_llm):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "pets": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
        },
        "required": ["name", "age", "pets"],
        "additionalProperties": False,
    }
    conversations = [
        [{"role": "user", "content": "Describe a fictional person as JSON with their name, age and pets."}],
        [{"role": "user", "content": "Who is the oldest person you know of? Answer in JSON."}],
    ]
    params = constrained(max_tokens=96, json=schema)
    for output in smollm2_llm.chat(conversations, params, use_tqdm=False):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)
    assert_no_leaked_blocks(smollm2_llm)


def test_offline_chat_shows_the_tools_and_the_call_history_to_the_template(tiny_model_dir, tmp_path, make_llm):
    """llm.chat(messages, tools=...) renders the tools, and an assistant's JSON-text arguments reach the template as
    an object (not a string encoded twice)."""
    llm = make_llm(with_tools_template(tiny_model_dir, tmp_path))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    prompt = llm.get_tokenizer().decode(llm.apply_chat_template(HISTORY, tools=tools))
    assert "Tools: get_weather" in prompt
    assert '<tool_call>get_weather {"city": "Paris", "days": 1, "metric": true}</tool_call>' in prompt
    assert "[call_abc123] sunny" in prompt
    assert "Tools:" not in llm.get_tokenizer().decode(llm.apply_chat_template(HISTORY))
    params = constrained(max_tokens=8, regex="[a-z]{3}")
    (output,) = llm.chat(HISTORY, params, use_tqdm=False, tools=tools)
    assert re.fullmatch("[a-z]{3}", output.outputs[0].text)


def test_a_slow_compile_holds_back_only_its_own_request(tiny_llm):
    """A new constraint compiles in the background while its request waits in the queue: the running requests keep
    stepping meanwhile, and the waiting one then runs constrained."""
    engine = tiny_llm.engine
    # Length-bounded strings make xgrammar's compile take ~1 s; a fresh property name defeats its cache.
    name = f"field_{uuid.uuid4().hex[:8]}"
    slow_schema = {
        "type": "object",
        "properties": {f"{name}_{index}": {"type": "string", "maxLength": 40} for index in range(4)},
        "required": [f"{name}_0"],
    }
    engine.add_request("plain", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    engine.step()
    params = constrained(max_tokens=300, json=slow_schema)
    engine.add_request("constrained", PROMPTS[1], params)
    held, running = engine.core.scheduler.requests["constrained#0"], engine.core.scheduler.requests["plain#0"]
    tokens_before = running.num_output_tokens
    final = {}
    while held.waits_for_grammar:
        final.update({output.request_id: output for output in engine.step()})
    assert running.num_output_tokens - tokens_before >= 2
    while engine.has_unfinished_requests():
        final.update({output.request_id: output for output in engine.step()})
    assert len(final["plain"].outputs[0].token_ids) == 400
    assert final["constrained"].outputs[0].finish_reason == "stop"
    assert_valid(final["constrained"].outputs[0].text, params)
    assert_no_leaked_blocks(tiny_llm)


def test_constrained_greedy_rows_go_through_the_bf16_screen_with_their_masks(tiny_model_dir, make_llm):
    """The screen ranks only the tokens each grammar allows: the same tokens as the fp32 head, and no fallback rows
    (a forbidden token scores a finite -1e30 in the screen, not an infinity that would send the row to the fp32
    head)."""
    params = [constrained(max_tokens=48, json=PERSON), constrained(regex=CODE_PATTERN), constrained(choice=CHOICES)]
    prompts = PROMPTS[: len(params)]
    results = {}
    for mode in ("on", "off"):
        llm = make_llm(tiny_model_dir, greedy_screening=mode)
        results[mode] = token_ids_of(llm, prompts, params)
        screen = llm.engine.core.executor.worker.runner.greedy_screen
        if mode == "on":
            assert screen.num_screened_rows == sum(map(len, results[mode]))
            assert screen.num_fallback_rows == 0
    assert results["on"] == results["off"]
    for output, request in zip(results["on"], params):
        assert_valid(llm.tokenizer.decode(output, skip_special_tokens=True), request)
