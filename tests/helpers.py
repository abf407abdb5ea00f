"""Plain helpers the test modules share (`from tests.helpers import ...`); the fixtures live in conftest."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from configs.app_config import AppConfig


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


def assert_no_leaked_blocks(llm: Any) -> None:
    """Every block is back in the free queue once no request is running."""
    scheduler = llm.engine.scheduler
    assert not scheduler.has_unfinished_requests()
    pool = scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """Distinct free ports: every probe stays bound until all are picked (the OS may hand a just-closed port out
    again, and a Ray head given the same port twice fails to start)."""
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


def assert_engine_drained(app_name: str, timeout_s: float = 30.0) -> None:
    """Within timeout_s, the app's scheduler actor tracks no request and holds no undelivered output, and every KV
    block is free again."""
    import ray

    from serve_app.engines import ENGINE_NAMESPACE, engine_actor_name

    engine = ray.get_actor(engine_actor_name(app_name), namespace=ENGINE_NAMESPACE)
    deadline = time.monotonic() + timeout_s
    while True:
        stats = ray.get(engine.stats.remote(), timeout=30)
        if stats.num_tracked_requests == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert stats.num_tracked_requests == 0 and stats.num_undelivered_outputs == 0
    assert stats.num_free_blocks == stats.num_kv_blocks


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
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def serve_apps(serve_port: int) -> Iterator[Callable[[AppConfig], str]]:
    """Yields `deploy(config) -> root URL`, which runs the app of `config` on this session's Serve at its route
    prefix; every app it deployed is deleted when the generator closes."""
    from ray import serve

    from serve_app.app import build_app

    app_names: list[str] = []

    def deploy(config: AppConfig) -> str:
        app_names.append(config.serve.app_name)  # before serve.run: an app that failed to start is deleted too
        serve.run(build_app(config), name=config.serve.app_name, route_prefix=config.serve.route_prefix)
        return f"http://127.0.0.1:{serve_port}{config.serve.route_prefix}"

    try:
        yield deploy
    finally:
        for app_name in reversed(app_names):
            serve.delete(app_name)
