"""Many nodes on one machine (issue 37): a `ray.cluster_utils.Cluster` of a head and 1-CPU worker nodes, run by
tests/multinode_cluster.py in a process of its own (this session's Ray must never see it), once for the module.

- TP=2 and PP=2 with STRICT_SPREAD placement put each rank on a node of its own and give TP=1's greedy tokens.
- Two engine replicas behind one ingress, an engine per node; removing the node of one engine's worker mid-stream
  ends its streams fast with an error naming the worker and its node, /health says 503 while the other engine
  keeps serving, and the engine comes back on the spare node with the same tokens; with no node left that can
  take it, it stays down saying what it waits for, and a node that joins takes it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.process_helpers import ray_processes_of

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
# Both scenarios on one cluster start: a few minutes on 2 busy cores.
CLUSTER_TIMEOUT_S = 600
# Requests in flight when their engine's worker node goes end within this (the "fast").
FAIL_FAST_S = 30.0


def stop_processes(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue


@pytest.fixture(scope="module")
def cluster_results() -> dict[str, Any]:
    """The child's JSON results (plus `log_tail`, for assertion messages). Its Ray runs in a temp dir of its own,
    so whatever it leaves behind is found by that dir and stopped."""
    ray_tmpdir = tempfile.mkdtemp(prefix="mn-", dir="/tmp")  # short: Ray's socket paths live under it
    out_path = Path(ray_tmpdir) / "results.json"
    log_path = Path(ray_tmpdir) / "child.log"
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=ray_tmpdir, RAY_USAGE_STATS_ENABLED="0")
    command = [sys.executable, "-m", "tests.multinode_cluster", "--out", str(out_path), "offline", "serve"]
    try:
        with open(log_path, "w") as log:
            child = subprocess.Popen(
                command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                child.wait(timeout=CLUSTER_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.error("the multi-node child ran over %d s; stopping it", CLUSTER_TIMEOUT_S)
                os.killpg(child.pid, signal.SIGKILL)
                child.wait(timeout=30)
        log_tail = log_path.read_text(errors="replace")[-6000:]
        assert out_path.exists(), f"the child wrote no results (exit {child.returncode}):\n{log_tail}"
        results = json.loads(out_path.read_text())
        results["log_tail"] = log_tail
        return results
    finally:
        # The cluster's own shutdown stops its processes; anything of this temp dir still running is a leftover.
        deadline = time.monotonic() + 30
        while ray_processes_of(ray_tmpdir) and time.monotonic() < deadline:
            time.sleep(1)
        stop_processes(ray_processes_of(ray_tmpdir))
        shutil.rmtree(ray_tmpdir, ignore_errors=True)


def scenario(results: dict[str, Any], name: str) -> dict[str, Any]:
    outcome = results.get(name)
    assert outcome is not None and "exception" not in outcome, f"{name}: {outcome}\n{results['log_tail']}"
    return outcome


def test_the_placement_strategy_flag_reaches_the_engine_config():
    pagedserve = str(Path(sys.executable).with_name("pagedserve"))
    result = subprocess.run(
        [pagedserve, "serve", "tiny-random-llama", "--placement-strategy", "STRICT_SPREAD", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        # A Ray that serve would start by mistake fails at once at this address.
        env={**os.environ, "RAY_ADDRESS": "127.0.0.1:1"},
    )
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["parallel"]["placement_strategy"] == "STRICT_SPREAD"


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_ranks_spread_over_two_nodes_give_the_single_process_tokens(cluster_results, layout):
    offline = scenario(cluster_results, "offline")
    run = offline[layout]
    assert run["placement_strategy"] == "STRICT_SPREAD"
    ranks = sorted((worker["pp_rank"], worker["tp_rank"]) for worker in run["workers"])
    assert ranks == ([(0, 0), (0, 1)] if layout == "tp2" else [(0, 0), (1, 0)])
    node_ids = [worker["node_id"] for worker in run["workers"]]
    assert len(set(node_ids)) == 2, node_ids
    assert run["tokens"] == offline["tp1_tokens"]


def test_an_engine_per_node_behind_one_ingress(cluster_results):
    serve = scenario(cluster_results, "serve")
    (engine_0_node,), (engine_1_node,) = serve["engine_nodes"]
    assert len({engine_0_node, engine_1_node, serve["head_node_id"]}) == 3
    # The scheduler actors stay beside their ingress: losing a worker node takes that node's workers, nothing else.
    assert serve["ingress_nodes"] == [serve["head_node_id"]]
    assert serve["scheduler_nodes"] == [serve["head_node_id"]] * 2
    assert serve["before"]["doomed"]["status"] == serve["before"]["survivor"]["status"] == 200


def test_losing_a_workers_node_fails_its_streams_fast_and_the_engine_comes_back_on_the_spare_node(cluster_results):
    serve = scenario(cluster_results, "serve")
    loss = serve["spare_node"]
    lost_node = loss["lost_node_id"]
    assert lost_node == serve["engine_nodes"][0][0]
    for stream in loss["streams"]:
        # Tokens first, then one SSE error event and [DONE], soon after the node went.
        assert stream["status"] == 200 and stream["failure"] is None, stream
        assert stream["num_events"] > 3 and stream["last_event"] == "[DONE]", stream
        assert stream["ended_after_removal_s"] < FAIL_FAST_S, stream
        error = stream["error"]
        assert error["code"] == 503 and error["type"] == "ServiceUnavailableError", error
        assert "model worker pp0-tp0" in error["message"] and lost_node[:12] in error["message"], error
    # /health: 503 naming the lost worker's node until the rebuild is done, then 200.
    healths = loss["health"]
    assert healths[0]["status"] == 503 and lost_node[:12] in healths[0]["message"], healths[0]
    assert healths[-1]["status"] == 200, healths[-1]
    # The other engine kept serving throughout.
    assert loss["survivor"] and all(outcome["status"] == 200 for outcome in loss["survivor"]), loss["survivor"]
    assert {outcome["text"] for outcome in loss["survivor"]} == {serve["before"]["survivor"]["text"]}
    after = serve["after_spare"]
    (new_node,) = after["engine_nodes"]
    assert new_node not in (lost_node, serve["engine_nodes"][1][0], serve["head_node_id"])
    assert after["num_rebuilds"] == 1
    assert after["doomed"] == {**after["doomed"], "status": 200, "text": serve["before"]["doomed"]["text"]}


def test_with_no_node_left_for_it_the_engine_stays_down_saying_why_while_the_other_serves(cluster_results):
    serve = scenario(cluster_results, "serve")
    outage = serve["no_room"]
    assert outage["lost_node_id"] == serve["after_spare"]["engine_nodes"][0]
    waiting = outage["waiting_health"]
    assert waiting is not None, outage["health"][-3:]
    # Why it is down (the lost worker and its node) and what it waits for, in one /health answer.
    message = waiting["message"]
    assert outage["lost_node_id"][:12] in message, message
    assert "waiting" in message and "1 worker bundle of {'CPU': 1.0}" in message, message
    assert all(health["status"] == 503 for health in outage["health"]), outage["health"]
    assert outage["survivor"] and all(outcome["status"] == 200 for outcome in outage["survivor"]), outage["survivor"]
    # A prompt the down engine owns is served by the other one, not refused.
    assert [outcome["status"] for outcome in outage["failover"]] == [200, 200], outage["failover"]


def test_a_node_that_joins_takes_the_engine_that_waited_for_room(cluster_results):
    serve = scenario(cluster_results, "serve")
    joined = serve["node_joins"]
    assert joined["health"]["status"] == 200, joined["health"]
    assert joined["engine_nodes"] == [joined["node_id"]]
    assert joined["doomed"] == {**joined["doomed"], "status": 200, "text": serve["before"]["doomed"]["text"]}
