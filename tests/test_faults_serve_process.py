"""Faults on `pagedserve serve` as a process with a Ray of its own: the direct-ingress replica killed and replaced
on the same port, and SIGTERM, which drains the request in flight, refuses new ones and leaves no process behind.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import httpx
import pytest

from tests.fault_helpers import LONG, completes, stream_events, wait_until
from tests.process_helpers import cmdline, free_port_for_direct_ingress, ray_processes_of, start_pagedserve

pytestmark = [pytest.mark.serve, pytest.mark.alone]


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
