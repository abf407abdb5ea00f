"""Shared fixtures: the real SmolLM2 weights (fetched by `make setup`) and tiny random Llamas for speed."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from model_executor.model_fetch import resolve_model
from model_executor.tiny_model import TINY_ALIAS, write_tiny_llama


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


class HFReference:
    """HF transformers greedy generation in fp32 on the same weights: the correctness anchor (on CPU unless told).

    Stops at EOS like our engine does (EOS included in the tokens), so compare with ignore_eos=False.
    """

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.models: dict[Path, Any] = {}

    def model(self, model_dir: Path) -> Any:
        from transformers import AutoModelForCausalLM

        if model_dir not in self.models:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            self.models[model_dir] = model.to(self.device).eval()
        return self.models[model_dir]

    def greedy(self, model_dir: Path, prompt_token_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        input_ids = torch.tensor([list(prompt_token_ids)], device=self.device)
        with torch.inference_mode():
            generated = self.model(model_dir).generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=0,
            )
        return generated[0, input_ids.shape[1] :].tolist()

    def logits_after(self, model_dir: Path, prompt: Sequence[int], completion: Sequence[int]) -> torch.Tensor:
        """fp32 logits at each completion position, teacher-forced on the given completion."""
        input_ids = torch.tensor([[*prompt, *completion]], device=self.device)
        with torch.inference_mode():
            logits = self.model(model_dir)(input_ids).logits[0]
        return logits[len(prompt) - 1 : -1].float()


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


def assert_no_leaked_blocks(llm: Any) -> None:
    """Every block is back in the free queue once no request is running."""
    scheduler = llm.engine.scheduler
    assert not scheduler.has_unfinished_requests()
    pool = scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)


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


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """Distinct free ports: every probe stays bound until all are picked (the OS may hand a just-closed port out
    again, and a Ray head given the same port twice fails to start)."""
    import socket

    probes = []
    try:
        for _ in range(count):
            probe = socket.socket()
            probe.bind(("127.0.0.1", 0))
            probes.append(probe)
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


@pytest.fixture(scope="session")
def serve_port(ray_cluster: Any) -> int:
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


@contextlib.contextmanager
def deployed_app(config: Any, serve_port: int) -> Iterator[str]:
    """The app of `config` on this session's Serve at its route prefix: yields its root URL, deletes it after."""
    from ray import serve

    from serve_app.app import build_app

    serve.run(build_app(config), name=config.serve.app_name, route_prefix=config.serve.route_prefix)
    try:
        yield f"http://127.0.0.1:{serve_port}{config.serve.route_prefix}"
    finally:
        serve.delete(config.serve.app_name)


def assert_engine_drained(app_name: str, timeout_s: float = 30.0) -> None:
    """Within timeout_s, the app's scheduler actor tracks no request and holds no undelivered output, and every KV
    block is free again."""
    import ray

    from serve_app.engines import ENGINE_NAMESPACE, engine_actor_name

    engine = ray.get_actor(engine_actor_name(app_name), namespace=ENGINE_NAMESPACE)
    deadline = time.monotonic() + timeout_s
    while True:
        stats = ray.get(engine.stats.remote(), timeout=30)
        if stats["num_tracked_requests"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert stats["num_tracked_requests"] == 0 and stats["num_undelivered_outputs"] == 0
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]


def ray_actors(class_prefix: str, state: str = "ALIVE") -> list[dict[str, Any]]:
    """Actors of this session's Ray whose class name starts with `class_prefix` (no dashboard needed)."""
    import ray

    return [
        actor
        for actor in ray._private.state.actors().values()
        if actor["ActorClassName"].startswith(class_prefix) and actor["State"] == state
    ]


def rss_mib(pid: int) -> float:
    """Resident memory of a local process, in MiB."""
    import os

    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
