"""`ray job submit` against a real Ray head started with `ray start --head`: deploy and batch entry points."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.helpers import free_port, free_ports

pytestmark = [pytest.mark.serve, pytest.mark.subprocess]

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]
JOB_TIMEOUT_S = 600
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def write_tiny_config(directory: Path, serve_port: int) -> Path:
    config = directory / "tiny-job.yaml"
    config.write_text(
        "model:\n  name: tiny-random-llama\n  device: cpu\n"
        "cache:\n  num_kv_blocks: 128\n"
        "parallel:\n  worker_num_cpus: 0.5\n  num_threads: 1\n"
        f"serve:\n  app_name: jobapp\n  port: {serve_port}\n  ingress_num_cpus: 0.1\n"
    )
    return config


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A separate head on free ports in its own temp dir; only its own processes are stopped at the end."""
    temp_dir = Path("/tmp") / f"ps-head-{os.getpid()}"
    gcs_port, dashboard_port, *agent_ports = free_ports(7)
    # The job's `python` is whatever the head's PATH finds: this venv, as on a cluster built from one image.
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.pop("RAY_ADDRESS", None)
    subprocess.run(
        [
            str(BIN / "ray"),
            "start",
            "--head",
            f"--port={gcs_port}",
            f"--dashboard-port={dashboard_port}",
            "--dashboard-host=127.0.0.1",
            "--include-dashboard=true",
            "--num-cpus=8",
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
            # Free ports for every agent, or a second cluster on this machine (the test session's) collides.
            f"--dashboard-agent-listen-port={agent_ports[0]}",
            f"--dashboard-agent-grpc-port={agent_ports[1]}",
            f"--metrics-export-port={agent_ports[2]}",
            f"--runtime-env-agent-port={agent_ports[3]}",
            f"--ray-client-server-port={agent_ports[4]}",
        ],
        check=True,
        env=env,
        capture_output=True,
        timeout=120,
    )
    address = f"http://127.0.0.1:{dashboard_port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{address}/api/version", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(1)
    yield {"address": address, "env": env, "work_dir": tmp_path_factory.mktemp("job")}
    for process in psutil.process_iter(["cmdline"]):
        if str(temp_dir) in " ".join(process.info["cmdline"] or []):
            process.kill()


def submit(head: dict, *job_args: str) -> subprocess.CompletedProcess:
    """`ray job submit` exactly as the README shows, waiting for the job to end."""
    command = [str(BIN / "ray"), "job", "submit", "--address", head["address"], "--working-dir", str(REPO)]
    deadline = time.monotonic() + 90
    while True:
        completed = subprocess.run(
            [*command, "--", *job_args], env=head["env"], capture_output=True, text=True, timeout=JOB_TIMEOUT_S
        )
        # A fresh head's job agent takes a few seconds to come up after the dashboard answers.
        if "No available agent" not in completed.stderr or time.monotonic() > deadline:
            return completed
        time.sleep(2)


def test_deploy_then_batch_through_ray_job_submit(head):
    serve_port = free_port()
    config = write_tiny_config(head["work_dir"], serve_port)
    deployed = submit(head, "python", "-m", "cluster.job", "deploy", "--config", str(config))
    assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]
    assert "succeeded" in deployed.stdout
    models = httpx.get(f"http://127.0.0.1:{serve_port}/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == "tiny-random-llama"

    prompts = head["work_dir"] / "prompts.jsonl"
    bodies = {
        "a": {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0},
        "b": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        "bad": {"prompt": [5], "max_tokens": 4, "temperature": -1},
        "c": {"prompt": "hello there", "max_tokens": 2, "ignore_eos": True},
    }
    lines = [
        {"custom_id": custom_id, "method": "POST", "url": CHAT if "messages" in body else COMPLETIONS, "body": body}
        for custom_id, body in bodies.items()
    ]
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    results_path = head["work_dir"] / "results.jsonl"
    batch_args = ["python", "-m", "cluster.job", "batch", "--config", str(config)]
    batch_args += ["--input", str(prompts), "--output", str(results_path)]
    batch = submit(head, *batch_args)
    assert batch.returncode == 0, batch.stdout[-3000:] + batch.stderr[-3000:]
    results = read_results(results_path)
    assert sorted(results) == ["a", "b", "bad", "c"]
    assert results["a"]["response"]["body"]["usage"]["completion_tokens"] == 4
    assert results["b"]["response"]["body"]["object"] == "chat.completion"
    refused = results["bad"]["response"]
    assert refused["status_code"] == 400 and "temperature" in refused["body"]["error"]["message"]
    assert results["c"]["response"]["body"]["usage"]["completion_tokens"] == 2

    # A rerun keeps the finished requests and runs only the failed one again.
    rerun = submit(head, *batch_args)
    assert rerun.returncode == 0
    assert "3 done in earlier runs, 1 to run" in rerun.stdout + rerun.stderr
    rerun_results = read_results(results_path)
    assert all(rerun_results[custom_id] == results[custom_id] for custom_id in ("a", "b", "c"))
    assert rerun_results["bad"]["id"] != results["bad"]["id"]


def read_results(path: Path) -> dict[str, dict]:
    """Output records by custom_id, each custom_id on one line."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    by_custom_id = {record["custom_id"]: record for record in records}
    assert len(by_custom_id) == len(records)
    return by_custom_id
