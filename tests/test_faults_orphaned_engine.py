"""Faults on the scheduler actor alone, detached and named as the ingress makes it: a silent ingress (an abort that
overtakes its request, a client that stops polling), no ingress left at all, and a start slower than the orphan
timeout. The engine frees what its callers left and ends itself, workers and placement group included."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import ray

from configs.engine_config import EngineConfig
from configs.sampling_params import SamplingParams
from executor.engine_actor import EngineActor
from serve_app.engines import ENGINE_NAMESPACE
from tests.fault_helpers import assert_all_gone, wait_until

pytestmark = [pytest.mark.serve, pytest.mark.alone]


def detached_engine(model_dir: Path, name: str, request_lease_s: float, orphan_timeout_s: float) -> Any:
    """A scheduler actor over the tiny model, detached and named as the ingress makes it."""
    config = EngineConfig(model=str(model_dir), num_kv_blocks=64, worker_num_cpus=0.5, num_threads=1)
    return (
        ray.remote(EngineActor)
        .options(num_cpus=0, lifetime="detached", name=name, namespace=ENGINE_NAMESPACE)
        .remote(config, 0, request_lease_s, orphan_timeout_s)
    )


def test_silent_ingress_early_abort_and_orphaned_engine(ray_cluster, tiny_model_dir):
    """Scheduler actor alone, detached as the ingress makes it: an abort that overtakes its add_request (Ray runs an
    async actor's calls out of order) drops that request; the requests of a client that stops polling are aborted
    after the lease; with no ingress left at all the engine ends itself, and its placement group goes with it."""
    actor = detached_engine(tiny_model_dir, "orphan-test", request_lease_s=2.0, orphan_timeout_s=6.0)
    try:
        parts = {"engine": actor._actor_id.hex(), "workers": []}
        ray.get(actor.engine_info.remote(), timeout=120)
        parts["placement_group"] = ray.get(actor.topology.remote(), timeout=30).placement_group_id
        params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
        ray.get(actor.abort.remote(["early"]), timeout=30)
        ray.get(actor.add_request.remote("ghost", "early", [5, 6], params), timeout=30)
        ray.get(actor.add_request.remote("ghost", "orphan", [5, 6, 7], params), timeout=30)
        stats = ray.get(actor.stats.remote(), timeout=30)
        assert stats.num_running + stats.num_waiting == 1  # "early" was dropped

        def freed() -> bool:
            stats = ray.get(actor.stats.remote(), timeout=30)
            return stats.num_running == 0 and stats.num_free_blocks == stats.num_kv_blocks

        # Nobody polls for "ghost": after the 2 s lease its request is aborted.
        wait_until(freed, 10, "silent client's request aborted")
        # Nobody at all for 6 s: the engine ends itself, workers and placement group included.
        assert_all_gone(parts, timeout_s=30)
    finally:
        ray.kill(actor)


def test_an_engine_slower_to_start_than_its_orphan_timeout_still_serves_its_ingress(ray_cluster, tiny_model_dir):
    """An ingress waiting in attach while the workers start is present: a start longer than the orphan timeout (a
    kernel build, a slow node) must not end the engine under it, which the ingress would recreate forever."""
    # Starting a worker process and loading the model takes seconds; the engine would orphan itself after 1.
    actor = detached_engine(tiny_model_dir, "slow-start-test", request_lease_s=1.0, orphan_timeout_s=1.0)
    try:
        started = time.monotonic()
        info = ray.get(actor.attach.remote("ingress"), timeout=120)
        assert time.monotonic() - started > 1.0  # the start really outlasted the orphan timeout
        assert info.engine_config.cache.num_kv_blocks == 64
        parts = {"engine": actor._actor_id.hex(), "workers": []}
        parts["placement_group"] = ray.get(actor.topology.remote(), timeout=30).placement_group_id
        # Once nobody is waiting and nobody polls, it still ends itself.
        assert_all_gone(parts, timeout_s=30)
    finally:
        ray.kill(actor)
