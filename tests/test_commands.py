"""Every Make target and `pagedserve` subcommand the README names, run through the real command line.

Which test covers which command:
- `make soak` and `pagedserve soak` (on a Ray of its own, as from a fresh clone): test_make_soak_...
- `make serve` and `pagedserve serve` (Ctrl-C included): test_make_serve_...; SIGTERM, direct ingress and the
  drain of `pagedserve serve` itself: tests/test_faults_serve_process.py
- `make bench-offline` and `pagedserve bench-offline` (HF baseline on): test_make_bench_offline_...;
  `--skip-hf`: test_pagedserve_bench_offline_skip_hf_...
- `pagedserve bench` against a served app: test_pagedserve_bench_...
- `pagedserve fetch-model` (the default alias, the tiny one, an unknown one): test_pagedserve_fetch_model_...
- `make setup`, `make serve` from a fresh clone, `make test`, `make test-fast`, `make lint`: dry runs (`make -n`),
  since running them would reinstall the venv or recurse into this suite; test-fast's selection is collected.
- `python -m cluster.job` through `ray job submit`: tests/test_cluster_job.py; against a token-auth head:
  tests/test_job_submit_auth.py

Make runs with `-o .venv/.installed`: these tests run inside the venv that `make test` just set up, and must not
reinstall it; every other step of each target's recipe runs for real.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from configs.app_config import AppConfig
from tests.fault_helpers import wait_until
from tests.process_helpers import free_port_for_direct_ingress, ray_processes_of

BIN = Path(sys.executable).parent
PAGEDSERVE = str(BIN / "pagedserve")
REPO = Path(__file__).resolve().parents[1]
MAKE = ["make", "--no-print-directory", "-o", ".venv/.installed"]


def write_tiny_config(directory: Path, app_name: str, port: int) -> Path:
    """The tiny random Llama on `port` (JSON is YAML)."""
    path = directory / f"{app_name}.yaml"
    config = {
        "model": {"name": "tiny-random-llama"},
        "cache": {"num_kv_blocks": 128},
        "scheduler": {"max_num_seqs": 8, "max_waiting_requests": 16},
        "parallel": {"worker_num_cpus": 0.5, "num_threads": 1},
        "serve": {"app_name": app_name, "port": port, "ingress_num_cpus": 0.1},
    }
    path.write_text(json.dumps(config))
    return path


def own_ray_env() -> tuple[dict[str, str], str]:
    """The environment of a command that starts a Ray of its own (never this session's), and that Ray's temp dir,
    by which its processes are found afterwards."""
    ray_tmpdir = tempfile.mkdtemp(prefix="ps-cmd-", dir="/tmp")
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=ray_tmpdir, RAY_USAGE_STATS_ENABLED="0")
    return env, ray_tmpdir


def kill_leftovers(ray_tmpdir: str) -> None:
    for pid in ray_processes_of(ray_tmpdir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def run_command(
    command: list[str], timeout_s: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a command in a process group of its own, killed as a whole if it outlives `timeout_s`."""
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{shlex.join(command)} ran past {timeout_s} s:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def tail(completed: subprocess.CompletedProcess[str]) -> str:
    return f"exit {completed.returncode}\nstdout:\n{completed.stdout[-3000:]}\nstderr:\n{completed.stderr[-5000:]}"


@pytest.mark.serve
@pytest.mark.subprocess
def test_make_soak_runs_pagedserve_soak_to_a_pass_and_leaves_no_process(tmp_path):
    """`make soak` as from a fresh clone: `pagedserve soak` starts its own Ray (Serve's throughput-optimized mode,
    direct ingress), deploys, loads past capacity, reads the ingress replica's state from this sync process, prints
    a passing report, and stops every process it started."""
    config = write_tiny_config(tmp_path, "cli-soak", free_port_for_direct_ingress())
    report_path = tmp_path / "soak.json"
    env, ray_tmpdir = own_ray_env()
    args = f"--duration-s 15 --input-len 8 --output-len 16 --disconnect-fraction 0.25 --output-json {report_path}"
    try:
        completed = run_command([*MAKE, "soak", f"CONFIG={config}", f"ARGS={args}"], 480, env)
        assert completed.returncode == 0, tail(completed)
        wait_until(lambda: not ray_processes_of(ray_tmpdir), 60, "every process of its Ray gone")
    finally:
        kill_leftovers(ray_tmpdir)
    # Make echoes the command it runs: the Makefile's own flags, then ARGS, whose --duration-s wins.
    assert f".venv/bin/pagedserve soak --config {config} --duration-s 180 {args}" in completed.stdout
    assert "pagedserve soak" in completed.stdout and "PASS" in completed.stdout, tail(completed)
    report = json.loads(report_path.read_text())
    assert report["passed"] and report["failures"] == []
    assert report["duration_s"] == 15 and report["completed"] > 0 and report["disconnected"] > 0
    assert report["free_kv_blocks_before"] == report["free_kv_blocks_after"] == report["kv_blocks"] == 128
    assert report["request_state_left"] == 0
    assert "Traceback" not in completed.stderr, tail(completed)  # its shutdown included: no error on the way out
    shutil.rmtree(ray_tmpdir, ignore_errors=True)


@pytest.mark.serve
@pytest.mark.subprocess
def test_make_serve_answers_the_openai_sdk_and_ctrl_c_stops_every_process(tmp_path):
    """`make serve CONFIG=...`: the OpenAI API answers the `openai` SDK on the config's port; Ctrl-C (SIGINT to the
    terminal's process group, make included) shuts the server down gracefully and leaves no process."""
    from openai import OpenAI

    port = free_port_for_direct_ingress()
    config = write_tiny_config(tmp_path, "cli-serve", port)
    env, ray_tmpdir = own_ray_env()
    log_path = tmp_path / "make-serve.log"
    with open(log_path, "w") as log:
        make = subprocess.Popen(
            [*MAKE, "serve", f"CONFIG={config}"],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        # The README's promise: it logs the URL once the app answers; Ctrl-C from then on drains, not aborts.
        ready = f"pagedserve is ready: {base}/v1"
        wait_until(lambda: ready in log_path.read_text(), 240, "make serve ready")
        # Answers at once, but a second pytest worker's load may slow the first replies.
        assert httpx.get(f"{base}/health", timeout=30).status_code == 200
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        assert [model.id for model in client.models.list()] == ["tiny-random-llama"]
        completion = client.completions.create(
            model="tiny-random-llama", prompt="The sea", max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert completion.usage.completion_tokens == 4 and completion.choices[0].finish_reason == "length"
        os.killpg(make.pid, signal.SIGINT)
        make.wait(timeout=120)
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
    try:
        wait_until(lambda: not ray_processes_of(ray_tmpdir), 60, "every process of its Ray gone")
    finally:
        kill_leftovers(ray_tmpdir)
    log = log_path.read_text()
    assert f".venv/bin/pagedserve serve --config {config}" in log
    assert "SIGINT: shutting down" in log and "pagedserve stopped" in log, log[-3000:]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base}/health", timeout=5)
    shutil.rmtree(ray_tmpdir, ignore_errors=True)


@pytest.mark.subprocess
def test_make_bench_offline_compares_with_hf_generate(tmp_path):
    """`make bench-offline ARGS=...` (tiny model, four prompts): our LLM.generate and HF generate on the same
    prompts, printed and written as JSON."""
    report_path = tmp_path / "offline.json"
    args = "--model tiny-random-llama --num-prompts 4 --prompt-words 8 --max-tokens 8 --hf-batch-sizes 2"
    completed = run_command([*MAKE, "bench-offline", f"ARGS={args} --output-json {report_path}"], 300)
    assert completed.returncode == 0, tail(completed)
    assert "pagedserve LLM.generate:" in completed.stdout
    assert "HF generate batch   2:" in completed.stdout and "ratio vs HF best static batch:" in completed.stdout
    report = json.loads(report_path.read_text())
    assert report["num_prompts"] == 4 and report["pagedserve"]["output_tokens"] == 4 * 8  # ignore_eos
    assert [run["batch_size"] for run in report["hf"]] == [2] and report["ratio_vs_hf_best"] > 0


@pytest.mark.subprocess
def test_pagedserve_bench_offline_skip_hf_measures_only_pagedserve(tmp_path):
    report_path = tmp_path / "offline.json"
    command = [PAGEDSERVE, "bench-offline", "--model", "tiny-random-llama", "--num-prompts", "3"]
    command += ["--prompt-words", "6", "--max-tokens", "5", "--skip-hf", "--output-json", str(report_path)]
    completed = run_command(command, 300)
    assert completed.returncode == 0, tail(completed)
    assert "pagedserve LLM.generate:" in completed.stdout and "HF generate" not in completed.stdout
    report = json.loads(report_path.read_text())
    assert report["pagedserve"]["output_tokens"] == 3 * 5 and "hf" not in report


@pytest.mark.serve
@pytest.mark.subprocess
def test_pagedserve_bench_against_a_served_tiny_app(deploy_module_app, tmp_path):
    """`pagedserve bench` as a separate process against an app on this session's Serve: Poisson arrivals, the
    vLLM-style report on stdout, the result file, exit 0 when every request succeeded."""
    config = AppConfig.model_validate(
        {
            "model": {"name": "tiny-random-llama"},
            "cache": {"num_kv_blocks": 128},
            "parallel": {"worker_num_cpus": 0.5, "num_threads": 1},
            "serve": {"app_name": "cli-bench", "route_prefix": "/cli-bench", "ingress_num_cpus": 0.1},
        }
    )
    base_url = f"{deploy_module_app(config)}/v1"
    result_path = tmp_path / "bench.json"
    command = [PAGEDSERVE, "bench", "--base-url", base_url, "--num-prompts", "6", "--input-len", "8"]
    command += ["--output-len", "6", "--request-rate", "20", "--seed", "5", "--disable-tqdm"]
    completed = run_command([*command, "--output-json", str(result_path)], 300)
    assert completed.returncode == 0, tail(completed)
    assert "Serving Benchmark Result" in completed.stdout
    assert "Successful requests:" in completed.stdout and "Mean TTFT (ms):" in completed.stdout
    result = json.loads(result_path.read_text())
    assert result["model"] == "tiny-random-llama" and result["config"]["request_rate"] == 20
    assert result["summary"]["completed"] == 6 and result["summary"]["failed"] == 0
    assert result["output_lens"] == [6] * 6 and result["errors"] == [""] * 6


@pytest.mark.subprocess
def test_pagedserve_fetch_model_prints_the_model_directory_last(smollm2_dir, tiny_model_dir):
    """Already fetched (by `make setup`, or the fixtures): the command returns at once and its last stdout line
    is the directory, for `$(pagedserve fetch-model | tail -n 1)`; an unknown alias fails naming the known ones."""
    for argv, expected in (([], smollm2_dir), (["tiny-random-llama"], tiny_model_dir)):
        completed = run_command([PAGEDSERVE, "fetch-model", *argv], 120)
        assert completed.returncode == 0, tail(completed)
        directory = Path(completed.stdout.splitlines()[-1])
        assert directory == expected and (directory / "config.json").is_file()
        assert any(directory.glob("*.safetensors"))
    unknown = run_command([PAGEDSERVE, "fetch-model", "no-such-model"], 120)
    assert unknown.returncode != 0 and unknown.stdout == ""
    assert "no-such-model" in unknown.stderr and "smollm2-135m-instruct" in unknown.stderr


def make_dry_run(*args: str) -> list[str]:
    completed = run_command(["make", "--no-print-directory", "-n", *args], 60)
    assert completed.returncode == 0, tail(completed)
    return completed.stdout.splitlines()


def position(lines: list[str], fragment: str) -> int:
    return next(index for index, line in enumerate(lines) if fragment in line)


# The files whose tests assert wall-clock bounds: `make test` runs them in a pass of their own.
ALONE_FILES = {
    f"tests/{name}.py"
    for name in (
        "test_engine_autoscaling",
        "test_faults_live_app",
        "test_faults_orphaned_engine",
        "test_faults_serve_process",
        "test_hostile_input",
        "test_overload",
        "test_startup_interrupt",
        "test_stream_errors",
    )
}


def collected_ids(pytest_command: list[str]) -> list[str]:
    """The test ids a pytest command line selects, collected without running them."""
    collect = run_command([*pytest_command, "--collect-only", "-p", "no:cacheprovider"], 300)
    assert collect.returncode == 0, tail(collect)
    return [line for line in collect.stdout.splitlines() if "::" in line]


def files_of(test_ids: list[str]) -> set[str]:
    return {test_id.split("::")[0] for test_id in test_ids}


@pytest.mark.subprocess
def test_make_from_a_fresh_clone_creates_the_venv_installs_torch_first_then_fetches_and_serves():
    """`make serve` on a fresh clone (`-B`: as if nothing were built): venv, pinned torch before the project (an
    unpinned torch pulled in by a dependency is a multi-GB CUDA build), the model, the kernels, then the server;
    `make soak` and `make bench-offline` run the same set-up first."""
    lines = make_dry_run("-B", "serve")
    order = [
        "-m venv .venv",
        "pip install --quiet torch==",
        'pip install --quiet -e ".[test]"',
        "touch .venv/.installed",
        ".venv/bin/pagedserve fetch-model smollm2-135m-instruct",
        ".venv/bin/python -m cuda_ext.cpu_ops",
        ".venv/bin/pagedserve serve --config configs/default.yaml",
    ]
    assert [position(lines, step) for step in order] == sorted(position(lines, step) for step in order), lines
    assert lines[-1].strip() == ".venv/bin/pagedserve serve --config configs/default.yaml"
    soak = make_dry_run("-o", ".venv/.installed", "soak")
    assert soak[-1].strip() == ".venv/bin/pagedserve soak --config configs/default.yaml --duration-s 180"
    assert "fetch-model" in soak[0] and "cuda_ext.cpu_ops" in soak[1]
    assert make_dry_run("-o", ".venv/.installed", "bench-offline")[-1].strip() == ".venv/bin/pagedserve bench-offline"


@pytest.mark.subprocess
def test_make_test_and_test_fast_set_up_and_lint_before_pytest_and_test_fast_skips_the_slow_marks():
    """`make test` and `make test-fast` (dry runs: running them here would recurse into this suite): set-up, then
    `make lint`'s ruff check and format check, then pytest; test's two passes split the suite by the `alone` mark;
    test-fast's selection, collected, holds the plain tests and none marked serve, subprocess or slow."""
    lint = make_dry_run("-o", ".venv/.installed", "lint")
    assert [line.strip() for line in lint] == [".venv/bin/ruff check .", ".venv/bin/ruff format --check ."]
    for target in ("test", "test-fast"):
        lines = make_dry_run("-o", ".venv/.installed", target)
        steps = ["fetch-model", "cuda_ext.cpu_ops", "ruff check .", "ruff format --check .", "-m pytest -q"]
        assert [position(lines, step) for step in steps] == list(range(len(steps))), lines
        if target == "test":
            # Two xdist workers, each file on one, for all but the `alone` tests; those after, in one process; the
            # target fails if either pass did.
            spread_pass = '.venv/bin/python -m pytest -q -n {} --dist loadfile -m "not alone"; spread=$?; \\'
            alone_pass = ".venv/bin/python -m pytest -q -m alone; alone=$?; \\"
            verdict = "[ $spread -eq 0 ] && [ $alone -eq 0 ]"
            assert [line.strip() for line in lines[-3:]] == [spread_pass.format(2), alone_pass, verdict]
            one_process = make_dry_run("-o", ".venv/.installed", "test", "PYTEST_WORKERS=0")
            assert one_process[-3].strip() == spread_pass.format(0)
            pytest_command = [sys.executable, "-m", "pytest", "-q"]
            alone_files = files_of(collected_ids([*pytest_command, "-m", "alone"]))
            assert alone_files == ALONE_FILES
            spread_files = files_of(collected_ids([*pytest_command, "-m", "not alone"]))
            assert {"tests/test_serving.py", "tests/test_configs.py"} <= spread_files
            assert not spread_files & alone_files
    assert lines[-1].strip() == '.venv/bin/python -m pytest -q -m "not serve and not subprocess and not slow"'

    fast_ids = collected_ids(shlex.split(lines[-1]))
    selected = files_of(fast_ids)
    assert {"tests/test_configs.py", "tests/test_kv_cache.py"} <= selected
    # Whole modules marked serve or subprocess, and this very test (subprocess), are left out.
    left_out = {"tests/test_faults_live_app.py", "tests/test_cluster_job.py", "tests/test_startup_interrupt.py"}
    assert not selected & left_out
    assert not any("test_make_test_and_test_fast" in test_id for test_id in fast_ids)
