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
    lines = [
        {"custom_id": "a", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0},
        {"custom_id": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        {"custom_id": "bad", "prompt": [5], "max_tokens": 4, "temperature": -1},
        {"custom_id": "c", "prompt": "hello there", "max_tokens": 2, "ignore_eos": True},
    ]
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    results_path = head["work_dir"] / "results.jsonl"
    batch_args = ["python", "-m", "cluster.job", "batch", "--config", str(config)]
    batch_args += ["--input", str(prompts), "--output", str(results_path)]
    batch = submit(head, *batch_args)
    assert batch.returncode == 0, batch.stdout[-3000:] + batch.stderr[-3000:]
    results = [json.loads(line) for line in results_path.read_text().splitlines()]
    assert [record["id"] for record in results] == ["a", "b", "bad", "c"]  # input order
    assert results[0]["response"]["usage"]["completion_tokens"] == 4
    assert results[1]["response"]["object"] == "chat.completion"
    assert results[2]["status"] == 400 and "temperature" in results[2]["error"]["message"]
    assert results[3]["response"]["usage"]["completion_tokens"] == 2

    # A rerun keeps finished lines and retries only the failed one.
    first_response = results[0]["response"]
    rerun = submit(head, *batch_args)
    assert rerun.returncode == 0
    assert "3 already done, 1 to run" in rerun.stdout + rerun.stderr
    rerun_results = [json.loads(line) for line in results_path.read_text().splitlines()]
    assert rerun_results[0]["response"] == first_response
