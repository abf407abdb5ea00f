"""Package-scoped fixtures: the conformance app is deployed once for every module of tests/openai_api."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from configs.app_config import AppConfig
from tests.helpers import serve_apps
from tests.openai_api.common import API_KEY, AUTH, MAX_BODY_BYTES, MODEL, ORIGIN, PREFIX, PROMPT, complete

CONFIG = AppConfig.model_validate(
    {
        "model": {"name": "tiny-random-llama", "served_model_name": MODEL},
        "cache": {"num_kv_blocks": 256},
        "scheduler": {"max_num_seqs": 32},
        "parallel": {"worker_num_cpus": 0.5, "num_threads": 1},
        "serve": {
            "app_name": "conformance",
            "route_prefix": PREFIX,
            "ingress_num_cpus": 0.1,
            "api_key": API_KEY,
            "cors_allow_origins": [ORIGIN],
            "max_body_bytes": MAX_BODY_BYTES,
            "max_n": 8,
            "max_logit_bias_entries": 10,
        },
    }
)


@pytest.fixture(scope="package")
def deploy_package_app(serve_port: int) -> Iterator[Callable[[AppConfig], str]]:
    """`deploy_package_app(config) -> root URL`: the app serves the whole package and is deleted after it."""
    yield from serve_apps(serve_port)


@pytest.fixture(scope="package")
def root(deploy_package_app: Callable[[AppConfig], str]) -> str:
    """http://127.0.0.1:<port>/conf: the app's root (tokenize, health, metrics, version live here)."""
    return deploy_package_app(CONFIG)


@pytest.fixture(scope="package")
def client(root: str) -> OpenAI:
    return OpenAI(base_url=f"{root}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="package")
def http(root: str) -> Iterator[httpx.Client]:
    """Raw HTTP with the key, relative to the app root."""
    with httpx.Client(base_url=root, headers=AUTH, timeout=120) as session:
        yield session


@pytest.fixture(scope="package")
def anonymous(root: str) -> Iterator[httpx.Client]:
    """Raw HTTP without any key."""
    with httpx.Client(base_url=root, timeout=120) as session:
        yield session


@pytest.fixture(scope="package")
def greedy_reference(client: OpenAI) -> dict[str, Any]:
    """PROMPT's greedy continuation (24 tokens, EOS ignored) with its per-token strings."""
    response = complete(client, PROMPT, max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    choice = response.choices[0]
    assert response.usage.completion_tokens == 24
    return {"text": choice.text, "tokens": choice.logprobs.tokens}
