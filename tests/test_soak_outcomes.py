"""How the soak sorts request outcomes (the soak itself runs through `make soak` in tests/test_commands.py)."""

from __future__ import annotations


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
