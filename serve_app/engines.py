"""Engine replicas by name: the scheduler actors an app's ingress creates, adopts after a restart, and that
operators (`cluster/`) and tests look up."""

from __future__ import annotations

from typing import Any

import ray

from configs.app_config import AppConfig
from executor.engine_actor import REQUEST_LEASE_S, EngineActor

# Engine actors live in a namespace of their own, so operators and tests find them by name from any job.
ENGINE_NAMESPACE = "pagedserve"
# Serve health-checks every replica every 10 s (each check pings the engines): six missed checks and no ingress is
# left, so the engine ends itself.
ENGINE_ORPHAN_TIMEOUT_S = 60.0


def engine_actor_name(app_name: str, replica_index: int = 0) -> str:
    return f"{app_name}-engine-{replica_index}"


def get_or_create_engine(config: AppConfig, replica_index: int = 0) -> Any:
    """A scheduler actor of this app; the first ingress replica creates it, the others find it by name.

    Detached, so an ingress replica's death does not take it along (its replacement re-adopts it by name) and Ray
    removes its placement group when it ends; it ends itself when its last ingress detaches or falls silent.
    """
    engine_class = ray.remote(EngineActor)
    return engine_class.options(
        name=engine_actor_name(config.serve.app_name, replica_index),
        namespace=ENGINE_NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=0,
        max_concurrency=10_000,
    ).remote(config.engine_config(), replica_index, REQUEST_LEASE_S, ENGINE_ORPHAN_TIMEOUT_S)


def engine_handle(app_name: str, replica_index: int = 0) -> Any:
    """The running scheduler actor of an app's engine replica (raises ValueError when there is none)."""
    return ray.get_actor(engine_actor_name(app_name, replica_index), namespace=ENGINE_NAMESPACE)
