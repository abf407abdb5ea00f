"""Ctrl-C to `pagedserve serve` while it is still starting (the ingress replica and the engine loading inside
Serve's deploy): it stops at once, with its Ray and every process of it, instead of after the deploy."""

from __future__ import annotations

import signal
import time

import pytest

from tests.fault_helpers import wait_until
from tests.process_helpers import cmdline, free_port_for_direct_ingress, ray_processes_of, start_pagedserve

pytestmark = [pytest.mark.serve, pytest.mark.subprocess, pytest.mark.alone]

STOP_WITHIN_S = 10.0


def test_sigint_while_the_replicas_start_stops_everything_within_10_s(tmp_path):
    server, ray_tmpdir, log_path = start_pagedserve(tmp_path, free_port_for_direct_ingress(), app_name="interrupted")
    try:
        # The ingress replica's process exists: Serve is deploying, the tokenizer and the engine are loading.
        wait_until(
            lambda: (
                server.poll() is None
                and any(b"ServeReplica:interrupted:" in cmdline(pid) for pid in ray_processes_of(ray_tmpdir))
            ),
            240,
            "the ingress replica starting",
        )
        log = log_path.read_text()
        assert "deploying application interrupted" in log and "is ready" not in log, log[-3000:]
        signalled = time.monotonic()
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=STOP_WITHIN_S) == 0, log_path.read_text()[-3000:]
        left_s = STOP_WITHIN_S - (time.monotonic() - signalled)
        wait_until(lambda: not ray_processes_of(ray_tmpdir), max(left_s, 0.5), "every process of its Ray gone")
    finally:
        if server.poll() is None:
            server.kill()
    log = log_path.read_text()
    assert "SIGINT during start-up: stopping" in log and "is ready" not in log, log[-3000:]
