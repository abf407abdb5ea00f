"""What structured outputs cost: throughput of N concurrent json_schema chat requests against the same requests
unconstrained (offline engine, SmolLM2 by default), and the time to compile a typical schema.

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

from configs.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

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


def run_round(llm, prompts, params: SamplingParams) -> tuple[float, int]:
    started = time.perf_counter()
    outputs = llm.chat(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    return elapsed, sum(len(output.outputs[0].token_ids) for output in outputs)


def compile_times(model_dir: Path, vocab_size: int, eos_token_ids: list[int]) -> dict[str, float]:
    """Seconds to check the schema (ingress), and to compile it cold and cached (sampling worker)."""
    from model_executor.structured_output import GrammarCompiler, check_structured_outputs

    spec = StructuredOutputsParams(json=TYPICAL_SCHEMA)
    started = time.perf_counter()
    check_structured_outputs(spec)
    checked = time.perf_counter() - started
    compiler = GrammarCompiler(model_dir, vocab_size, eos_token_ids)
    compiler.submit(StructuredOutputsParams(regex="warm")).result()  # tokenizer loaded: not the schema's cost
    started = time.perf_counter()
    compiler.submit(spec).result()
    cold = time.perf_counter() - started
    started = time.perf_counter()
    compiler.submit(spec).result()
    cached = time.perf_counter() - started
    compiler.shutdown()
    return {"check_s": checked, "compile_cold_s": cold, "compile_cached_s": cached}


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
    plain = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, structured_outputs=StructuredOutputsParams(json=TYPICAL_SCHEMA)
    )
    run_round(llm, prompts, constrained)  # compiles the schema and warms both paths
    rates: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    for _ in range(args.rounds):
        for name, params in (("unconstrained", plain), ("json_schema", constrained)):
            elapsed, num_tokens = run_round(llm, prompts, params)
            rates[name].append(num_tokens / elapsed)
            logger.info("%-14s %6d tokens in %6.2f s: %7.1f tok/s", name, num_tokens, elapsed, num_tokens / elapsed)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    ratio = medians["json_schema"] / medians["unconstrained"]
    times = compile_times(info.model_dir, info.vocab_size, sorted(info.eos_token_ids))
    logger.info(
        "median tok/s: unconstrained %.1f, json_schema %.1f (ratio %.3f); schema check %.1f ms, compile cold %.1f ms, "
        "cached %.3f ms",
        medians["unconstrained"],
        medians["json_schema"],
        ratio,
        1e3 * times["check_s"],
        1e3 * times["compile_cold_s"],
        1e3 * times["compile_cached_s"],
    )
    if args.json is not None:
        record = {"model": args.model, "num_requests": args.num_requests, "max_tokens": args.max_tokens}
        args.json.write_text(json.dumps({**record, "tok_s": rates, "ratio": ratio, **times}, indent=2) + "\n")


if __name__ == "__main__":
    main()
