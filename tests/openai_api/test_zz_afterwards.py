"""Afterwards: still serving, nothing leaked.

Named to sort last: pytest runs this package's modules in name order, and these tests check the engine
after every other conformance test has run (in this order: the out-of-range seed goes last on purpose).
"""

from __future__ import annotations

import pytest

from tests.openai_api.common import PROMPT, assert_openai_error, chat, completion, greedy_text, metric, wait_until_idle

pytestmark = pytest.mark.serve


def test_still_serving_and_every_kv_block_free(client, anonymous, greedy_reference):
    assert greedy_text(client, PROMPT, max_tokens=24) == greedy_reference["text"]
    assert chat(client, max_tokens=3).choices[0].message.content is not None
    samples = wait_until_idle(anonymous)
    assert metric(samples, "vllm:kv_cache_usage_perc") == 0.0
    assert metric(samples, "pagedserve:kv_cache_usage_perc") == 0.0
    assert anonymous.get("/health").status_code == 200


def test_seed_outside_int64_is_400_and_engine_survives(client, http, anonymous):
    """Last on purpose: a seed torch cannot take must be refused, not reach (and kill) the engine."""
    for seed in (2**64, -(2**63) - 1):
        response = http.post("/v1/completions", json=completion(seed=seed, temperature=1.0))
        assert response.status_code not in (422, 500, 503), response.text
        error = assert_openai_error(response, 400)
        assert error["param"] == "seed", error
    assert greedy_text(client, PROMPT, max_tokens=4)
    assert anonymous.get("/health").status_code == 200
    wait_until_idle(anonymous)
