"""Shared fixtures: the real SmolLM2 weights (fetched by `make setup`), tiny random Llamas for speed, one local Ray
with Ray Serve for the session, and apps deployed on it. Plain helpers live in tests/helpers.py."""

from __future__ import annotations

import os

import torch

# Triton decorates its kernels for the interpreter or for the GPU once, when it is first imported (torch does not
# import it): set here, before any test module is imported, every CPU-only run interprets whatever the module order.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from configs.app_config import AppConfig
from model_executor.model_fetch import resolve_model
from model_executor.tiny_model import TINY_ALIAS, write_tiny_llama
from tests.helpers import HFReference, free_port, serve_apps
from tests.model_families import FAMILY_SPECS, write_tiny_family


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return resolve_model(TINY_ALIAS)


@pytest.fixture(scope="session")
def tiny_llama3_rope_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """Tiny model with Llama 3 long-context rope scaling, to check our rotary tables against HF's."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama3"), smollm2_dir, rope_parameters=rope)


@pytest.fixture(scope="session")
def family_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Callable[[str], Path]:
    """`family_model_dir(name)`: the tiny checkpoint of `tests.model_families.FAMILY_SPECS[name]`, built on first
    use and shared by the session."""
    built: dict[str, Path] = {}

    def build(name: str) -> Path:
        if name not in built:
            built[name] = write_tiny_family(name, tmp_path_factory.mktemp(f"tiny-{name}"), smollm2_dir)
        return built[name]

    return build


def _family_dir_fixture(name: str) -> Any:
    @pytest.fixture(scope="session", name=f"tiny_{name}_dir")
    def family_dir(family_model_dir: Callable[[str], Path]) -> Path:
        return family_model_dir(name)

    family_dir.__doc__ = f"The tiny {name} checkpoint of tests.model_families (session-scoped)."
    return family_dir


# One session fixture per family: tiny_llama_dir, tiny_qwen2_dir, tiny_gemma3_dir, ...
for _family in FAMILY_SPECS:
    globals()[f"tiny_{_family}_dir"] = _family_dir_fixture(_family)


@pytest.fixture(scope="session")
def hf_reference() -> HFReference:
    return HFReference()


@pytest.fixture(scope="session")
def smollm2_llm() -> Any:
    from executor import LLM

    return LLM(model="smollm2-135m-instruct", show_progress=False, num_kv_blocks=1024, max_num_seqs=64)


@pytest.fixture
def make_llm() -> Callable[..., Any]:
    """Build an LLM per test configuration (tiny models load in well under a second)."""
    from executor import LLM

    def build(model_dir: Path, **engine_args: Any) -> Any:
        engine_args.setdefault("num_kv_blocks", 256)
        return LLM(model=str(model_dir), show_progress=False, **engine_args)

    return build


@pytest.fixture(scope="session")
def ray_cluster() -> Any:
    """One local Ray for the whole session, with more logical CPUs than cores so TP=3 and TP x PP fit."""
    import ray

    if not ray.is_initialized():
        # "local": never attach to a head some other test started with `ray start`.
        ray.init(address="local", num_cpus=16, include_dashboard=False, log_to_driver=False)
    yield ray
    try:
        from ray import serve

        serve.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def serve_port(ray_cluster: Any) -> int:
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


@pytest.fixture(scope="module")
def deploy_module_app(serve_port: int) -> Iterator[Callable[[AppConfig], str]]:
    """`deploy_module_app(config) -> root URL`: the app serves the whole module and is deleted after it."""
    yield from serve_apps(serve_port)


@pytest.fixture
def deploy_app(serve_port: int) -> Iterator[Callable[[AppConfig], str]]:
    """`deploy_app(config) -> root URL`: the app serves one test and is deleted after it."""
    yield from serve_apps(serve_port)
