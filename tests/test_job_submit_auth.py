"""`ray job submit` against a head with Ray's token authentication on, the way the README says to submit.

Ray >= 2.52 turns token auth on for `ray start --head` once `~/.ray/auth_token` exists, and any local `ray.init`
(`make serve`, this test session) writes that file; the `ray job submit` client sends the token only under
`RAY_AUTH_MODE=token`. The head here runs in a home and a temp dir of its own, on free ports, and only its own
processes are stopped at the end: this session's Ray is never touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import free_ports

pytestmark = pytest.mark.subprocess

BIN = Path(sys.executable).parent
RAY = str(BIN / "ray")
REPO = Path(__file__).resolve().parents[1]
# Connects to the cluster from the job (the driver authenticates too) and imports from the uploaded working dir.
JOB = "import cluster.job, ray; ray.init(); print('answer', ray.get(ray.remote(lambda: 41 + 1).remote()))"


def run(command: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)


def submit(address: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`ray job submit --address http://HEAD:8265 --working-dir . -- python ...`, as the README shows."""
    command = [RAY, "job", "submit", "--address", address, "--working-dir", ".", "--", "python", "-c", JOB]
    deadline = time.monotonic() + 90
    while True:
        completed = run(command, env, 300)
        # A fresh head's job agent takes a few seconds to come up after the dashboard answers.
        if "No available agent" not in completed.stderr or time.monotonic() > deadline:
            return completed
        time.sleep(2)


def stop_head(home: Path) -> None:
    """Stop every process of this head (all inherit its HOME), and nothing else: `ray stop` would stop every Ray
    on the machine, this session's included."""
    processes = []
    for process in psutil.process_iter(["environ"]):
        if process.pid != os.getpid() and (process.info["environ"] or {}).get("HOME") == str(home):
            processes.append(process)
    for process in processes:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(processes, timeout=15)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(alive, timeout=15)


def output(completed: subprocess.CompletedProcess[str]) -> str:
    return f"exit {completed.returncode}\nstdout:\n{completed.stdout[-3000:]}\nstderr:\n{completed.stderr[-3000:]}"


def test_ray_job_submit_to_a_token_auth_head_works_with_ray_auth_mode_token(tmp_path):
    """A head started where `~/.ray/auth_token` exists has token auth on: `ray job submit` alone gets
    "Authentication required"; with `RAY_AUTH_MODE=token` it sends that file's token and the job runs; a client
    without the file (another machine) passes the cluster's token in `RAY_AUTH_TOKEN`."""
    home = tmp_path / "home"
    home.mkdir()
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_AUTH") and key != "RAY_ADDRESS"}
    # The job's `python` is whatever the head's PATH finds: this venv, as on a cluster built from one image.
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    # What an earlier local `ray.init` (make serve, a test run) leaves behind in the home directory.
    generated = run([RAY, "get-auth-token", "--generate"], env, 60)
    assert generated.returncode == 0, output(generated)
    token = (home / ".ray" / "auth_token").read_text().strip()

    temp_dir = tempfile.mkdtemp(prefix="ps-auth-", dir="/tmp")  # short: Ray's socket paths have a length limit
    gcs_port, dashboard_port, *agent_ports = free_ports(9)
    head = [RAY, "start", "--head", f"--port={gcs_port}", f"--dashboard-port={dashboard_port}"]
    head += ["--dashboard-host=127.0.0.1", "--include-dashboard=true", "--num-cpus=2", f"--temp-dir={temp_dir}"]
    # Free ports for every agent, or a second cluster on this machine (the test session's) collides.
    head += [
        f"--dashboard-agent-listen-port={agent_ports[0]}",
        f"--dashboard-agent-grpc-port={agent_ports[1]}",
        f"--metrics-export-port={agent_ports[2]}",
        f"--runtime-env-agent-port={agent_ports[3]}",
        f"--ray-client-server-port={agent_ports[4]}",
        f"--node-manager-port={agent_ports[5]}",
        f"--object-manager-port={agent_ports[6]}",
        "--disable-usage-stats",
    ]
    address = f"http://127.0.0.1:{dashboard_port}"
    try:
        started = run(head, env, 180)
        assert started.returncode == 0, output(started)
        assert "Token authentication is enabled" in started.stdout + started.stderr, output(started)

        refused = submit(address, env)
        assert refused.returncode != 0, output(refused)
        assert "Authentication required" in refused.stderr, output(refused)

        accepted = submit(address, {**env, "RAY_AUTH_MODE": "token"})
        assert accepted.returncode == 0, output(accepted)
        assert "answer 42" in accepted.stdout and "succeeded" in accepted.stdout, output(accepted)

        elsewhere = tmp_path / "elsewhere"  # a client's home without the token file
        elsewhere.mkdir()
        remote = {**env, "HOME": str(elsewhere), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
        from_elsewhere = submit(address, remote)
        assert from_elsewhere.returncode == 0, output(from_elsewhere)
        assert "answer 42" in from_elsewhere.stdout, output(from_elsewhere)
    finally:
        stop_head(home)
        shutil.rmtree(temp_dir, ignore_errors=True)
