"""`pagedserve bench`: the pure metric math on hand-made records, SSE parsing on canned streams, the baselines on a
tiny model, and real runs over HTTP against a tiny model deployed on Ray Serve."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from cluster.bench.baselines import cpu_dtype_name, hf_generate_throughput, matmul_roofline, workload_ceiling
from cluster.bench.client import RequestRecord, client_session, run_client, send_request
from cluster.bench.config import BenchConfig, parse_batch_sizes
from cluster.bench.serving import baseline_model_dir, run_benchmark
from cluster.bench.stats import format_report, percentile, summarize
from cluster.bench.workload import arrival_gaps, output_length_bounds, output_lengths, synthetic_prompts
from cuda_ext.cpu_ops import load_cpu_ops
from model_executor.cpu_features import cpu_has_amx_bf16, cpu_has_bf16_dot_products

SUMMARY_KEYS = {
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "max_concurrent_requests",
} | {f"{stat}_{name}_ms" for stat in ("mean", "median", "std", "p99") for name in ("ttft", "tpot", "itl", "e2el")}


# ---------------------------------------------------------------------------------------------------------------
# Pure functions


def hand_made_records() -> list[RequestRecord]:
    return [
        RequestRecord(
            success=True,
            start_s=0.0,
            latency_s=0.16,
            ttft_s=0.10,
            itl_s=[0.02, 0.04],
            output_tokens=3,
            prompt_tokens=10,
        ),
        RequestRecord(
            success=True,
            start_s=0.5,
            latency_s=0.34,
            ttft_s=0.30,
            itl_s=[0.01, 0.03],
            output_tokens=3,
            prompt_tokens=20,
        ),
        # A failure with wild numbers: it must not leak into any latency statistic or token count.
        RequestRecord(success=False, start_s=0.1, latency_s=9.0, ttft_s=5.0, itl_s=[7.0], output_tokens=99, error="x"),
    ]


def test_percentile_interpolates_like_numpy():
    assert percentile([1.0], 99) == 1.0
    assert percentile([100.0, 300.0], 50) == pytest.approx(200.0)
    assert percentile([100.0, 300.0], 99) == pytest.approx(298.0)
    assert percentile([40.0, 10.0, 30.0, 20.0], 99) == pytest.approx(39.7)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summarize_known_values():
    summary = summarize(hand_made_records(), duration_s=2.0)
    assert set(summary) >= SUMMARY_KEYS
    assert summary["completed"] == 2
    assert summary["failed"] == 1
    assert summary["duration"] == 2.0
    assert summary["total_output_tokens"] == 6
    assert summary["total_input_tokens"] == 30
    assert summary["request_throughput"] == pytest.approx(1.0)
    assert summary["output_throughput"] == pytest.approx(3.0)
    assert summary["total_token_throughput"] == pytest.approx(18.0)
    # TTFT 100 and 300 ms.
    assert summary["mean_ttft_ms"] == pytest.approx(200.0)
    assert summary["median_ttft_ms"] == pytest.approx(200.0)
    assert summary["p99_ttft_ms"] == pytest.approx(298.0)
    assert summary["std_ttft_ms"] == pytest.approx(100.0)
    # TPOT (e2e - ttft) / (tokens - 1): 60/2 = 30 ms and 40/2 = 20 ms.
    assert summary["mean_tpot_ms"] == pytest.approx(25.0)
    assert summary["median_tpot_ms"] == pytest.approx(25.0)
    assert summary["p99_tpot_ms"] == pytest.approx(29.9)
    # ITL over every gap of every successful request: 20, 40, 10, 30 ms.
    assert summary["mean_itl_ms"] == pytest.approx(25.0)
    assert summary["median_itl_ms"] == pytest.approx(25.0)
    assert summary["p99_itl_ms"] == pytest.approx(39.7)
    assert summary["mean_e2el_ms"] == pytest.approx(250.0)
    # The failed request (0.1 .. 9.1 s) overlaps each of the others, which do not overlap each other.
    assert summary["max_concurrent_requests"] == 2


def test_summarize_duration_defaults_to_first_start_to_last_end():
    records = hand_made_records()[:2]
    summary = summarize(records)
    assert summary["duration"] == pytest.approx(0.84)
    assert summary["output_throughput"] == pytest.approx(6 / 0.84)
    assert summary["max_concurrent_requests"] == 1


def test_summarize_single_token_requests_have_no_tpot_and_all_failed_has_no_latencies():
    one_token = RequestRecord(success=True, latency_s=0.1, ttft_s=0.1, output_tokens=1, prompt_tokens=5)
    summary = summarize([one_token], duration_s=1.0)
    assert summary["mean_tpot_ms"] is None
    assert summary["mean_ttft_ms"] == pytest.approx(100.0)
    failed = summarize([RequestRecord(error="HTTP 500")], duration_s=1.0)
    assert failed["completed"] == 0
    assert failed["failed"] == 1
    assert failed["mean_ttft_ms"] is None
    assert failed["output_throughput"] == 0.0
    assert "n/a" in format_report(failed)


def test_report_lists_the_vllm_lines():
    report = format_report(summarize(hand_made_records(), 2.0), BenchConfig(max_concurrency=4))
    for label in (
        "Successful requests:",
        "Failed requests:",
        "Benchmark duration (s):",
        "Request throughput (req/s):",
        "Output token throughput (tok/s):",
        "Total token throughput (tok/s):",
        "Mean TTFT (ms):",
        "Median TPOT (ms):",
        "P99 ITL (ms):",
    ):
        assert label in report


def test_dataset_and_schedule_are_seeded():
    prompts = synthetic_prompts(4, 12, seed=0, shared_prefix_words=5)
    assert prompts == synthetic_prompts(4, 12, seed=0, shared_prefix_words=5)
    assert prompts != synthetic_prompts(4, 12, seed=1, shared_prefix_words=5)
    assert all(len(prompt.split()) == 17 for prompt in prompts)
    assert len({" ".join(prompt.split()[:5]) for prompt in prompts}) == 1
    assert arrival_gaps(3, math.inf, 0) == [0.0, 0.0, 0.0]
    gaps = arrival_gaps(2000, 20.0, 0)
    assert gaps[0] == 0.0  # the first request goes at once, as in vllm
    assert gaps == arrival_gaps(2000, 20.0, 0)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20.0, rel=0.1)


def test_output_lengths_spread_as_vllms_random_range_ratio():
    # vllm's bounds: floor(len * (1 - r)) to ceil(len * (1 + r)), both included, at least 1.
    assert output_length_bounds(144, 0.775) == (32, 256)
    assert output_length_bounds(144, 0.78) == (31, 257)
    assert output_length_bounds(100, 0.1) == (90, 110)
    assert output_length_bounds(1, 0.9) == (1, 2)
    assert output_lengths(5, 64, 0.0, seed=3) == [64] * 5
    lengths = output_lengths(2000, 144, 0.775, seed=3)
    assert lengths == output_lengths(2000, 144, 0.775, seed=3)
    assert lengths != output_lengths(2000, 144, 0.775, seed=4)
    assert (min(lengths), max(lengths)) == (32, 256)
    assert sum(lengths) / len(lengths) == pytest.approx(144, rel=0.05)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        output_length_bounds(64, 1.0)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
        ({"temperature": math.nan}, "temperature must be a finite number >= 0"),
        ({"temperature": math.inf}, "temperature must be a finite number >= 0"),
        ({"random_range_ratio": 1.0}, r"random_range_ratio must be in \[0, 1\)"),
        ({"random_range_ratio": -0.1}, r"random_range_ratio must be in \[0, 1\)"),
    ],
)
def test_bad_temperature_or_range_ratio_is_refused_before_any_request(settings, message):
    # Nothing listens on this port: the settings must fail before the first connection.
    with pytest.raises(ValueError, match=message):
        asyncio.run(run_benchmark({"base_url": "http://127.0.0.1:9/v1", "model": "m", **settings}))


def test_the_cli_flags_map_onto_the_config():
    from cluster.cli import build_parser

    parser = build_parser()
    defaults = BenchConfig.from_any(parser.parse_args(["bench"]))
    assert (defaults.temperature, defaults.random_range_ratio, defaults.dtype) == (0.0, 0.0, "auto")
    args = parser.parse_args(["bench", "--temperature", "0.8", "--random-range-ratio", "0.775"])
    assert (BenchConfig.from_any(args).temperature, BenchConfig.from_any(args).random_range_ratio) == (0.8, 0.775)
    assert BenchConfig.from_any(parser.parse_args(["bench", "--dtype", "bfloat16"])).dtype == "bfloat16"
    bad = parser.parse_args(["bench", "--base-url", "http://127.0.0.1:9/v1", "--random-range-ratio", "1.5"])
    with pytest.raises(ValueError, match="random_range_ratio"):
        asyncio.run(run_benchmark(bad))


def test_batch_sizes_parse_from_strings_and_sequences():
    assert parse_batch_sizes("8,16,32") == (8, 16, 32)
    assert parse_batch_sizes(" 2, 4 ,") == (2, 4)
    assert parse_batch_sizes([4]) == (4,)
    assert BenchConfig(hf_batch_sizes="2,4").hf_batch_sizes == (2, 4)
    assert BenchConfig.from_any({"hf_batch_sizes": "3"}).hf_batch_sizes == (3,)
    for bad in ("", "2,x", "0,4", "-1"):
        with pytest.raises(ValueError):
            parse_batch_sizes(bad)


# ---------------------------------------------------------------------------------------------------------------
# Baselines on the tiny model (2 layers, hidden 64)


def test_baseline_model_dir_resolves_aliases_and_needs_a_dir_otherwise(tiny_model_dir):
    assert baseline_model_dir(None, "tiny-random-llama") == tiny_model_dir
    assert baseline_model_dir(str(tiny_model_dir), "anything-served") == tiny_model_dir
    with pytest.raises(ValueError, match="--model-dir"):
        baseline_model_dir(None, "some/unknown-model")


def test_matmul_roofline_on_the_tiny_model(tiny_model_dir):
    for batch_size in (1, 4):
        result = matmul_roofline(tiny_model_dir, batch_size, iterations=3, warmup=1, show_progress=False)
        assert result["batch_size"] == batch_size
        assert result["tok_per_s"] > 0
        assert result["step_time_s"] > 0
        assert result["tok_per_s"] == pytest.approx(batch_size / result["step_time_s"])
        assert result["num_matmuls"] == 2 * 4 + 1  # qkv, o, gate_up, down per layer, then the LM head
        # hidden 64, 4 heads / 2 KV heads of 16, intermediate 128, vocab 49152, untied LM head.
        per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 64 * 2 * 128 + 128 * 64
        assert result["linear_params"] == 2 * per_layer + 49152 * 64
        # The head the engine runs for greedy rows: bf16 where it screens them (CPUs with bf16 dot products).
        assert result["lm_head"] == ("bf16 (greedy screen)" if cpu_has_bf16_dot_products() else "float32")
    fp32_head = matmul_roofline(tiny_model_dir, 4, iterations=2, show_progress=False, greedy_head=False)
    assert fp32_head["lm_head"] == "float32"
    # A bf16 model: its greedy rows' head is the fused argmax on AMX tiles, else its plain bf16 head.
    bf16 = matmul_roofline(tiny_model_dir, 4, iterations=2, show_progress=False, dtype="bfloat16")
    ops = load_cpu_ops()
    fused = cpu_has_amx_bf16() and getattr(ops, "has_amx", False) and ops.amx_usable()
    assert bf16["lm_head"] == ("bf16 (fused greedy argmax)" if fused else "bfloat16")
    assert bf16["dtype"] == "bfloat16" and bf16["tok_per_s"] > 0
    prefill = matmul_roofline(tiny_model_dir, 8, iterations=2, show_progress=False, include_lm_head=False)
    assert prefill["num_matmuls"] == 2 * 4 and prefill["linear_params"] == 2 * per_layer
    assert prefill["lm_head"] is None


def test_workload_ceiling_adds_up_the_prefill_and_decode_matmuls(tiny_model_dir):
    prompt_token_counts = [30, 10, 20, 40]
    ceiling = workload_ceiling(tiny_model_dir, prompt_token_counts, 5, prefill_chunk_tokens=32, iterations=3)
    assert ceiling["num_requests"] == 4 and ceiling["prompt_tokens"] == 100
    assert ceiling["prefill_linears_s"] > 0 and ceiling["decode_linears_s"] > 0
    total_s = ceiling["prefill_linears_s"] + ceiling["decode_linears_s"]
    assert ceiling["output_tok_per_s"] == pytest.approx(4 * 5 / total_s)
    # The first half of the burst (two requests, 40 of the 100 prompt tokens) is prefilled first.
    assert ceiling["ttft_p50_floor_s"] == pytest.approx(ceiling["prefill_linears_s"] * 40 / 100)
    # dtype auto on a float32 checkpoint: float32 weights, as the engine loads them on CPU.
    assert ceiling["dtype"] == "float32"


def test_workload_ceiling_in_bfloat16_times_bfloat16_weights(tiny_model_dir):
    ceiling = workload_ceiling(
        tiny_model_dir, [30, 10], 3, prefill_chunk_tokens=32, iterations=2, dtype="bfloat16", show_progress=False
    )
    # Read from the weights the roofline timed: the float32 checkpoint was loaded as bf16.
    assert ceiling["dtype"] == "bfloat16"
    assert ceiling["output_tok_per_s"] > 0 and ceiling["ttft_p50_floor_s"] > 0


def test_hf_generate_throughput_on_the_tiny_model(tiny_model_dir):
    prompts = synthetic_prompts(4, 6, seed=5)
    runs = hf_generate_throughput(tiny_model_dir, prompts, 4, [2, 4], show_progress=False)
    assert [run["batch_size"] for run in runs] == [2, 4]
    for run in runs:
        assert run["generated_tokens"] == 4 * 4
        assert run["output_tok_per_s"] > 0
        assert run["elapsed_s"] > 0
        assert run["prompt_tokens"] >= 4 * 6
        assert run["dtype"] == "float32"


def test_hf_generate_throughput_in_bfloat16(tiny_model_dir):
    prompts = synthetic_prompts(2, 6, seed=5)
    runs = hf_generate_throughput(tiny_model_dir, prompts, 3, [2], dtype="bfloat16", show_progress=False)
    assert [run["dtype"] for run in runs] == ["bfloat16"]
    assert runs[0]["generated_tokens"] == 2 * 3 and runs[0]["output_tok_per_s"] > 0
    with pytest.raises(ValueError, match="float64"):
        hf_generate_throughput(tiny_model_dir, prompts, 3, [2], dtype="float64", show_progress=False)


def test_auto_dtype_on_cpu_follows_the_checkpoint_and_the_cpu(tiny_model_dir, tmp_path):
    # A float32 checkpoint stays float32 on CPU; a bfloat16 one runs bf16 where the CPU has bf16 dot products.
    assert cpu_dtype_name(tiny_model_dir, "auto") == "float32"
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16", "torch_dtype": "bfloat16"}))
    assert cpu_dtype_name(tmp_path, "auto") == ("bfloat16" if cpu_has_bf16_dot_products() else "float32")
    assert cpu_dtype_name(tmp_path, "float32") == "float32"


# ---------------------------------------------------------------------------------------------------------------
# SSE parsing on canned responses from a real local HTTP server


def sse_body(*payloads: dict | str) -> str:
    return "".join(f"data: {p if isinstance(p, str) else json.dumps(p)}\n\n" for p in payloads)


@contextlib.asynccontextmanager
async def local_server(route: str, answer: Any) -> AsyncIterator[str]:
    """A real HTTP server on this machine answering POSTs to `route` with `answer`; yields its /v1 base URL."""
    app = web.Application()
    app.router.add_post(route, answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    finally:
        await runner.cleanup()


def send(status: int, body: str, endpoint: str = "completions") -> RequestRecord:
    """One bench request against a real HTTP server on this machine that answers with `body`."""

    async def answer(request: web.Request) -> web.Response:
        return web.Response(status=status, body=body.encode(), content_type="text/event-stream")

    async def go() -> RequestRecord:
        async with local_server("/v1/{path:.*}", answer) as base_url:
            config = BenchConfig(base_url=base_url, endpoint=endpoint, timeout=10)
            async with client_session(max_connections=1) as session:
                return await send_request(session, config, "m", "hello", 3, 0.0)

    return asyncio.run(go())


def test_stream_with_usage_counts_tokens_from_usage():
    text = [{"choices": [{"index": 0, "text": piece}]} for piece in ("a", "", "bc", "d")]
    usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}}
    record = send(200, ": keep-alive\n\n" + sse_body(*text, usage, "[DONE]"))
    assert record.success, record.error
    assert record.output_tokens == 5
    assert record.prompt_tokens == 7
    assert record.generated_text == "abcd"
    assert record.ttft_s is not None and record.ttft_s > 0
    assert len(record.itl_s) == 2  # three non-empty chunks


def test_chat_stream_without_usage_counts_chunks():
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    chunks += [{"choices": [{"index": 0, "delta": {"content": piece}}]} for piece in ("x", "y")]
    chunks += [{"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}]
    record = send(200, sse_body(*chunks, "[DONE]"), endpoint="chat")
    assert record.success, record.error
    assert (record.output_tokens, record.prompt_tokens, record.usage_reported) == (2, None, False)


def test_requests_carry_the_temperature_and_each_its_own_max_tokens():
    """What the client puts on the wire, read by a real HTTP server on this machine that answers each request with
    as many tokens as it asked for."""
    bodies: list[dict] = []

    async def answer(request: web.Request) -> web.Response:
        body = await request.json()
        bodies.append(body)
        max_tokens = body["max_completion_tokens"]
        chunks = [{"choices": [{"index": 0, "delta": {"content": "x" * max_tokens}}]}]
        chunks.append({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": max_tokens}})
        return web.Response(body=sse_body(*chunks, "[DONE]").encode(), content_type="text/event-stream")

    async def go() -> dict:
        async with local_server("/v1/chat/completions", answer) as base_url:
            config = BenchConfig(
                base_url=base_url,
                model="m",
                endpoint="chat",
                num_prompts=12,
                output_len=8,
                random_range_ratio=0.5,
                temperature=0.8,
                seed=4,
                warmup=False,
                disable_tqdm=True,
                timeout=10,
            )
            return await run_benchmark(config)

    result = asyncio.run(go())
    expected = output_lengths(12, 8, 0.5, seed=4)
    assert len(set(expected)) > 1 and all(4 <= length <= 12 for length in expected)
    assert len(bodies) == 12
    assert all(body["temperature"] == 0.8 and body["ignore_eos"] is True for body in bodies)
    assert sorted(body["max_completion_tokens"] for body in bodies) == sorted(expected)
    assert result["output_lens"] == expected
    assert result["generated_texts"] == ["x" * length for length in expected]
    assert result["summary"]["total_output_tokens"] == sum(expected)


def test_failures_are_recorded_not_raised():
    record = send(400, '{"error": {"message": "bad"}}')
    assert not record.success and record.error.startswith("HTTP 400")
    record = send(200, sse_body({"choices": [{"text": "a"}]}, {"error": {"message": "dead"}}, "[DONE]"))
    assert not record.success and "dead" in record.error
    record = send(200, sse_body("[DONE]"))
    assert not record.success and "without any generated text" in record.error


# ---------------------------------------------------------------------------------------------------------------
# Real HTTP against a tiny model on Ray Serve


@pytest.fixture(scope="module")
def bench_url(deploy_module_app, tiny_model_dir):
    from configs.app_config import AppConfig

    config = AppConfig.model_validate(
        {
            "model": {"name": "tiny-random-llama"},
            "cache": {"num_kv_blocks": 256},
            "parallel": {"worker_num_cpus": 0.5, "num_threads": 1},
            "serve": {"app_name": "bench-tiny", "route_prefix": "/bench", "ingress_num_cpus": 0.1},
        }
    )
    return f"{deploy_module_app(config)}/v1"


@pytest.mark.serve
def test_closed_loop_run_against_the_server(bench_url, tmp_path, capsys):
    output = tmp_path / "result.json"
    config = BenchConfig(
        base_url=bench_url,
        num_prompts=8,
        input_len=24,
        output_len=8,
        max_concurrency=4,
        output_json=str(output),
        disable_tqdm=True,
    )
    result = asyncio.run(run_benchmark(config))
    summary = result["summary"]
    assert result["errors"] == [""] * 8
    assert summary["completed"] == 8
    assert summary["failed"] == 0
    assert result["output_lens"] == [8] * 8
    assert all(tokens > 0 for tokens in result["input_lens"])
    assert all(ttft > 0 for ttft in result["ttfts"])
    # A request's outputs that pile up while its stream is busy come merged into one chunk (the server's contract),
    # so a fast request may have fewer gaps than tokens; every gap recorded is a real one.
    assert any(result["itls"]) and all(itl > 0 for itls in result["itls"] for itl in itls)
    assert all(len(itls) <= 7 for itls in result["itls"])
    assert summary["mean_ttft_ms"] > 0
    assert summary["mean_itl_ms"] > 0
    assert summary["mean_tpot_ms"] > 0
    assert summary["output_throughput"] > 0
    assert summary["total_output_tokens"] == 64
    assert 1 <= summary["max_concurrent_requests"] <= 4
    saved = json.loads(output.read_text())
    assert set(saved["summary"]) >= SUMMARY_KEYS
    assert saved["model"] == "tiny-random-llama"
    assert saved["config"]["max_concurrency"] == 4
    assert saved["config"]["request_rate"] == "inf"
    assert {"ttfts", "itls", "e2els", "output_lens", "input_lens", "errors", "date"} <= set(saved)
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_the_client_runs_on_uvloop_where_installed():
    """The CLI's client shares the machine with the server it measures: it takes uvloop's cheaper event loop."""
    pytest.importorskip("uvloop")

    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run_client(loop_module()).startswith("uvloop")


@pytest.mark.serve
def test_poisson_run_through_the_cli_with_baselines(bench_url, tiny_model_dir, tmp_path, capsys):
    from cluster.cli import main

    output = tmp_path / "poisson.json"
    argv = ["bench", "--base-url", bench_url, "--num-prompts", "8", "--input-len", "16", "--output-len", "4"]
    argv += ["--request-rate", "20", "--seed", "3", "--output-json", str(output), "--disable-tqdm"]
    argv += ["--baselines", "--model-dir", str(tiny_model_dir), "--hf-batch-sizes", "2,4", "--roofline-iterations", "3"]
    argv += ["--dtype", "bfloat16"]
    assert main(argv) == 0
    saved = json.loads(output.read_text())
    assert saved["summary"]["completed"] == 8
    assert saved["summary"]["failed"] == 0
    assert saved["output_lens"] == [4] * 8
    assert saved["config"]["request_rate"] == 20.0
    # Arrivals are spread out (mean gap 50 ms), not all at time zero.
    assert max(saved["start_times"]) > 0.05
    # Baselines on the same 8 prompts and 4 output tokens.
    baselines = saved["baselines"]
    assert baselines["model_dir"] == str(tiny_model_dir)
    assert baselines["ours_output_tok_per_s"] == pytest.approx(saved["summary"]["output_throughput"])
    assert [run["batch_size"] for run in baselines["hf"]] == [2, 4]
    assert all(run["generated_tokens"] == 8 * 4 for run in baselines["hf"])
    # HF tokenized exactly the prompts the server did.
    assert all(run["prompt_tokens"] == saved["summary"]["total_input_tokens"] for run in baselines["hf"])
    assert baselines["hf_best_batch_size"] in (2, 4)
    assert baselines["hf_best_output_tok_per_s"] == max(run["output_tok_per_s"] for run in baselines["hf"])
    assert baselines["roofline_batch_size"] == saved["summary"]["max_concurrent_requests"]
    assert baselines["roofline"]["batch_size"] == baselines["roofline_batch_size"]
    assert baselines["roofline_batch1"]["batch_size"] == 1
    assert baselines["roofline_tok_per_s"] > 0 and baselines["roofline_batch1_tok_per_s"] > 0
    assert baselines["ratio_ours_vs_hf_best"] > 0
    assert baselines["ratio_ours_vs_roofline"] > 0
    # The ceiling covers the prompts the server saw, with every request's output tokens.
    assert baselines["ceiling"]["prompt_tokens"] == saved["summary"]["total_input_tokens"]
    assert baselines["ceiling"]["num_requests"] == 8 and baselines["ceiling"]["output_len"] == 4
    assert baselines["ratio_ours_vs_ceiling"] == pytest.approx(
        saved["summary"]["output_throughput"] / baselines["ceiling_tok_per_s"]
    )
    # --dtype reaches every baseline: HF's model, the rooflines' and the ceiling's weights (float32 on disk).
    assert (baselines["dtype"], baselines["hf_dtype"], baselines["roofline_dtype"]) == ("bfloat16",) * 3
    assert baselines["roofline_batch1"]["dtype"] == baselines["ceiling"]["dtype"] == "bfloat16"
    printed = capsys.readouterr().out
    assert "Baselines" in printed and "Ours / HF best:" in printed and "Ours / roofline" in printed
    assert "Workload ceiling" in printed and "TTFT p50 floor" in printed
    assert "bfloat16 / bfloat16" in printed


@pytest.mark.serve
def test_chat_endpoint_and_shared_prefix(bench_url):
    config = BenchConfig(
        base_url=bench_url,
        endpoint="chat",
        num_prompts=4,
        input_len=8,
        output_len=4,
        shared_prefix_words=40,
        disable_tqdm=True,
        warmup=False,
    )
    result = asyncio.run(run_benchmark(config))
    assert result["summary"]["completed"] == 4
    assert result["output_lens"] == [4] * 4


@pytest.mark.serve
def test_temperature_reaches_the_server(bench_url):
    """Greedy chat runs repeat their text; a sampled run on the same prompts writes other text (a random model's
    next-token distribution is nearly flat, so a sampled token is almost never the argmax)."""
    settings = {
        "base_url": bench_url,
        "endpoint": "chat",
        "num_prompts": 6,
        "input_len": 8,
        "output_len": 8,
        "seed": 9,
        "warmup": False,
        "disable_tqdm": True,
    }
    greedy = asyncio.run(run_benchmark(BenchConfig(**settings)))
    greedy_again = asyncio.run(run_benchmark(BenchConfig(**settings)))
    sampled = asyncio.run(run_benchmark(BenchConfig(**settings, temperature=1.0)))
    for result in (greedy, greedy_again, sampled):
        assert result["errors"] == [""] * 6
        assert result["output_lens"] == [8] * 6
    assert sampled["config"]["temperature"] == 1.0
    assert greedy["generated_texts"] == greedy_again["generated_texts"]
    differing = sum(text != other for text, other in zip(greedy["generated_texts"], sampled["generated_texts"]))
    assert differing >= 5


@pytest.mark.serve
def test_random_range_ratio_gives_each_request_its_own_length(bench_url):
    config = BenchConfig(
        base_url=bench_url,
        num_prompts=8,
        input_len=8,
        output_len=8,
        random_range_ratio=0.5,
        seed=5,
        warmup=False,
        disable_tqdm=True,
    )
    result = asyncio.run(run_benchmark(config))
    assert result["errors"] == [""] * 8
    lengths = result["output_lens"]
    assert all(4 <= length <= 12 for length in lengths)
    assert len(set(lengths)) > 1
    assert lengths == output_lengths(8, 8, 0.5, seed=5)
    assert result["summary"]["total_output_tokens"] == sum(lengths)


def test_offline_throughput_cli_logs_each_stream_count(caplog):
    from benchmarks import offline_throughput as module

    arguments = ["--model", "tiny-random-llama", "--device", "cpu", "--streams", "1,3", "--output-len", "4"]
    with caplog.at_level(logging.INFO, logger="offline_throughput"):
        assert module.main(arguments) == 0
    [report] = [record.getMessage() for record in caplog.records if record.name == "offline_throughput"]
    assert re.fullmatch(r"ours on cpu \(float32\): 1 streams [\d.]+ tok/s, 3 streams [\d.]+ tok/s", report), report
    with pytest.raises(SystemExit):
        module.main(["--compare-torch-elementwise", "--device", "cpu"])


def test_offline_throughput_roofline_puts_one_stream_against_weight_bytes_over_bandwidth(caplog):
    from benchmarks import offline_throughput as module

    arguments = ["--model", "tiny-random-llama", "--device", "cpu", "--streams", "1", "--output-len", "4"]
    with caplog.at_level(logging.INFO, logger="offline_throughput"):
        assert module.main([*arguments, "--roofline"]) == 0
    [line] = [record.getMessage() for record in caplog.records if "roofline" in record.getMessage()]
    match = re.fullmatch(
        r"weight-bandwidth roofline: ([\d.]+) MB of weights per step at ([\d.]+) GB/s \(read before [\d.]+, after: "
        r"mean\) = ([\d.]+) tok/s; one stream ([\d.]+)x of it",
        line,
    )
    assert match, line
    megabytes, bandwidth, roofline = (float(match.group(i)) for i in (1, 2, 3))
    assert megabytes > 0 and bandwidth > 0
    assert roofline == pytest.approx(bandwidth * 1e3 / megabytes, rel=0.01)


def test_decode_weight_bytes_counts_a_tied_head_once_and_skips_an_untied_embedding():
    from torch import nn

    from benchmarks.offline_throughput import decode_weight_bytes

    class Model(nn.Module):
        def __init__(self, tied: bool):
            super().__init__()
            self.embed_tokens = nn.Embedding(100, 8)
            self.layer = nn.Linear(8, 8, bias=False)
            self.lm_head = nn.Linear(8, 100, bias=False)
            if tied:
                self.lm_head.weight = self.embed_tokens.weight

    # fp32: 4 bytes a weight; a step reads the layer and the head (the tied head is the embedding, counted once).
    assert decode_weight_bytes(Model(tied=True)) == (100 * 8 + 8 * 8) * 4
    assert decode_weight_bytes(Model(tied=False)) == (8 * 8 + 100 * 8) * 4
