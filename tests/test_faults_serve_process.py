"""Faults on `pagedserve serve` as a process with a Ray of its own: the direct-ingress replica killed and replaced
on the same port, and SIGTERM, which drains the request in flight, refuses new ones and leaves no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fault_helpers import LONG, completes, stream_events, wait_until
from tests.helpers import free_port

pytestmark = pytest.mark.serve


@pytest.mark.subprocess
def test_direct_ingress_serves_the_port_from_the_replica_and_recovers_it_after_a_crash(tmp_path):
    """serve.direct_ingress: the ingress replica itself listens on serve.port (Serve's proxy on port + 1); a
    replacement replica takes the port back at once after the first one is killed; SIGTERM still drains."""
    port = free_port_for_direct_ingress()
    server, ray_tmpdir, log_path = start_pagedserve(tmp_path, port, app_name="direct", direct_ingress=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{base}/health", timeout=5).status_code == 200, 180, "pagedserve serve up")
        wait_until(lambda: f"Started HTTP server on port {port}" in log_path.read_text(), 30, "replica on the port")
        events = stream_events(base, {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "stream": True})
        assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        bad = httpx.post(f"{base}/v1/completions", json={"prompt": [5], "max_tokens": -1}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        # The replica's own HTTP server takes the headers the proxy took before: oversized ones are still refused.
        big = httpx.post(f"{base}/v1/completions", json={"prompt": [5]}, headers={"X-Big": "a" * 2**20}, timeout=30)
        assert big.status_code == 431 and big.json()["error"]["type"] == "RequestHeaderFieldsTooLarge"
        assert completes(f"http://127.0.0.1:{port + 1}")  # Serve's proxy, one hop longer, still routes

        replicas = [pid for pid in ray_processes_of(ray_tmpdir) if b"ServeReplica:direct:" in cmdline(pid)]
        assert len(replicas) == 1
        os.kill(replicas[0], signal.SIGKILL)
        wait_until(lambda: completes(base), 120, "a replacement replica serving the port")
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=120) == 0, log_path.read_text()[-3000:]
    finally:
        if server.poll() is None:
            server.kill()
    wait_until(lambda: not ray_processes_of(ray_tmpdir), 30, "every process of its Ray gone")


def free_port_for_direct_ingress() -> int:
    """A free port whose next one is free too: with direct ingress, Serve's proxy takes port + 1."""
    port = free_port()
    while port_in_use(port + 1):
        port = free_port()
    return port


def port_in_use(port: int) -> bool:
    import socket

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


def start_pagedserve(tmp_path: Path, port: int, **serve_section: Any) -> tuple[subprocess.Popen, str, Path]:
    """`pagedserve serve` on the tiny model in a Ray of its own: nothing of this session's cluster may count, and
    nothing of its own may stay. Returns the process, its Ray temp dir and its log."""
    config_path = tmp_path / "tiny.yaml"
    config_path.write_text(
        json.dumps(
            {
                "model": {"name": "tiny-random-llama"},
                "cache": {"num_kv_blocks": 128},
                "parallel": {"worker_num_cpus": 0.5, "num_threads": 1},
                "serve": {"port": port, "ingress_num_cpus": 0.1, **serve_section},
            }
        )
    )
    ray_tmpdir = tempfile.mkdtemp(prefix="ps-", dir="/tmp")
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=ray_tmpdir, RAY_USAGE_STATS_ENABLED="0")
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [str(Path(sys.executable).with_name("pagedserve")), "serve", "--config", str(config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    return server, ray_tmpdir, log_path


@pytest.mark.subprocess
def test_sigterm_to_pagedserve_serve_drains_and_leaves_no_process(tmp_path):
    port = free_port_for_direct_ingress()  # direct ingress is the default of `pagedserve serve`
    server, ray_tmpdir, log_path = start_pagedserve(tmp_path, port, app_name="sigterm")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{base}/health", timeout=5).status_code == 200, 180, "pagedserve serve up")
        # Unset in the config, with a Ray of its own and one ingress replica: the replica serves the port itself.
        wait_until(lambda: f"Started HTTP server on port {port}" in log_path.read_text(), 30, "replica on the port")
        results: dict[str, Any] = {}

        def signal_when_streaming(count: int) -> None:
            if count == 2:
                server.send_signal(signal.SIGTERM)
                # /health turns 503 once the drain began; the stream in flight keeps it going for seconds.
                wait_until(lambda: httpx.get(f"{base}/health", timeout=5).status_code == 503, 30, "draining")
                results["refused"] = httpx.post(f"{base}/v1/completions", json={"prompt": [5]}, timeout=30)

        events = stream_events(base, {**LONG, "max_tokens": 1000, "stream": True}, signal_when_streaming)
        assert server.wait(timeout=120) == 0, log_path.read_text()[-3000:]
    finally:
        if server.poll() is None:
            server.kill()
    # In flight when the signal came: finished in full. Sent after it: 503.
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert results["refused"].status_code == 503, results["refused"].text
    assert "shutting down" in results["refused"].json()["error"]["message"]
    wait_until(lambda: not ray_processes_of(ray_tmpdir), 30, "every process of its Ray gone")
