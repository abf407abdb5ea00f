"""Plain helpers the test modules share (`from tests.helpers import ...`); the fixtures live in conftest."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from configs.app_config import AppConfig

# Below this many parameters HFReference runs on one thread (tests' tiny random models have ~3-7 million).
TINY_MODEL_PARAMETERS = 20_000_000


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for a block: a tiny model's ops are too small to split."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class HFReference:
    """HF transformers greedy generation in fp32 on the same weights: the correctness anchor (on CPU unless told).

    Eager attention for every family (the only HF path that soft-caps Gemma 2's attention logits). Greedy results
    are memoised per (directory, prompt): generation is causal, so the first n tokens of a longer run are the
    n-token run, and cells of the parity matrix share one reference. Stops at EOS like our engine does (EOS
    included in the tokens), so compare with ignore_eos=False.
    """

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.models: dict[tuple[Path, torch.dtype], Any] = {}
        # (directory, prompt) -> (max_new_tokens it ran with, its tokens)
        self.greedy_runs: dict[tuple[Path, tuple[int, ...]], tuple[int, list[int]]] = {}

    @contextmanager
    def threads_for(self, model: Any) -> Iterator[None]:
        """One torch thread for a tiny model on CPU: its ops are too small to split, and on a busy machine the
        threads' hand-offs cost ten times the math. Larger models keep the process's threads."""
        if self.device.type != "cpu" or model.num_parameters() > TINY_MODEL_PARAMETERS:
            yield
            return
        with one_torch_thread():
            yield

    def model(self, model_dir: Path, dtype: torch.dtype = torch.float32) -> Any:
        from transformers import AutoModelForCausalLM

        key = (Path(model_dir), dtype)
        if key not in self.models:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
            self.models[key] = model.to(self.device).eval()
        return self.models[key]

    def greedy(self, model_dir: Path, prompt_token_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        key = (Path(model_dir), tuple(prompt_token_ids))
        known = self.greedy_runs.get(key)
        if known is not None and known[0] >= max_new_tokens:
            return known[1][:max_new_tokens]
        input_ids = torch.tensor([list(prompt_token_ids)], device=self.device)
        model = self.model(model_dir)
        with torch.inference_mode(), self.threads_for(model):
            generated = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=0,
            )
        tokens = generated[0, input_ids.shape[1] :].tolist()
        self.greedy_runs[key] = (max_new_tokens, tokens)
        return list(tokens)

    def logits_after(
        self,
        model_dir: Path,
        prompt: Sequence[int],
        completion: Sequence[int],
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """Logits (as fp32) at each completion position, teacher-forced on the given completion; the model runs in
        `dtype`."""
        input_ids = torch.tensor([[*prompt, *completion]], device=self.device)
        model = self.model(model_dir, dtype)
        with torch.inference_mode(), self.threads_for(model):
            logits = model(input_ids).logits[0]
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


# A template that renders the tools, an assistant's calls and a tool message's id (the tiny model's own ignores them).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% for call in message.tool_calls or [] %}<tool_call>{{ call.function.name }} "
    "{{ call.function.arguments | tojson }}</tool_call>{% endfor %}"
    "{% if message.tool_call_id %}[{{ message.tool_call_id }}] {% endif %}"
    "{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_abc123",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1, "metric": true}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_abc123", "content": "sunny"},
]


def with_tools_template(model_dir: Path, dest: Path) -> Path:
    """A copy of the tiny model at `dest` with TOOLS_TEMPLATE as the chat template of its tokenizer_config.json."""
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(model_dir / name, dest / name)
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = TOOLS_TEMPLATE
    (dest / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return dest
