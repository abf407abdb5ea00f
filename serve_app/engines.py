"""Engine replicas by name, and their lifecycle as an ingress replica sees it: create or adopt them, replace one
that runs another config, detach when the replica stops. Operators (`cluster/`) and tests look them up here too."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from configs.app_config import AppConfig
from executor.engine_actor import REQUEST_LEASE_S, EngineActor
from executor.errors import EngineDrainingError, short_reason

if TYPE_CHECKING:
    from configs.engine_config import EngineConfig
    from executor.outputs import EngineInfo
    from serve_app.engine_client import EngineClient

logger = logging.getLogger(__name__)

# Engine actors live in a namespace of their own, so operators and tests find them by name from any job.
ENGINE_NAMESPACE = "pagedserve"
# Serve health-checks every replica every 10 s (each check pings the engines): six missed checks and no ingress is
# left, so the engine ends itself.
ENGINE_ORPHAN_TIMEOUT_S = 60.0
# A new engine loads its model and builds its workers before it answers attach.
ENGINE_READY_TIMEOUT_S = 600.0
DETACH_TIMEOUT_S = 10.0


def engine_group(app_name: str, model_name: str | None = None) -> str:
    """The prefix of one served model's engine actors: the app's name, plus the model's when the app serves several."""
    if model_name is None:
        return app_name
    # Actor names are free text, but keep hub ids' slashes out of names operators type.
    return f"{app_name}-{model_name.replace('/', '--')}"


def engine_actor_name(group: str, replica_index: int = 0) -> str:
    return f"{group}-engine-{replica_index}"


def get_or_create_engine(config: AppConfig, group: str, replica_index: int = 0) -> Any:
    """A scheduler actor of the engine group `group` (a Serve application, or one model of it); its first ingress
    replica (or the group's autoscaler) creates it, the others find it by name. Named after the Serve application,
    so two applications never share one.

    Detached, so an ingress replica's death does not take it along (its replacement re-adopts it by name) and Ray
    removes its placement group when it ends; it ends itself when its last client detaches or falls silent.
    """
    engine_class = ray.remote(EngineActor)
    return engine_class.options(
        name=engine_actor_name(group, replica_index),
        namespace=ENGINE_NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=0,
        max_concurrency=10_000,
        # Beside its creator (an ingress replica, or the autoscaler on the head), not wherever Ray spreads a
        # CPU-less actor: a worker node's loss would take the scheduler along.
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
    ).remote(config.engine_config(), replica_index, REQUEST_LEASE_S, ENGINE_ORPHAN_TIMEOUT_S)


def engine_creators(config: AppConfig, group: str) -> list[Callable[[], Any]]:
    """One blocking `get_or_create_engine` per fixed engine replica of the group, for EngineClient to call again."""
    replicas = range(config.serve.engine_replicas)
    return [functools.partial(get_or_create_engine, config, group, index) for index in replicas]


def engine_handle(group: str, replica_index: int = 0) -> Any:
    """The running scheduler actor of a group's engine replica (raises ValueError when there is none)."""
    return ray.get_actor(engine_actor_name(group, replica_index), namespace=ENGINE_NAMESPACE)


def engine_groups(config: AppConfig, app_name: str) -> list[tuple[str, AppConfig]]:
    """(engine group, its single-model config) of every model the application serves."""
    apps = config.model_apps()
    if len(apps) == 1:
        return [(engine_group(app_name), apps[0])]
    return [(engine_group(app_name, app.model_name), app) for app in apps]


def max_engine_replicas(config: AppConfig) -> int:
    autoscaling = config.serve.engine_autoscaling
    return autoscaling.max_replicas if autoscaling is not None else config.serve.engine_replicas


def existing_engines(config: AppConfig, app_name: str) -> list[Any]:
    """The scheduler actors of every model of the application that exist now."""
    engines = []
    for group, app in engine_groups(config, app_name):
        for index in range(max_engine_replicas(app)):
            try:
                engines.append(engine_handle(group, index))
            except ValueError:
                continue
    return engines


def attach_engine(client: EngineClient, wanted: EngineConfig) -> EngineInfo:
    """Adopt the client's engine by name (blocking). One running another config (a redeploy) is replaced; one that
    is ending (its last ingress just left) is waited out and created anew."""
    deadline = time.monotonic() + ENGINE_READY_TIMEOUT_S
    while True:
        try:
            info = ray.get(client.engine.attach.remote(client.client_id), timeout=ENGINE_READY_TIMEOUT_S)
            if info.engine_config == wanted:
                return info
            logger.warning("the running engine has another config; replacing it")
            ray.kill(client.engine)
        except (ray.exceptions.RayActorError, EngineDrainingError) as error:
            logger.warning("engine not available (%s); creating it again", short_reason(error))
        if time.monotonic() > deadline:
            raise TimeoutError(f"no engine within {ENGINE_READY_TIMEOUT_S:.0f} s")
        # A killed actor's name is freed a moment after it dies.
        time.sleep(0.2)
        client.engine = client.create_engine()


def attach_engines(clients: Sequence[EngineClient], wanted: EngineConfig) -> EngineInfo:
    """Attach every engine replica; requests are validated against the strictest (replicas may differ in KV
    capacity)."""
    infos = [attach_engine(client, wanted) for client in clients]
    return min(infos, key=lambda info: info.max_model_len)


async def detach_engines(clients: Sequence[EngineClient]) -> None:
    """Leave every engine replica, so the last ingress replica to go ends the engines, workers and placement
    groups."""
    for client in clients:
        try:
            await asyncio.wait_for(client.engine.detach.remote(client.client_id), DETACH_TIMEOUT_S)
        except ray.exceptions.RayActorError:
            pass  # the engine already ended (it may end before its answer to the last detach arrives)
        except Exception as error:
            logger.warning("detaching from the engine failed: %s", short_reason(error))
