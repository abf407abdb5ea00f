"""Scenarios on a multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`: a head and worker nodes, each
a raylet of its own with its own logical CPUs), run by tests/test_multinode.py in a process of its own (the test
session's Ray must never see this cluster). Each scenario records what a user saw; the test asserts on it.

    python -m tests.multinode_cluster --out results.json offline serve

- offline: the offline LLM attached to the cluster, TP=2 and PP=2 with STRICT_SPREAD placement (each rank on a node
  of its own) against TP=1 in this process, same prompts, greedy.
- serve: the OpenAI app on Ray Serve with two engine replicas, each one worker on a node of its own, prefix routing;
  then the node of engine 0's worker is removed mid-stream (a spare node takes the rebuild), removed again with no
  room left (engine 0 stays down, saying why), and a new node joins (engine 0 comes back there).

Layout: the head has 2 CPUs and the ingress asks 1.5 of them (so it, and the scheduler actors it starts, stay on the
head); worker nodes have 1 CPU each, one worker bundle's worth.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import ray

logger = logging.getLogger("multinode")

APP = "multinode"
WORKER_NODE_CPUS = 1
HEAD_CPUS = 2
INGRESS_CPUS = 1.5
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [3] * 20, [100, 200, 300, 400]]
MAX_TOKENS = 12
# Requests in flight when a node goes: long enough to outlast any rebuild.
LONG_TOKENS = 1500
# How long a scenario waits for the engine to come back (a rebuild starts workers on another node).
RECOVERY_S = 180.0
# How long a node-loss scenario watches the engine stay down (while the other engine serves).
STAYS_DOWN_S = 15.0
ROUTING_PREFIX_TOKENS = 4


def start_cluster(num_worker_nodes: int) -> Any:
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": HEAD_CPUS, "include_dashboard": False},
    )
    for _ in range(num_worker_nodes):
        cluster.add_node(num_cpus=WORKER_NODE_CPUS)
    cluster.wait_for_nodes()
    cluster.connect()
    return cluster


def node_of(cluster: Any, node_id: str) -> Any:
    """The cluster's worker node object with this Ray node id."""
    return next(node for node in cluster.worker_nodes if node.node_id == node_id)


# ---------------------------------------------------------------------------------------------------------------------
# Offline: TP=2 and PP=2 across nodes


def greedy_tokens(llm: Any) -> list[list[int]]:
    from configs.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [output.outputs[0].token_ids for output in llm.generate(PROMPTS, params, use_tqdm=False)]


def parallel_run(tensor_parallel_size: int, pipeline_parallel_size: int, strategy: str) -> dict[str, Any]:
    """One offline LLM with Ray workers placed by `strategy`: its tokens, its workers' nodes, its placement group."""
    from ray.util.placement_group import placement_group_table

    from executor import LLM

    llm = LLM(
        model="tiny-random-llama",
        show_progress=False,
        num_kv_blocks=64,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        distributed_executor="ray",
        placement_strategy=strategy,
        worker_num_cpus=1,
        num_threads=1,
    )
    try:
        executor = llm.engine.core.executor
        identities = ray.get([worker.identity.remote() for worker in executor.worker_handles()], timeout=60)
        table = placement_group_table()[executor.placement_group_id]
        return {
            "tokens": greedy_tokens(llm),
            "workers": identities,
            "placement_strategy": table["strategy"],
        }
    finally:
        llm.engine.shutdown()


def offline_scenario(cluster: Any) -> dict[str, Any]:
    from executor import LLM

    reference = LLM(model="tiny-random-llama", show_progress=False, num_kv_blocks=64, num_threads=1)
    results: dict[str, Any] = {"tp1_tokens": greedy_tokens(reference)}
    del reference
    results["tp2"] = parallel_run(2, 1, "STRICT_SPREAD")
    results["pp2"] = parallel_run(1, 2, "STRICT_SPREAD")
    results["head_node_id"] = cluster.head_node.node_id
    return results


# ---------------------------------------------------------------------------------------------------------------------
# Serve: an engine per node, and node loss


def serve_config(port: int) -> Any:
    from configs.app_config import AppConfig

    return AppConfig.model_validate(
        {
            "model": {"name": "tiny-random-llama"},
            "cache": {"num_kv_blocks": 128},
            "parallel": {"worker_num_cpus": WORKER_NODE_CPUS, "num_threads": 1},
            "serve": {
                "app_name": APP,
                "route_prefix": f"/{APP}",
                "port": port,
                "ingress_num_cpus": INGRESS_CPUS,
                "engine_replicas": 2,
                "routing": "prefix",
                "routing_prefix_tokens": ROUTING_PREFIX_TOKENS,
            },
        }
    )


def prompts_owned_by(replica_index: int, count: int) -> list[list[int]]:
    """Prompts that prefix routing sends to this engine replica (of two)."""
    from serve_app.engine_router import prefix_key, prefix_owner

    prompts = []
    start = 5
    while len(prompts) < count:
        prompt = list(range(start, start + ROUTING_PREFIX_TOKENS + 2))
        if prefix_owner(prefix_key(prompt, ROUTING_PREFIX_TOKENS), [0, 1]) == replica_index:
            prompts.append(prompt)
        start += 7
    return prompts


def engine_handle(index: int) -> Any:
    from serve_app.engines import ENGINE_NAMESPACE, engine_actor_name

    return ray.get_actor(engine_actor_name(APP, index), namespace=ENGINE_NAMESPACE)


def engine_worker_nodes(index: int) -> list[str]:
    topology = ray.get(engine_handle(index).topology.remote(), timeout=60)
    return [worker["node_id"] for worker in topology.workers]


def alive_actor_nodes(class_prefix: str) -> list[str]:
    """Node ids of the live actors whose class name starts with `class_prefix`."""
    return sorted(
        actor["Address"]["NodeID"]
        for actor in ray._private.state.actors().values()
        if actor["State"] == "ALIVE" and actor["ActorClassName"].startswith(class_prefix)
    )


def complete(base: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """One greedy completion: its status, text (or error message) and how long it took."""
    started = time.monotonic()
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    payload = response.json()
    outcome = {"status": response.status_code, "seconds": time.monotonic() - started}
    if response.status_code == 200:
        outcome["text"] = payload["choices"][0]["text"]
    else:
        outcome["error"] = payload.get("error", {}).get("message")
    return outcome


def health(base: str) -> dict[str, Any]:
    response = httpx.get(f"{base}/health", timeout=60)
    message = response.json()["error"]["message"] if response.status_code != 200 else None
    return {"status": response.status_code, "message": message, "at": time.monotonic()}


class StreamRecorder(threading.Thread):
    """One streamed completion in a thread: its `data:` payloads, when the first few came, and when it ended."""

    def __init__(self, base: str, prompt: list[int]):
        super().__init__(daemon=True)
        self.base, self.prompt = base, prompt
        self.events: list[str] = []
        self.status: int | None = None
        self.streaming = threading.Event()
        self.ended_at: float | None = None
        self.failure: str | None = None

    def run(self) -> None:
        body = {"prompt": self.prompt, "max_tokens": LONG_TOKENS, "ignore_eos": True, "stream": True}
        try:
            with (
                httpx.Client(timeout=120) as http,
                http.stream("POST", f"{self.base}/v1/completions", json=body) as response,
            ):
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line.removeprefix("data: "))
                        if len(self.events) >= 3:
                            self.streaming.set()
        except httpx.HTTPError as error:
            self.failure = repr(error)
        finally:
            self.ended_at = time.monotonic()
            self.streaming.set()

    def summary(self, removed_at: float) -> dict[str, Any]:
        last_payload = json.loads(self.events[-2]) if len(self.events) >= 2 else {}
        return {
            "status": self.status,
            "num_events": len(self.events),
            "last_event": self.events[-1] if self.events else None,
            "error": last_payload.get("error"),
            "ended_after_removal_s": None if self.ended_at is None else self.ended_at - removed_at,
            "failure": self.failure,
        }


def until(predicate: Callable[[], Any], timeout_s: float, interval_s: float = 0.5) -> Any:
    """The first truthy value of `predicate` within `timeout_s`, else None (errors count as falsy)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception as error:
            logger.info("still waiting: %r", error)
            value = None
        if value:
            return value
        time.sleep(interval_s)
    return None


def watch_outage(base: str, survivor_prompt: list[int], until_healthy_s: float) -> dict[str, Any]:
    """/health and the surviving engine's completions, polled until /health is 200 again (or `until_healthy_s`)."""
    healths, survivor = [], []
    deadline = time.monotonic() + until_healthy_s
    while time.monotonic() < deadline:
        healths.append(health(base))
        if healths[-1]["status"] == 200:
            break
        if len(survivor) < 5:
            survivor.append(complete(base, survivor_prompt))
        time.sleep(1.0)
    return {"health": healths, "survivor": survivor}


def lose_node_mid_stream(cluster: Any, base: str, doomed: list[list[int]], survivor: list[int]) -> dict[str, Any]:
    """Streams on engine 0; its worker's node is removed (killed, not drained) while they run."""
    (lost_node_id,) = engine_worker_nodes(0)
    streams = [StreamRecorder(base, prompt) for prompt in doomed]
    for stream in streams:
        stream.start()
    assert all(stream.streaming.wait(60) for stream in streams), "streams did not start"
    removed_at = time.monotonic()
    cluster.remove_node(node_of(cluster, lost_node_id), allow_graceful=False)
    logger.info("removed node %s (engine 0's worker) with %d streams in flight", lost_node_id, len(streams))
    for stream in streams:
        stream.join(timeout=120)
    outage = watch_outage(base, survivor, RECOVERY_S)
    return {
        "lost_node_id": lost_node_id,
        "streams": [stream.summary(removed_at) for stream in streams],
        **outage,
    }


def lose_last_room(cluster: Any, base: str, survivor: list[int], doomed: list[int]) -> dict[str, Any]:
    """Engine 0's worker node removed while idle, with no node left that can take its worker."""
    (lost_node_id,) = engine_worker_nodes(0)
    cluster.remove_node(node_of(cluster, lost_node_id), allow_graceful=False)
    removed_at = time.monotonic()
    # Down, and saying what it waits for.
    waiting = until(lambda: (h := health(base))["status"] == 503 and "waiting" in (h["message"] or "") and h, 60)
    down_seen_after_s = None if waiting is None else waiting["at"] - removed_at
    # A prompt engine 0 owns: refused there as down, it runs on engine 1 instead (twice: the first finds it down).
    failover = [complete(base, doomed), complete(base, doomed)]
    outage = watch_outage(base, survivor, STAYS_DOWN_S)
    return {
        "lost_node_id": lost_node_id,
        "waiting_health": waiting,
        "failover": failover,
        "down_seen_after_s": down_seen_after_s,
        **outage,
    }


def serve_scenario(cluster: Any) -> dict[str, Any]:
    from ray import serve

    from serve_app.app import build_app
    from tests.helpers import free_port

    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    config = serve_config(port)
    serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
    base = f"http://127.0.0.1:{port}/{APP}"
    doomed, survivor = prompts_owned_by(0, 3), prompts_owned_by(1, 1)[0]
    results: dict[str, Any] = {
        "head_node_id": cluster.head_node.node_id,
        "engine_nodes": [engine_worker_nodes(0), engine_worker_nodes(1)],
        "ingress_nodes": alive_actor_nodes("ServeReplica"),
        "scheduler_nodes": alive_actor_nodes("EngineActor"),
        "before": {"doomed": complete(base, doomed[0]), "survivor": complete(base, survivor)},
    }
    # (a) A spare node: engine 0 is rebuilt there.
    results["spare_node"] = lose_node_mid_stream(cluster, base, doomed[1:], survivor)
    results["after_spare"] = {
        "engine_nodes": engine_worker_nodes(0),
        "doomed": complete(base, doomed[0]),
        "num_rebuilds": ray.get(engine_handle(0).stats.remote(), timeout=60).num_rebuilds,
    }
    # (b) No room left: engine 0 stays down with the reason; engine 1 serves on.
    results["no_room"] = lose_last_room(cluster, base, survivor, doomed[0])
    # A node joins: the waiting rebuild places engine 0's worker there.
    joined = cluster.add_node(num_cpus=WORKER_NODE_CPUS)
    recovery = watch_outage(base, survivor, RECOVERY_S)
    results["node_joins"] = {
        "node_id": joined.node_id,
        "health": recovery["health"][-1],
        "engine_nodes": engine_worker_nodes(0) if recovery["health"][-1]["status"] == 200 else None,
        "doomed": complete(base, doomed[0]),
    }
    serve.delete(APP)
    serve.shutdown()
    return results


SCENARIOS = {"offline": (offline_scenario, 3), "serve": (serve_scenario, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="Where to write the JSON results.")
    parser.add_argument("scenarios", nargs="+", choices=sorted(SCENARIOS))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.pop("RAY_ADDRESS", None)
    num_worker_nodes = max(SCENARIOS[name][1] for name in args.scenarios)
    started = time.monotonic()
    cluster = start_cluster(num_worker_nodes)
    results: dict[str, Any] = {"cluster_start_s": time.monotonic() - started}
    try:
        for name in args.scenarios:
            scenario, _ = SCENARIOS[name]
            scenario_started = time.monotonic()
            try:
                results[name] = scenario(cluster)
            except Exception as error:
                logger.exception("scenario %s failed", name)
                results[name] = {"exception": repr(error)}
            results[name]["seconds"] = time.monotonic() - scenario_started
            # Written after each scenario: a later one that hangs still leaves these.
            args.out.write_text(json.dumps(results, indent=1))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
