"""The CI-sized soak: `pagedserve soak` past capacity with clients hanging up at random, and how it sorts request
outcomes."""

from __future__ import annotations

import pytest

from configs.app_config import AppConfig

pytestmark = pytest.mark.serve


def test_soak_ci_sized(deploy_app):
    """`pagedserve soak` for 30 s on the tiny model: past capacity, a quarter of the clients hanging up at random;
    every KV block comes back, no request state is left, memory stays within the bound, a last request succeeds."""
    from cluster.bench.soak import SoakConfig, format_soak_report, run_soak

    config = AppConfig.model_validate(
        {
            "model": {"name": "tiny-random-llama"},
            "cache": {"num_kv_blocks": 128},
            "scheduler": {"max_num_seqs": 8, "max_waiting_requests": 16},
            "parallel": {"worker_num_cpus": 0.5, "num_threads": 1},
            "serve": {"app_name": "soak", "route_prefix": "/soak", "ingress_num_cpus": 0.1},
        }
    )
    soak = SoakConfig(
        duration_s=30, input_len=16, output_len=32, disconnect_fraction=0.25, request_timeout_s=20, seed=3
    )
    report = run_soak(config, soak, base_url=f"{deploy_app(config)}/v1")
    assert report["passed"], format_soak_report(report)
    assert report["completed"] > 0 and report["disconnected"] > 0, format_soak_report(report)
    assert report["free_kv_blocks_after"] == report["free_kv_blocks_before"] == report["kv_blocks"]


def test_soak_sorts_outcomes_by_status():
    from cluster.bench.client import RequestRecord
    from cluster.bench.soak import request_outcome

    assert request_outcome(RequestRecord(success=True)) == "completed"
    assert request_outcome(RequestRecord(error='HTTP 503: {"error": {}}')) == "HTTP 503"
    chunk = 'error chunk: {"message": "did not finish within 3 s", "type": "TimeoutError", "param": null, "code": 504}'
    assert request_outcome(RequestRecord(error=chunk)) == "stream 504"
    assert request_outcome(RequestRecord(error=chunk[:40])) == "stream error"  # cut by the bench client
    assert request_outcome(RequestRecord(error="timed out after 20.0 s")) == "timeout"
    assert request_outcome(RequestRecord(error="ReadError: connection reset")) == "ReadError"
