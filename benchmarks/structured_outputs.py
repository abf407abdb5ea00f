"""What structured outputs cost: throughput of N concurrent json_schema chat requests against the same requests
unconstrained (offline engine, SmolLM2 by default), and the time to compile a typical schema.

The unconstrained run generates exactly as many tokens per request as the constrained one did (ignore_eos and its
lengths), so both have the same batch shape step by step and only the grammar differs.

    python -m benchmarks.structured_outputs [--model smollm2-135m-instruct] [--num-requests 32] [--rounds 3]

Prints tok/s per round for both, their ratio, and the compile times; `--json PATH` writes them.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from configs.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

LENGTH_KEYS = ("maxLength", "minLength")
# A typical API payload: nested object, enum, integer range, bounded array, optional field.
TYPICAL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 60},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 30}},
            "required": ["street", "city"],
        },
    },
    "required": ["name", "age", "role", "address"],
}


def conversations(num_requests: int) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": f"Describe user number {index} of a web shop as a JSON record."}]
        for index in range(num_requests)
    ]


def run_round(llm, prompts, params: SamplingParams | list[SamplingParams]) -> tuple[float, list[int]]:
    """Seconds, and the tokens each request generated."""
    started = time.perf_counter()
    outputs = llm.chat(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    return elapsed, [len(output.outputs[0].token_ids) for output in outputs]


def without_length_bounds(schema: Any) -> Any:
    """The schema with maxLength/minLength dropped: xgrammar's compile time is mostly those bounds."""
    if isinstance(schema, dict):
        return {key: without_length_bounds(value) for key, value in schema.items() if key not in LENGTH_KEYS}
    return [without_length_bounds(item) for item in schema] if isinstance(schema, list) else schema


def compile_times(model_dir: Path, vocab_size: int, eos_token_ids: list[int]) -> dict[str, float]:
    """Seconds to check each schema (ingress and engine, first sight), and to compile it cold and cached (scheduler
    actor), for the typical schema and for it without its string length bounds."""
    from model_executor import structured_output

    compiler = structured_output.GrammarCompiler(model_dir, vocab_size, eos_token_ids)
    compiler.submit(StructuredOutputsParams(regex="warm")).result()  # tokenizer loaded: not the schema's cost
    times = {}
    for name, schema in (("typical", TYPICAL_SCHEMA), ("unbounded", without_length_bounds(TYPICAL_SCHEMA))):
        spec = StructuredOutputsParams(json=schema)
        structured_output._checked_constraints.clear()
        started = time.perf_counter()
        structured_output.check_structured_outputs(spec)
        times[f"{name}_check_s"] = time.perf_counter() - started
        started = time.perf_counter()
        compiler.submit(spec).result()
        times[f"{name}_compile_cold_s"] = time.perf_counter() - started
        started = time.perf_counter()
        compiler.submit(spec).result()
        times[f"{name}_compile_cached_s"] = time.perf_counter() - started
    compiler.shutdown()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from executor import LLM

    llm = LLM(model=args.model, show_progress=False, max_num_seqs=max(64, args.num_requests))
    info = llm.engine.core.model_info
    prompts = conversations(args.num_requests)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, structured_outputs=StructuredOutputsParams(json=TYPICAL_SCHEMA)
    )
    _, lengths = run_round(llm, prompts, constrained)  # compiles the schema and warms both paths
    plain = [SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True) for length in lengths]
    rates: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    for _ in range(args.rounds):
        for name, params in (("unconstrained", plain), ("json_schema", constrained)):
            elapsed, generated = run_round(llm, prompts, params)
            num_tokens = sum(generated)
            rates[name].append(num_tokens / elapsed)
            logger.info("%-14s %6d tokens in %6.2f s: %7.1f tok/s", name, num_tokens, elapsed, num_tokens / elapsed)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    ratio = medians["json_schema"] / medians["unconstrained"]
    times = compile_times(info.model_dir, info.vocab_size, sorted(info.eos_token_ids))
    logger.info(
        "median tok/s: unconstrained %.1f, json_schema %.1f (ratio %.3f)",
        medians["unconstrained"],
        medians["json_schema"],
        ratio,
    )
    for name in ("typical", "unbounded"):
        logger.info(
            "%s schema: check %.1f ms, compile cold %.1f ms, cached %.3f ms",
            name,
            1e3 * times[f"{name}_check_s"],
            1e3 * times[f"{name}_compile_cold_s"],
            1e3 * times[f"{name}_compile_cached_s"],
        )
    if args.json is not None:
        record = {"model": args.model, "num_requests": args.num_requests, "max_tokens": args.max_tokens}
        args.json.write_text(json.dumps({**record, "tok_s": rates, "ratio": ratio, **times}, indent=2) + "\n")


if __name__ == "__main__":
    main()
