"""`python -m cluster.job batch` over OpenAI Batch API files, as a subprocess attached to this session's Ray (the
way `ray job submit` runs it: RAY_ADDRESS set) and driving an app deployed here: the round trip, the error lines,
resuming by custom_id after a kill or from a partial output, refusing duplicate custom_ids, and memory that does
not grow with the input file."""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from openai.types import Completion
from openai.types.chat import ChatCompletion

from configs.app_config import AppConfig
from tests.helpers import assert_engine_drained

pytestmark = [pytest.mark.serve, pytest.mark.subprocess]

REPO = Path(__file__).resolve().parents[1]
APP = "batchjob"
APP_SETTINGS = {
    "model": {"name": "tiny-random-llama"},
    "cache": {"num_kv_blocks": 128},
    "parallel": {"worker_num_cpus": 0.5, "num_threads": 1},
    "serve": {"app_name": APP, "route_prefix": f"/{APP}", "ingress_num_cpus": 0.1},
}
CONFIG = AppConfig.model_validate(APP_SETTINGS)
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
JOB_TIMEOUT_S = 600


def batch_request(custom_id: str, url: str = COMPLETIONS, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def write_jsonl(path: Path, lines: list[dict[str, Any] | str]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def read_output(path: Path) -> list[dict[str, Any]]:
    """The output's complete lines (a line a kill cut short has no newline yet)."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.split("\n")[:-1]]


@pytest.fixture(scope="module")
def job(deploy_module_app, tmp_path_factory) -> dict[str, Any]:
    """The app this module's jobs use, and how to start a job process attached to this session's Ray."""
    import ray

    deploy_module_app(CONFIG)
    directory = tmp_path_factory.mktemp("batch-job")
    config = directory / "app.yaml"
    config.write_text(yaml.safe_dump(APP_SETTINGS))
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    return {"config": config, "env": env, "dir": directory}


def batch_command(job: dict[str, Any], input_path: Path, output: Path, *extra: str) -> list[str]:
    command = [sys.executable, "-m", "cluster.job", "batch", "--config", str(job["config"])]
    return [*command, "--input", str(input_path), "--output", str(output), *extra]


def run_batch_process(
    job: dict[str, Any], input_path: Path, output: Path, *extra: str, timeout_s: float = JOB_TIMEOUT_S
) -> subprocess.CompletedProcess:
    command = batch_command(job, input_path, output, *extra)
    return subprocess.run(command, cwd=REPO, env=job["env"], capture_output=True, text=True, timeout=timeout_s)


def run_batch(job: dict[str, Any], input_path: Path, output: Path, *extra: str) -> subprocess.CompletedProcess:
    completed = run_batch_process(job, input_path, output, *extra)
    assert completed.returncode == 0, completed.stderr[-5000:]
    return completed


# --- the round trip and the error lines: one job over a file of good and bad lines --------------------------------

MIXED_LINES: list[dict[str, Any] | str] = [
    batch_request("chat", CHAT, messages=[{"role": "user", "content": "hi"}], max_tokens=3, ignore_eos=True),
    batch_request("text", prompt="hello there", max_tokens=4, ignore_eos=True, temperature=0),
    batch_request("tokens", prompt=[5, 6, 7], max_tokens=2, ignore_eos=True),
    batch_request("refused", prompt=[5], max_tokens=2, temperature=-1),
    batch_request("streamed", prompt=[5], max_tokens=2, stream=True),
    "this line is not JSON",
    "",
    batch_request("embedding", "/v1/embeddings", input="hi"),
    {"custom_id": "get", "method": "GET", "url": COMPLETIONS, "body": {"prompt": "hi"}},
    {"method": "POST", "url": COMPLETIONS, "body": {"prompt": "hi", "max_tokens": 2}},
    {"custom_id": "no-body", "method": "POST", "url": CHAT, "body": "hi"},
]
SUCCEEDED = {"chat": 3, "text": 4, "tokens": 2}  # custom_id -> completion tokens


@pytest.fixture(scope="module")
def mixed_run(job) -> dict[str, Any]:
    input_path = write_jsonl(job["dir"] / "mixed.jsonl", MIXED_LINES)
    output = job["dir"] / "mixed-results.jsonl"
    completed = run_batch(job, input_path, output)
    return {"records": read_output(output), "stderr": completed.stderr}


def by_custom_id(records: list[dict[str, Any]]) -> dict[str | None, list[dict[str, Any]]]:
    grouped = collections.defaultdict(list)
    for record in records:
        grouped[record["custom_id"]].append(record)
    return grouped


def test_batch_round_trip_answers_each_request_in_openai_batch_output_shape(mixed_run):
    records = mixed_run["records"]
    assert len(records) == 10  # every non-blank input line, once
    grouped = by_custom_id(records)
    for custom_id, completion_tokens in SUCCEEDED.items():
        (record,) = grouped[custom_id]
        assert set(record) == {"id", "custom_id", "response", "error"}
        assert record["id"].startswith("batch_req_") and record["error"] is None
        response = record["response"]
        assert response["status_code"] == 200 and response["request_id"]
        body_type = ChatCompletion if custom_id == "chat" else Completion
        body = body_type.model_validate(response["body"])
        assert body.usage.completion_tokens == completion_tokens
    assert len({record["id"] for record in records}) == len(records)


def test_batch_refused_requests_keep_their_status_and_openai_error_body(mixed_run):
    grouped = by_custom_id(mixed_run["records"])
    for custom_id, param in (("refused", "temperature"), ("streamed", "stream")):
        (record,) = grouped[custom_id]
        assert record["error"] is None
        assert record["response"]["status_code"] == 400
        error = record["response"]["body"]["error"]
        assert error["code"] == 400 and param in error["message"]


def test_batch_lines_that_are_no_request_get_an_error_naming_the_line(mixed_run):
    grouped = by_custom_id(mixed_run["records"])
    # (custom_id, error code, 1-based input line)
    expected = [
        (None, "invalid_json", 6),
        ("embedding", "invalid_url", 8),
        ("get", "invalid_method", 9),
        (None, "missing_custom_id", 10),
        ("no-body", "invalid_body", 11),
    ]
    failed = [record for record in mixed_run["records"] if record["error"] is not None]
    failed.sort(key=lambda record: record["error"]["line"])
    assert [(record["custom_id"], record["error"]["code"], record["error"]["line"]) for record in failed] == expected
    for record in failed:
        assert record["response"] is None and re.search(
            rf"\bline {record['error']['line']}\b", record["error"]["message"]
        )
    assert "/v1/embeddings" in grouped["embedding"][0]["error"]["message"]


def test_batch_progress_counts_requests_and_generated_tokens_per_second(mixed_run):
    progress = [line for line in mixed_run["stderr"].splitlines() if line.startswith("batch: ")]
    assert progress, mixed_run["stderr"][-3000:]
    assert progress[-1].startswith("batch: 10/10 requests") and "tok/s" in progress[-1], progress[-1]
    tokens_per_s = float(progress[-1].rsplit(",", 1)[-1].split("tok/s")[0])
    assert tokens_per_s > 0


# --- resuming by custom_id ----------------------------------------------------------------------------------------


def test_batch_rerun_after_a_kill_writes_each_custom_id_exactly_once(job):
    count = 48
    lines = [batch_request(f"r{i}", prompt=[5, 6, i + 7], max_tokens=48, ignore_eos=True) for i in range(count)]
    input_path = write_jsonl(job["dir"] / "resume.jsonl", lines)
    output = job["dir"] / "resume-results.jsonl"
    command = batch_command(job, input_path, output, "--max-concurrency", "2")
    process = subprocess.Popen(command, cwd=REPO, env=job["env"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while len(read_output(output)) < 4:
            assert process.poll() is None, process.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no results written"
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        process.kill()
        process.stderr.close()
    before = read_output(output)
    assert 4 <= len(before) < count, "the job finished before it was killed: nothing left to resume"

    rerun = run_batch(job, input_path, output, "--max-concurrency", "8")
    assert f"{len(before)} done in earlier runs, {count - len(before)} to run" in rerun.stderr
    records = read_output(output)
    assert collections.Counter(record["custom_id"] for record in records) == {f"r{index}": 1 for index in range(count)}
    assert all(record["response"]["status_code"] == 200 for record in records)
    # The results from before the kill are kept as they were, not run again.
    assert records[: len(before)] == before
    assert_engine_drained(APP)


def test_batch_rerun_keeps_successes_and_runs_failed_and_cut_lines_again(job):
    earlier_success = {
        "id": "batch_req_earlier",
        "custom_id": "kept",
        "response": {"status_code": 200, "request_id": "req_earlier", "body": {"marker": "from the earlier run"}},
        "error": None,
    }
    earlier_failure = {
        "id": "batch_req_failed",
        "custom_id": "retried",
        "response": {"status_code": 503, "request_id": "req_failed", "body": {"error": {"message": "overloaded"}}},
        "error": None,
    }
    output = job["dir"] / "partial-results.jsonl"
    cut = json.dumps(batch_request("cut"))[:30]  # a kill in the middle of writing the last line
    output.write_text(json.dumps(earlier_success) + "\n" + json.dumps(earlier_failure) + "\n" + cut)
    lines = [batch_request(custom_id, prompt=[5, 6], max_tokens=2) for custom_id in ("kept", "retried", "cut", "new")]
    input_path = write_jsonl(job["dir"] / "partial.jsonl", lines)

    run_batch(job, input_path, output)
    records = read_output(output)
    assert output.read_text().endswith("\n")
    grouped = by_custom_id(records)
    assert sorted(grouped) == ["cut", "kept", "new", "retried"] and len(records) == 4
    assert grouped["kept"] == [earlier_success]
    for custom_id in ("retried", "cut", "new"):
        (record,) = grouped[custom_id]
        assert record["response"]["status_code"] == 200
        Completion.model_validate(record["response"]["body"])


# --- input the job refuses before it runs anything ----------------------------------------------------------------


def run_refused(job: dict[str, Any], input_path: Path, output: Path, *extra: str) -> str:
    completed = run_batch_process(job, input_path, output, *extra, timeout_s=120)
    assert completed.returncode == 2, completed.stderr[-3000:]
    errors = [line for line in completed.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, completed.stderr[-3000:]
    return errors[0]


def test_batch_refuses_a_duplicate_custom_id_naming_it_and_its_lines(job):
    lines = [batch_request(custom_id, prompt=[5], max_tokens=1) for custom_id in ("a", "twice", "b", "twice")]
    input_path = write_jsonl(job["dir"] / "duplicates.jsonl", lines)
    output = job["dir"] / "duplicates-results.jsonl"
    error = run_refused(job, input_path, output)
    assert error.startswith("error: duplicate custom_id 'twice' on lines 2 and 4"), error
    assert not output.exists()  # refused before any request ran


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing-input", "no such file"),
        ("missing-output-dir", "does not exist"),
        ("empty-input", "has no requests"),
        ("zero-concurrency", "--max-concurrency must be at least 1"),
    ],
)
def test_batch_cli_errors_are_one_line(job, case, message):
    input_path = write_jsonl(job["dir"] / "one.jsonl", [batch_request("one", prompt=[5], max_tokens=1)])
    output, extra = job["dir"] / f"{case}.jsonl", []
    if case == "missing-input":
        input_path = job["dir"] / "absent.jsonl"
    elif case == "missing-output-dir":
        output = job["dir"] / "absent" / "results.jsonl"
    elif case == "empty-input":
        input_path = write_jsonl(job["dir"] / "empty.jsonl", ["", "  "])
    else:
        extra = ["--max-concurrency", "0"]
    assert message in run_refused(job, input_path, output, *extra)


# --- streaming: memory does not follow the input's size -------------------------------------------------------------


def peak_private_rss_mib(command: list[str], env: dict[str, str]) -> float:
    """The highest private resident memory (RssAnon) of the process, sampled until it exits.

    Not VmHWM: that counts the pages of Ray's shared object store the handle writes a large argument into, which
    the store holds (up to its own limit) and frees, not the job."""
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak_kib = 0
    deadline = time.monotonic() + JOB_TIMEOUT_S
    try:
        while process.poll() is None and time.monotonic() < deadline:
            try:
                status = Path(f"/proc/{process.pid}/status").read_text()
                private_kib = int(next(line for line in status.splitlines() if line.startswith("RssAnon:")).split()[1])
                peak_kib = max(peak_kib, private_kib)
            except (OSError, StopIteration):
                pass
            time.sleep(0.02)
        _, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 0, stderr.decode()[-3000:]
    return peak_kib / 1024


def test_batch_streams_its_input_memory_stays_flat_as_the_file_grows(job):
    padding = "x" * (4 * 2**20)  # a 4 MiB field in each request body

    def padded_file(name: str, count: int) -> Path:
        path = job["dir"] / name
        with path.open("w") as file:
            for index in range(count):
                line = batch_request(f"{name}-{index}", prompt=[5, 6], max_tokens=1, user=padding)
                file.write(json.dumps(line) + "\n")
        return path

    counts = {"small": 4, "large": 64}
    peaks = {}
    for name, count in counts.items():
        path, output = padded_file(name, count), job["dir"] / f"{name}-results.jsonl"
        peaks[name] = peak_private_rss_mib(batch_command(job, path, output, "--max-concurrency", "2"), job["env"])
        assert len(read_output(output)) == count
    # The large file is 240 MiB more input: a job that held it would grow by at least that much.
    assert peaks["large"] - peaks["small"] < 48, peaks
