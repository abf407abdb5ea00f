"""Throughput on a lent GPU: our offline `LLM` and our HTTP server against HF `generate` and the HBM roofline.

    python -m benchmarks.gpu_bench offline --shape {smollm2,llama3-8b,tiny} [--device cuda] [--streams 1,64,256]
        [--json-out FILE]
    python -m benchmarks.gpu_bench http --shape smollm2 [--device cuda] [--streams 1,64,256] [--json-out FILE]
    python -m benchmarks.gpu_bench report A.json B.json ... [--json-out FILE] [--table-out FILE]

Each shape is a Llama-architecture config with random weights generated on the device itself (no download) and
written as one safetensors file to local disk, with SmolLM2's tokenizer: `smollm2` is SmolLM2-135M's shapes,
`llama3-8b` Llama-3-8B's (16 GB in bf16), `tiny` a small Llama with Llama 3's vocabulary so a CPU test runs the same
code path. Prompts are random token ids (HTTP: random words, as `pagedserve bench` sends them); greedy, ignore_eos,
every stream at once; one stream is the median of three runs.

`offline` times HF `generate` first (static batch of the same prompts and lengths, capped by `--hf-max-time-s` per
run: a capped run counts the tokens it made), frees it, then our `LLM` with its KV cache sized by
gpu_memory_utilization. The roofline is the copy bandwidth measured in the same process (bytes read + written over
the time of a device-to-device copy) over the weight bytes a decode step reads (every weight but an untied input
embedding, whose rows are gathered): one stream's ceiling in tok/s. `http` serves the same model with `pagedserve
serve` and measures it with our bench client. `report` merges their JSON into one markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.offline_throughput import SMOLLM2_SHAPE

# Not __name__: run with `python -m`, that is "__main__".
logger = logging.getLogger("gpu_bench")

ROPE_LLAMA3 = {"rope_theta": 500000.0, "rope_type": "default"}
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2": {**SMOLLM2_SHAPE, "vocab_size": 49152},
    "llama3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "max_position_embeddings": 8192,
        "rope_parameters": ROPE_LLAMA3,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "max_position_embeddings": 2048,
        "rope_parameters": ROPE_LLAMA3,
    },
}
WEIGHT_STD = 0.02
# Prompt ids come from SmolLM2's vocabulary (the tokenizer every shape carries), past its special tokens.
PROMPT_VOCAB = 49152
HTTP_PORT = 8000
SERVER_READY_TIMEOUT_S = 240.0


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    import platform

    return platform.processor() or platform.machine()


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def shape_config(shape: str, dtype: torch.dtype) -> Any:
    """HF's LlamaConfig of `shape` in `dtype`, its initializer_range the std the random weights are drawn with."""
    from transformers import LlamaConfig

    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        bos_token_id=1,
        eos_token_id=2,
        rms_norm_eps=1e-5,
        dtype=str(dtype).removeprefix("torch."),
        # SmolLM2's shape carries its own initializer_range: ours wins, as the weights are drawn with it.
        **{**SHAPES[shape], "initializer_range": WEIGHT_STD},
    )


def build_random_model(shape: str, directory: Path, device: str, dtype: torch.dtype) -> dict[str, Any]:
    """Write `shape`'s config, seed-0 random weights generated on `device`, and SmolLM2's tokenizer into
    `directory`. Returns the bytes written and the bytes one decode step reads."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    from configs.engine_config import DEFAULT_MODEL
    from model_executor.model_fetch import fetch_model
    from model_executor.tiny_model import TOKENIZER_FILES

    started = time.perf_counter()
    config = shape_config(shape, dtype)
    # Names and shapes from HF's own module, on the meta device: no memory, no init.
    with torch.device("meta"):
        names_and_shapes = {name: tuple(t.shape) for name, t in LlamaForCausalLM(config).state_dict().items()}
    if config.tie_word_embeddings:
        names_and_shapes.pop("lm_head.weight", None)
    generator = torch.Generator(device=device).manual_seed(0)
    host_tensors = {}
    bytes_read_per_step = 0
    for name, tensor_shape in names_and_shapes.items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(tensor_shape, dtype=dtype, device=device)
        else:
            tensor = torch.empty(tensor_shape, dtype=dtype, device=device).normal_(0.0, WEIGHT_STD, generator=generator)
        host_tensors[name] = tensor.cpu()
        if not (name == "model.embed_tokens.weight" and not config.tie_word_embeddings):
            bytes_read_per_step += tensor.numel() * tensor.element_size()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(host_tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    bytes_written = sum(tensor.numel() * tensor.element_size() for tensor in host_tensors.values())
    del host_tensors
    config.save_pretrained(directory)
    tokenizer_source = fetch_model(DEFAULT_MODEL)
    for name in TOKENIZER_FILES:
        if (tokenizer_source / name).exists() and name != "generation_config.json":
            (directory / name).write_bytes((tokenizer_source / name).read_bytes())
    elapsed = time.perf_counter() - started
    logger.info("built %s-shaped random model in %s: %.2f GB in %.1f s", shape, directory, bytes_written / 1e9, elapsed)
    return {"weight_bytes": bytes_written, "weight_bytes_read_per_step": bytes_read_per_step, "build_s": elapsed}


def copy_bandwidth(device: str, repeats: int = 20) -> float:
    """Bytes/s of a device-to-device copy (bytes read + written), median of `repeats` after warm-up."""
    nbytes = 2**31 if device == "cuda" else 2**27
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        if device == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            target.copy_(source)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            target.copy_(source)
            times.append(time.perf_counter() - started)
    del source, target
    return 2 * nbytes / statistics.median(times)


def free_device_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def hf_throughput(
    model_dir: Path,
    device: str,
    dtype: torch.dtype,
    prompts: dict[int, list[list[int]]],
    output_len: int,
    max_time_s: float,
) -> dict[int, dict[str, Any]]:
    """streams -> HF `generate` on a static batch of those prompts: tok/s, or the error it raised (OOM)."""
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map=device).eval()
    logger.info("HF model loaded in %.1f s", time.perf_counter() - started)
    results: dict[int, dict[str, Any]] = {}
    settings = {"do_sample": False, "pad_token_id": 0, "max_time": max_time_s}
    try:
        with torch.inference_mode():
            warm = torch.tensor(prompts[min(prompts)][:1], device=device)
            model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, min_new_tokens=4, **settings)
            for streams, stream_prompts in prompts.items():
                input_ids = torch.tensor(stream_prompts, device=device)
                try:
                    synchronize(device)
                    begin = time.perf_counter()
                    output = model.generate(
                        input_ids,
                        attention_mask=torch.ones_like(input_ids),
                        max_new_tokens=output_len,
                        min_new_tokens=output_len,
                        **settings,
                    )
                    synchronize(device)
                    elapsed = time.perf_counter() - begin
                except torch.OutOfMemoryError as error:
                    logger.warning("HF at %d streams: out of memory (%s)", streams, str(error).splitlines()[0])
                    results[streams] = {"hf_error": "out of memory"}
                    del error
                    free_device_memory(device)
                    continue
                new_tokens = output.shape[1] - input_ids.shape[1]
                results[streams] = {
                    "hf_tok_per_s": streams * new_tokens / elapsed,
                    "hf_tokens_per_stream": new_tokens,
                    "hf_capped": new_tokens < output_len,
                }
                logger.info(
                    "HF generate, %d streams: %d tokens each in %.2f s, %.1f tok/s%s",
                    streams,
                    new_tokens,
                    elapsed,
                    results[streams]["hf_tok_per_s"],
                    f" (stopped at the {max_time_s:.0f} s cap)" if new_tokens < output_len else "",
                )
                del output, input_ids
    finally:
        del model
        free_device_memory(device)
    return results


def ours_throughput(
    model_dir: Path,
    device: str,
    dtype: torch.dtype,
    prompts: dict[int, list[list[int]]],
    output_len: int,
    gpu_memory_utilization: float,
) -> tuple[dict[int, float], dict[str, Any]]:
    """streams -> our offline `LLM` output tok/s, and facts about the engine (start-up time, KV blocks)."""
    from cluster.bench.offline import time_generate
    from configs.sampling_params import SamplingParams
    from executor import LLM

    started = time.perf_counter()
    engine_args: dict[str, Any] = {
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "max_num_seqs": max(prompts),
        "max_num_batched_tokens": 16384 if device == "cuda" else 2048,
        # Distinct random prompts: a repeated one-stream run must not skip its prefill.
        "enable_prefix_caching": False,
    }
    if device == "cuda":
        engine_args["gpu_memory_utilization"] = gpu_memory_utilization
    llm = LLM(model=str(model_dir), show_progress=False, **engine_args)
    facts = {"engine_start_s": time.perf_counter() - started, "num_kv_blocks": llm.engine.core.executor.num_kv_blocks}
    logger.info("our engine started in %.1f s, %d KV blocks", facts["engine_start_s"], facts["num_kv_blocks"])
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    try:
        # Warm-up at every stream count: the first step of a new batch shape pays one-time costs (kernel builds).
        for stream_prompts in prompts.values():
            llm.generate(stream_prompts, params, use_tqdm=False)
        rates = {}
        for streams, stream_prompts in prompts.items():
            # The median of three: a small model's runs last well under a second, and one timing swings.
            run = time_generate(llm, stream_prompts, params, repeats=3)
            rates[streams] = run.output_tok_per_s
            logger.info("ours, %d streams: %.1f tok/s (%.2f s)", streams, run.output_tok_per_s, run.elapsed_s)
    finally:
        llm.engine.shutdown()
        del llm
        free_device_memory(device)
    return rates, facts


def common_facts(shape: str, device: str, dtype: torch.dtype, model_facts: dict[str, Any]) -> dict[str, Any]:
    bandwidth = copy_bandwidth(device)
    roofline = bandwidth / model_facts["weight_bytes_read_per_step"]
    logger.info(
        "copy bandwidth %.0f GB/s; %.2f GB read per decode step: batch-1 roofline %.1f tok/s",
        bandwidth / 1e9,
        model_facts["weight_bytes_read_per_step"] / 1e9,
        roofline,
    )
    return {
        "shape": shape,
        "device": device,
        "device_name": device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "roofline_tok_per_s": roofline,
        **model_facts,
    }


def model_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def random_prompts(counts: list[int], input_len: int) -> dict[int, list[list[int]]]:
    from cluster.bench.workload import random_token_prompts

    return random_token_prompts(counts, input_len, vocab_size=PROMPT_VOCAB)


def run_offline(args: argparse.Namespace) -> dict[str, Any]:
    dtype = model_dtype(args.device)
    counts = [int(count) for count in args.streams.split(",")]
    with tempfile.TemporaryDirectory(prefix=f"{args.shape}-random-", dir=args.work_dir) as directory:
        model_dir = Path(directory)
        model_facts = build_random_model(args.shape, model_dir, args.device, dtype)
        result = common_facts(args.shape, args.device, dtype, model_facts)
        prompts = random_prompts(counts, args.input_len)
        result.update(input_len=args.input_len, output_len=args.output_len, hf_max_time_s=args.hf_max_time_s)
        hf = {}
        if not args.skip_hf:
            hf = hf_throughput(model_dir, args.device, dtype, prompts, args.output_len, args.hf_max_time_s)
        ours, engine_facts = ours_throughput(
            model_dir, args.device, dtype, prompts, args.output_len, args.gpu_memory_utilization
        )
    result.update(engine_facts)
    result["rows"] = [
        {"mode": "offline", "streams": streams, "ours_tok_per_s": ours[streams], **hf.get(streams, {})}
        for streams in counts
    ]
    return result


def run_http(args: argparse.Namespace) -> dict[str, Any]:
    """Serve the shape's random model with `pagedserve serve` and measure each stream count with our bench client."""
    try:
        import ray  # noqa: F401
    except ImportError:
        logger.warning("skipped: ray not installed on this machine")
        return {"shape": args.shape, "device": args.device, "rows": [], "skipped": "ray not installed on this machine"}
    from benchmarks.run_matrix import start_server, stop_server
    from cluster.bench.serving import run_benchmark

    dtype = model_dtype(args.device)
    counts = [int(count) for count in args.streams.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix=f"{args.shape}-random-", dir=args.work_dir) as directory:
        model_dir = Path(directory)
        model_facts = build_random_model(args.shape, model_dir, args.device, dtype)
        result = common_facts(args.shape, args.device, dtype, model_facts)
        free_device_memory(args.device)
        command = [
            sys.executable,
            "-m",
            "cluster.cli",
            "serve",
            str(model_dir),
            "--device",
            args.device,
            "--dtype",
            result["dtype"],
            "--port",
            str(args.port),
            "--max-num-seqs",
            str(max(counts)),
            "--max-num-batched-tokens",
            str(16384 if args.device == "cuda" else 2048),
            "--no-enable-prefix-caching",
        ]
        if args.device == "cuda":
            command += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        server_log = Path(args.server_log) if args.server_log else model_dir / "server.log"
        logger.info("starting %s (log %s)", " ".join(command), server_log)
        started = time.perf_counter()
        # The stage's timeout sends SIGTERM: exit through the finally below, which stops the server.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        process = start_server(command, dict(os.environ), args.port, server_log, SERVER_READY_TIMEOUT_S)
        result["server_start_s"] = time.perf_counter() - started
        logger.info("server answered after %.1f s", result["server_start_s"])
        try:
            for streams in counts:
                # The first pass at a stream count pays one-time costs (kernel builds for new batch shapes): untimed.
                for seed in (200 + streams, 100 + streams):
                    summary = asyncio.run(
                        run_benchmark(
                            {
                                "base_url": f"http://127.0.0.1:{args.port}/v1",
                                "num_prompts": 4 if streams == 1 else streams,
                                "max_concurrency": streams,
                                "input_len": args.input_words,
                                "output_len": args.output_len,
                                "seed": seed,
                                "disable_tqdm": True,
                            }
                        )
                    )["summary"]
                rows.append(
                    {
                        "mode": "HTTP",
                        "streams": streams,
                        "ours_tok_per_s": summary["output_throughput"],
                        "failed": summary["failed"],
                        "median_ttft_ms": summary.get("median_ttft_ms"),
                        "median_itl_ms": summary.get("median_itl_ms"),
                    }
                )
                logger.info("HTTP, %d streams: %.1f tok/s", streams, summary["output_throughput"])
            result.update(input_words=args.input_words, output_len=args.output_len, rows=rows)
            # Written before the server stops: a slow stop must not lose the figures to the stage's timeout.
            if args.json_out:
                Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
        finally:
            stop_server(process)
    result.update(input_words=args.input_words, output_len=args.output_len, rows=rows)
    return result


def ratio(numerator: float | None, denominator: float | None) -> str:
    return f"{numerator / denominator:.2f}x" if numerator and denominator else "-"


def rate(value: float | None) -> str:
    return f"{value:,.1f}" if value is not None else "-"


def format_table(results: list[dict[str, Any]]) -> str:
    """One markdown table of every row; HTTP rows take HF from the offline row of the same shape and streams."""
    hf_by_key = {
        (result["shape"], row["streams"]): row
        for result in results
        for row in result.get("rows", [])
        if row["mode"] == "offline"
    }
    lines = [
        "| shape | mode | streams | ours tok/s | HF tok/s | ours/HF | ours/roofline (1 stream) |",
        "|---|---|---|---|---|---|---|",
    ]
    notes = []
    for result in results:
        if result.get("skipped"):
            notes.append(f"- {result['shape']} HTTP: skipped: {result['skipped']}")
            continue
        notes.append(
            f"- {result['shape']} {result['rows'][0]['mode'] if result['rows'] else ''} ({result['dtype']}, "
            f"{result['device_name']}): {result['weight_bytes_read_per_step'] / 1e9:.2f} GB read per decode step, "
            f"copy bandwidth {result['copy_bandwidth_gb_s']:,.0f} GB/s, batch-1 roofline "
            f"{result['roofline_tok_per_s']:,.1f} tok/s"
        )
        for row in result["rows"]:
            hf_row = hf_by_key.get((result["shape"], row["streams"]), {})
            hf = hf_row.get("hf_tok_per_s")
            hf_cell = rate(hf) if hf is not None else hf_row.get("hf_error", "-")
            if hf_row.get("hf_capped"):
                hf_cell += f" ({hf_row['hf_tokens_per_stream']} tokens, capped)"
            roofline = ratio(row["ours_tok_per_s"], result["roofline_tok_per_s"]) if row["streams"] == 1 else ""
            lines.append(
                f"| {result['shape']} | {row['mode']} | {row['streams']} | {rate(row['ours_tok_per_s'])} | {hf_cell} "
                f"| {ratio(row['ours_tok_per_s'], hf)} | {roofline} |"
            )
    return "\n".join([*lines, "", *notes])


def run_report(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    for path in args.inputs:
        try:
            results.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as error:
            logger.warning("left out %s: %s", path, error)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("offline", "http"):
        command = commands.add_parser(name)
        command.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
        command.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
        command.add_argument("--streams", default="1,64,256", help="comma-separated stream counts")
        command.add_argument("--output-len", type=int, default=128, help="output tokens per stream")
        command.add_argument("--gpu-memory-utilization", type=float, default=0.85)
        command.add_argument("--work-dir", default=None, help="where the random model is written (default: TMPDIR)")
        command.add_argument("--json-out", default=None)
    offline, http = commands.choices["offline"], commands.choices["http"]
    offline.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    offline.add_argument("--hf-max-time-s", type=float, default=20.0, help="cap on one HF generate call")
    offline.add_argument("--skip-hf", action="store_true")
    http.add_argument("--input-words", type=int, default=100, help="random words per prompt (about 128 tokens)")
    http.add_argument("--port", type=int, default=HTTP_PORT)
    http.add_argument("--server-log", default=None)
    report = commands.add_parser("report")
    report.add_argument("inputs", nargs="*")
    report.add_argument("--json-out", default=None)
    report.add_argument("--table-out", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.command != "report" and args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine")
    if args.command == "report":
        results = run_report(args)
        payload: Any = results
    else:
        result = run_offline(args) if args.command == "offline" else run_http(args)
        results, payload = [result], result
    table = format_table(results)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(payload, indent=2) + "\n")
    if getattr(args, "table_out", None):
        Path(args.table_out).write_text(table + "\n")
    print(table)  # the table is the command's output
    return 0


if __name__ == "__main__":
    sys.exit(main())
