"""The engine replicas of one served model as an ingress replica sees them: a fixed set (`serve.engine_replicas`),
or the set an autoscaler publishes (`serve.engine_autoscaling`), with the same questions asked of both: which
replicas take requests now, which hold requests of ours, and wait until one takes requests."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import ray

from configs.app_config import AppConfig
from executor.engine_actor import background_task
from executor.errors import EngineDeadError, short_reason
from executor.outputs import EngineInfo
from serve_app.engine_autoscaler import REPORT_PERIOD_S, EngineMembership, get_or_create_autoscaler
from serve_app.engine_client import EngineClient
from serve_app.engines import (
    ENGINE_READY_TIMEOUT_S,
    attach_engines,
    detach_engines,
    engine_creators,
)

logger = logging.getLogger(__name__)

RAY_CALL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ReplicaCounts:
    running: int
    starting: int
    draining: int
    target: int


def replica_exposition(counts_by_model: dict[str, ReplicaCounts]) -> bytes:
    """Every model's engine replica counts as Prometheus gauges."""
    lines = [
        "# HELP pagedserve:engine_replicas Engine replicas (scheduler actor + workers) of a model, by state.",
        "# TYPE pagedserve:engine_replicas gauge",
    ]
    for model_name, counts in counts_by_model.items():
        for state in ("running", "starting", "draining"):
            lines.append(
                f'pagedserve:engine_replicas{{model_name="{model_name}",state="{state}"}} {getattr(counts, state)}'
            )
    lines += [
        "# HELP pagedserve:engine_replicas_target Engine replicas the autoscaler aims for (else the fixed count).",
        "# TYPE pagedserve:engine_replicas_target gauge",
    ]
    lines += [
        f'pagedserve:engine_replicas_target{{model_name="{name}"}} {c.target}' for name, c in counts_by_model.items()
    ]
    return ("\n".join(lines) + "\n").encode()


class StaticEngines:
    """`serve.engine_replicas` scheduler actors, created or adopted by name; a dead one is re-created by its client."""

    def __init__(self, config: AppConfig, group: str):
        engine_config = config.engine_config()
        self.clients = [
            EngineClient(create(), create, engine_config.runtime.transport, replica_index=index)
            for index, create in enumerate(engine_creators(config, group))
        ]
        self.engine_info: EngineInfo = attach_engines(self.clients, engine_config)

    def routable(self) -> list[EngineClient]:
        return self.clients

    def all_clients(self) -> list[EngineClient]:
        return self.clients

    async def wait_for_engine(self) -> list[EngineClient]:
        return self.clients

    def ensure_running(self) -> None:
        pass

    def replica_counts(self) -> ReplicaCounts:
        return ReplicaCounts(len(self.clients), 0, 0, len(self.clients))

    async def close(self) -> None:
        await detach_engines(self.clients)


class AutoscaledEngines:
    """The replicas an engine group's autoscaler runs: this ingress reports its load to it every REPORT_PERIOD_S
    and routes over the replicas it publishes (draining ones keep only the requests they hold)."""

    def __init__(self, config: AppConfig, group: str, wait_timeout_s: float | None):
        """`wait_timeout_s`: how long a request waits for a replica when none runs (None: ENGINE_READY_TIMEOUT_S)."""
        self.config = config
        self.group = group
        self.model_name = config.engine_config().model_name
        self.transport = config.engine_config().runtime.transport
        self.wait_timeout_s = wait_timeout_s or ENGINE_READY_TIMEOUT_S
        self.ingress_id = f"ingress-{uuid.uuid4().hex}"
        self.clients: dict[int, EngineClient] = {}
        self.draining: set[int] = set()
        self.num_waiting = 0
        self.seen_version = -1
        self.poll_task: asyncio.Task | None = None
        self.wake: asyncio.Event | None = None
        self.controller, membership = self._attach_controller()
        self.membership = membership
        self.engine_info: EngineInfo = membership.engine_info
        for index, handle in membership.running.items():
            self.clients[index] = self._attached_client(index, handle)
        self.seen_version = membership.version

    def _attach_controller(self) -> tuple[Any, EngineMembership]:
        """The group's autoscaler (created if this is its first ingress), once it knows the engine's limits."""
        deadline = time.monotonic() + ENGINE_READY_TIMEOUT_S
        while True:
            controller = get_or_create_autoscaler(self.config, self.group)
            try:
                membership = ray.get(
                    controller.attach.remote(self.ingress_id, self.config.model_dump()), timeout=ENGINE_READY_TIMEOUT_S
                )
                return controller, membership
            except ray.exceptions.RayActorError as error:
                # An autoscaler ending (its last ingress left a moment ago): wait for its name to free.
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no engine autoscaler for {self.group}: {short_reason(error)}") from None
                time.sleep(0.2)

    def _attached_client(self, index: int, handle: Any) -> EngineClient:
        # No create_engine: the autoscaler alone starts replicas, so a dead one is never re-created behind its back.
        client = EngineClient(handle, None, self.transport, replica_index=index)
        ray.get(handle.attach.remote(client.client_id), timeout=ENGINE_READY_TIMEOUT_S)
        return client

    def routable(self) -> list[EngineClient]:
        return [client for index, client in sorted(self.clients.items()) if index not in self.draining]

    def all_clients(self) -> list[EngineClient]:
        return list(self.clients.values())

    def ensure_running(self) -> None:
        """Start reporting (from the replica's event loop: the constructor has none)."""
        if self.poll_task is None or self.poll_task.done():
            self.wake = asyncio.Event()
            self.poll_task = background_task(self._report_forever())

    async def wait_for_engine(self) -> list[EngineClient]:
        """The replicas that take requests, waiting for one to start when none runs (scale from zero)."""
        self.ensure_running()
        routable = self.routable()
        if routable:
            return routable
        self.num_waiting += 1
        try:
            logger.info(
                "no engine replica of model %s is running: the request waits up to %.0f s for one to start",
                self.model_name,
                self.wait_timeout_s,
            )
            self.wake.set()
            deadline = time.monotonic() + self.wait_timeout_s
            while not (routable := self.routable()):
                if time.monotonic() > deadline:
                    reason = (
                        f" (last start failure: {self.membership.start_error})" if self.membership.start_error else ""
                    )
                    raise EngineDeadError(
                        f"no engine replica of model {self.model_name} started within {self.wait_timeout_s:.0f} s"
                        f"{reason}"
                    )
                await asyncio.sleep(0.05)
            return routable
        finally:
            self.num_waiting -= 1

    def ongoing(self) -> int:
        return self.num_waiting + sum(client.num_in_flight for client in self.clients.values())

    async def _report_forever(self) -> None:
        while True:
            try:
                await self._report()
            except ray.exceptions.RayActorError:
                logger.warning("the engine autoscaler of %s is gone; joining its successor", self.group)
                self.controller, membership = await asyncio.to_thread(self._attach_controller)
                await self._apply(membership)
            except Exception as error:
                logger.warning("reporting to the engine autoscaler of %s failed: %s", self.group, short_reason(error))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), REPORT_PERIOD_S)
            self.wake.clear()

    async def _report(self) -> None:
        in_flight = {index: client.num_in_flight for index, client in self.clients.items() if client.num_in_flight}
        membership = await asyncio.wait_for(
            self.controller.report.remote(self.ingress_id, self.seen_version, self.ongoing(), in_flight),
            RAY_CALL_TIMEOUT_S,
        )
        await self._apply(membership)

    async def _apply(self, membership: EngineMembership) -> None:
        """Route by the published membership: attach new replicas, stop routing to draining ones, leave stopped
        ones."""
        for index, handle in membership.running.items():
            client = self.clients.get(index)
            if client is not None and client.engine._actor_id == handle._actor_id:
                continue
            client = EngineClient(handle, None, self.transport, replica_index=index)
            await asyncio.wait_for(handle.attach.remote(client.client_id), ENGINE_READY_TIMEOUT_S)
            self.clients[index] = client
        self.draining = set(membership.draining)
        gone = [index for index in self.clients if index not in membership.running and index not in membership.draining]
        await detach_engines([self.clients.pop(index) for index in gone])
        self.membership = membership
        self.seen_version = membership.version

    def replica_counts(self) -> ReplicaCounts:
        membership = self.membership
        return ReplicaCounts(
            len(membership.running), membership.num_starting, len(membership.draining), membership.target
        )

    async def close(self) -> None:
        if self.poll_task is not None:
            self.poll_task.cancel()
        await detach_engines(self.all_clients())
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.controller.detach.remote(self.ingress_id), RAY_CALL_TIMEOUT_S)
