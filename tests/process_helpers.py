"""Helpers of the tests that start processes of their own: `pagedserve serve` in a Ray of its own, a local
`ray start --head`, and finding what such a Ray left behind (`from tests.process_helpers import ...`)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tests.helpers import free_port, free_ports
from tests.k8s_schema import REPO, VENV_BIN


def free_port_for_direct_ingress() -> int:
    """A free port whose next one is free too: with direct ingress, Serve's proxy takes port + 1."""
    port = free_port()
    while port_in_use(port + 1):
        port = free_port()
    return port


def port_in_use(port: int) -> bool:

    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def ray_processes_of(ray_tmpdir: str) -> list[int]:
    """Processes (Ray's daemons and workers) whose environment points at this Ray temp dir."""
    marker = f"RAY_TMPDIR={ray_tmpdir}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def start_pagedserve(
    tmp_path: Path,
    port: int,
    *,
    model: str = "tiny-random-llama",
    env: dict[str, str] | None = None,
    **serve_section: Any,
) -> tuple[subprocess.Popen, str, Path]:
    """`pagedserve serve` on a tiny model (`model`: any name the CLI takes) in a Ray of its own: nothing of this
    session's cluster may count, and nothing of its own may stay. `env` is added to the process's environment.
    Returns the process, its Ray temp dir and its log."""
    config_path = tmp_path / "tiny.yaml"
    config_path.write_text(
        json.dumps(
            {
                "model": {"name": model},
                "cache": {"num_kv_blocks": 128},
                "parallel": {"worker_num_cpus": 0.5, "num_threads": 1},
                "serve": {"port": port, "ingress_num_cpus": 0.1, **serve_section},
            }
        )
    )
    ray_tmpdir = tempfile.mkdtemp(prefix="ps-", dir="/tmp")
    process_env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    process_env.update(RAY_TMPDIR=ray_tmpdir, RAY_USAGE_STATS_ENABLED="0")
    process_env.update(env or {})
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [str(Path(sys.executable).with_name("pagedserve")), "serve", "--config", str(config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=process_env,
        )
    return server, ray_tmpdir, log_path


class LocalRayHead:
    """`ray start --head --block` in its own session and temp dir: stopping it touches no other Ray on the box
    (`ray stop` would stop every Ray of this user)."""

    def __init__(self, temp_dir: Path, env: dict[str, str]):
        ports = free_ports(7)
        self.gcs_port, self.dashboard_port = ports[:2]
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        self.temp_dir, self.env = temp_dir, {**env, "RAY_ADDRESS": f"127.0.0.1:{self.gcs_port}"}
        command = [
            str(VENV_BIN / "ray"),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={self.gcs_port}",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}",
            # Every other fixed default port could collide with another test's Ray on this machine.
            f"--ray-client-server-port={ports[2]}",
            f"--dashboard-agent-listen-port={ports[3]}",
            f"--dashboard-agent-grpc-port={ports[4]}",
            f"--metrics-export-port={ports[5]}",
            f"--runtime-env-agent-port={ports[6]}",
            "--num-cpus=8",
            "--num-gpus=0",
            f"--object-store-memory={256 * 2**20}",
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
        ]
        self.log = (temp_dir / "ray-start.log").open("w")
        self.process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(VENV_BIN / "serve"), *args, "--address", self.dashboard],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def wait_for_dashboard(self, headers: dict[str, str], timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log_tail()
            try:
                if httpx.get(f"{self.dashboard}/api/version", headers=headers, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise AssertionError(f"the Ray dashboard did not answer within {timeout:.0f}s\n{self.log_tail()}")

    def log_tail(self) -> str:
        self.log.flush()
        return (self.temp_dir / "ray-start.log").read_text()[-3000:]

    def serve_logs_tail(self) -> str:
        """The end of every Serve replica's log: why an application did not come up."""
        logs = sorted((self.temp_dir / "session_latest" / "logs" / "serve").glob("replica_*.log"))
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}" for log in logs)

    def stop(self) -> None:
        # SIGTERM makes `ray start --block` stop the processes it started; SIGKILL to its group mops up the rest.
        if self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)
        self.log.close()

    def shut_down(self) -> None:
        """Serve's `shutdown` first (its apps and actors), then the head, then its temp dir, however each goes."""
        try:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.cli("shutdown", "-y", timeout=60)
        finally:
            self.stop()
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def token_auth_head_env(token: str) -> dict[str, str]:
    """The environment of a local head of our own and its CLI calls: its own token (no shared ~/.ray/auth_token,
    no open cluster), never this session's RAY_ADDRESS."""
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
        # Teardown: SIGTERM would otherwise drain the node for Serve first, which only matters with live traffic.
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    }
    env.pop("RAY_ADDRESS", None)
    return env
