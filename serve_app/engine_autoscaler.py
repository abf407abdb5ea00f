"""Engine replicas that follow load: one autoscaler actor per served model decides how many scheduler actors run,
starts them, and drains and stops the ones no longer needed; the ingress replicas report their load to it and
route over the replicas it publishes.

Why our own controller rather than Serve's autoscaler: an engine replica is a detached scheduler actor with its own
placement group of workers, adopted by name by every ingress replica, streaming outputs over its own channel and
routed to by prompt prefix; as a Serve deployment it would lose the per-replica routing and the output channel.
The signal and policy are Serve's own (`target_ongoing_requests`, upscale/downscale delays): requests in flight,
counted by the ingress replicas, including those waiting for an engine (the only signal there is at zero replicas,
and one that sees a queue building in the engine, which KV usage alone does not).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import ray

from configs.app_config import AppConfig, EngineAutoscalingConfig
from executor.engine_actor import background_task
from executor.errors import short_reason
from executor.outputs import EngineInfo
from serve_app.engines import (
    ENGINE_NAMESPACE,
    ENGINE_ORPHAN_TIMEOUT_S,
    ENGINE_READY_TIMEOUT_S,
    engine_actor_name,
    get_or_create_engine,
)

logger = logging.getLogger(__name__)

CONTROL_PERIOD_S = 0.25
# Ingress replicas report this often; the autoscaler sees a silent one as gone after ENGINE_ORPHAN_TIMEOUT_S.
REPORT_PERIOD_S = 0.5
ENGINE_PING_PERIOD_S = 5.0
RAY_CALL_TIMEOUT_S = 10.0
# An ingress that does not confirm a membership change this long after it is published is not waited for.
ACK_TIMEOUT_S = 10.0
# A draining replica still holding requests after this long is stopped anyway (they end with an error).
DRAIN_TIMEOUT_S = 600.0
START_RETRY_S = 2.0

ReplicaState = Literal["starting", "running", "draining", "stopping"]


def autoscaler_actor_name(group: str) -> str:
    return f"{group}-engine-autoscaler"


def get_or_create_autoscaler(config: AppConfig, group: str) -> Any:
    """The engine group's autoscaler actor; its first ingress replica creates it, the others find it by name."""
    return (
        ray.remote(EngineAutoscaler)
        .options(
            name=autoscaler_actor_name(group),
            namespace=ENGINE_NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            num_cpus=0,
            # On the head node: a node the Ray autoscaler sees idle (its actors hold no resources) can be removed.
            resources={"node:__internal_head__": 0.001},
            scheduling_strategy="DEFAULT",
            max_concurrency=1_000,
        )
        .remote(config.model_dump(), group)
    )


@dataclass(frozen=True)
class EngineMembership:
    """What ingress replicas route over: the replicas that take requests, those finishing theirs, and the target."""

    version: int
    running: dict[int, Any]
    draining: dict[int, Any]
    num_starting: int
    target: int
    engine_info: EngineInfo | None
    start_error: str | None


@dataclass
class IngressReport:
    seen_version: int = -1
    ongoing: int = 0
    in_flight_by_index: dict[int, int] = field(default_factory=dict)
    heard_at: float = field(default_factory=time.monotonic)


@dataclass
class EngineReplica:
    index: int
    state: ReplicaState
    since: float
    # The membership version that published the current state (ingress replicas confirm they have seen it).
    version: int = 0
    handle: Any = None
    task: asyncio.Task | None = None


class ScalingDecider:
    """Ray Serve's policy over engine replicas: the count that keeps `target_ongoing_requests` per replica, moved
    to only after the load asked for it for the upscale (or downscale) delay; from zero at once."""

    def __init__(self, config: EngineAutoscalingConfig):
        self.config = config
        self.upscale_since: float | None = None
        self.downscale_since: float | None = None

    def desired(self, ongoing: int) -> int:
        wanted = math.ceil(ongoing / self.config.target_ongoing_requests) if ongoing > 0 else 0
        return min(max(wanted, self.config.min_replicas), self.config.max_replicas)

    def target(self, ongoing: int, current: int, now: float) -> int:
        desired = self.desired(ongoing)
        if desired > current:
            self.downscale_since = None
            if current == 0:
                return desired  # requests are waiting for a first replica
            self.upscale_since = self.upscale_since if self.upscale_since is not None else now
            if now - self.upscale_since >= self.config.upscale_delay_s:
                self.upscale_since = None
                return desired
        elif desired < current:
            self.upscale_since = None
            delay = self.config.downscale_delay_s
            if desired == 0 and self.config.downscale_to_zero_delay_s is not None:
                delay = self.config.downscale_to_zero_delay_s
            self.downscale_since = self.downscale_since if self.downscale_since is not None else now
            if now - self.downscale_since >= delay:
                self.downscale_since = None
                return desired
        else:
            self.upscale_since = self.downscale_since = None
        return current


class EngineAutoscaler:
    """The engine replicas of one served model, between min_replicas and max_replicas (a Ray actor, detached, named
    after the engine group). It attaches to every engine as a client of its own and pings them, so an engine lives
    as long as the autoscaler wants it; it stops them all and ends when its last ingress replica leaves."""

    def __init__(self, config: dict[str, Any], group: str):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.group = group
        self.client_id = f"autoscaler-{uuid.uuid4().hex}"
        self.replicas: dict[int, EngineReplica] = {}
        self.ingresses: dict[str, IngressReport] = {}
        self.version = 0
        self.engine_info: EngineInfo | None = None
        self.start_error: str | None = None
        self.retry_start_at = 0.0
        self.last_ping = 0.0
        self.target = 0
        self.loop_task: asyncio.Task | None = None
        self._configure(AppConfig.model_validate(config))

    def _configure(self, config: AppConfig) -> None:
        self.config = config
        self.engine_config = config.engine_config()
        autoscaling = config.serve.engine_autoscaling
        if autoscaling is None:
            raise ValueError("the engine autoscaler needs serve.engine_autoscaling")
        self.autoscaling = autoscaling
        self.decider = ScalingDecider(autoscaling)
        initial = autoscaling.initial_replicas if autoscaling.initial_replicas is not None else autoscaling.min_replicas
        # An ingress validates requests by the engine's limits (context length, vocabulary): one replica starts even
        # at zero, to learn them, and idles down after downscale_to_zero_delay_s.
        self.target = max(initial, 1)

    # The ingress replicas' side.

    async def attach(self, ingress_id: str, config: dict[str, Any]) -> EngineMembership:
        """An ingress replica joins; a different config (a redeploy) replaces every engine replica. Returns once
        the engine's limits are known (a first replica answered)."""
        wanted = AppConfig.model_validate(config)
        if wanted.engine_config() != self.engine_config or wanted.serve.engine_autoscaling != self.autoscaling:
            logger.warning("%s: the app's config changed; replacing its engine replicas", self.group)
            await asyncio.gather(*(self._stop(replica) for replica in list(self.replicas.values())))
            self.engine_info = None
            self._configure(wanted)
        self.ingresses[ingress_id] = IngressReport()
        self._ensure_loop()
        deadline = time.monotonic() + ENGINE_READY_TIMEOUT_S
        while self.engine_info is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no engine replica of {self.group} started: {self.start_error}")
            await asyncio.sleep(0.1)
        return self.membership()

    async def report(
        self, ingress_id: str, seen_version: int, ongoing: int, in_flight_by_index: dict[int, int]
    ) -> EngineMembership:
        """An ingress replica's load and the membership version it routes by; answers the membership now."""
        self.ingresses[ingress_id] = IngressReport(seen_version, ongoing, in_flight_by_index)
        self._ensure_loop()
        return self.membership()

    async def detach(self, ingress_id: str) -> None:
        """An ingress replica leaves; the last one to leave stops the engines and ends the autoscaler."""
        self.ingresses.pop(ingress_id, None)
        if not self.ingresses:
            background_task(self._shutdown("its last ingress replica left"))

    def membership(self) -> EngineMembership:
        by_state: dict[str, dict[int, Any]] = {"running": {}, "draining": {}}
        for replica in self.replicas.values():
            if replica.state in by_state:
                by_state[replica.state][replica.index] = replica.handle
        return EngineMembership(
            version=self.version,
            running=by_state["running"],
            draining=by_state["draining"],
            num_starting=sum(replica.state == "starting" for replica in self.replicas.values()),
            target=self.target,
            engine_info=self.engine_info,
            start_error=self.start_error,
        )

    # The control loop.

    def _ensure_loop(self) -> None:
        if self.loop_task is None or self.loop_task.done():
            self.loop_task = background_task(self._control_loop())

    async def _control_loop(self) -> None:
        while True:
            try:
                if await self._step(time.monotonic()):
                    return
            except Exception:
                logger.exception("%s: autoscaler step failed", self.group)
            await asyncio.sleep(CONTROL_PERIOD_S)

    async def _step(self, now: float) -> bool:
        """One decision; True once the autoscaler has shut down."""
        for ingress_id, report in list(self.ingresses.items()):
            if now - report.heard_at > ENGINE_ORPHAN_TIMEOUT_S:
                logger.warning("%s: ingress replica %s fell silent; forgetting it", self.group, ingress_id)
                del self.ingresses[ingress_id]
        if not self.ingresses:
            await self._shutdown("no ingress replica is left")
            return True
        if now - self.last_ping > ENGINE_PING_PERIOD_S:
            self.last_ping = now
            await self._ping_engines()
        active = [replica for replica in self.replicas.values() if replica.state in ("starting", "running")]
        ongoing = sum(report.ongoing for report in self.ingresses.values())
        if self.engine_info is not None:  # the first replica, started to learn the limits, counts as the load's
            self.target = self.decider.target(ongoing, len(active), now)
        if self.target > len(active) and now >= self.retry_start_at:
            for _ in range(self.target - len(active)):
                self._start(self._free_index(), now)
        elif self.target < len(active):
            # Replicas still starting go first, then the highest indices (prefix routing keeps the low ones).
            victims = sorted(active, key=lambda replica: (replica.state == "running", -replica.index))
            for replica in victims[: len(active) - self.target]:
                self._begin_drain(replica, now)
        for replica in list(self.replicas.values()):
            if replica.state == "draining" and await self._drained(replica, now):
                replica.state, replica.since = "stopping", now
                self._publish(replica)
            elif replica.state == "stopping" and self._confirmed(replica, now):
                await self._stop(replica)
        return False

    def _free_index(self) -> int:
        index = 0
        while index in self.replicas:
            index += 1
        return index

    def _publish(self, replica: EngineReplica) -> None:
        self.version += 1
        replica.version = self.version

    def _confirmed(self, replica: EngineReplica, now: float) -> bool:
        """Every ingress replica routes by a membership that shows the replica's current state."""
        if now - replica.since > ACK_TIMEOUT_S:
            return True
        return all(report.seen_version >= replica.version for report in self.ingresses.values())

    def _start(self, index: int, now: float) -> None:
        replica = EngineReplica(index, "starting", now)
        self.replicas[index] = replica
        replica.task = background_task(self._run_start(replica))

    async def _run_start(self, replica: EngineReplica) -> None:
        try:
            while True:
                handle = await asyncio.to_thread(get_or_create_engine, self.config, self.group, replica.index)
                info = await asyncio.wait_for(handle.attach.remote(self.client_id), ENGINE_READY_TIMEOUT_S)
                if info.engine_config == self.engine_config:
                    break
                # Left by an earlier config of the app under the same name.
                ray.kill(handle, no_restart=True)
                await asyncio.sleep(0.2)
        except Exception as error:
            self.start_error = f"{type(error).__name__}: {short_reason(error)}"
            logger.error("%s: engine replica %d did not start: %s", self.group, replica.index, self.start_error)
            self.replicas.pop(replica.index, None)
            self.retry_start_at = time.monotonic() + START_RETRY_S
            return
        if self.replicas.get(replica.index) is not replica or replica.state != "starting":
            await self._kill(handle)  # scaled down (or replaced) while it started
            return
        if self.engine_config.lora.enable_lora:
            await self._copy_adapters(handle)
        replica.handle, replica.state, replica.since = handle, "running", time.monotonic()
        self.engine_info = self.engine_info or info
        self.start_error = None
        self._publish(replica)
        logger.info(
            "%s: engine replica %d running (%d running, target %d)",
            self.group,
            replica.index,
            sum(other.state == "running" for other in self.replicas.values()),
            self.target,
        )

    async def _copy_adapters(self, handle: Any) -> None:
        """A new replica gets the LoRA adapters loaded at run time into the running ones (those of the config it
        loads itself), so a request for one finds it on every replica."""
        running = [replica.handle for replica in self.replicas.values() if replica.state == "running"]
        if not running:
            return
        try:
            wanted = await asyncio.wait_for(running[0].list_loras.remote(), RAY_CALL_TIMEOUT_S)
            present = {adapter["name"] for adapter in await handle.list_loras.remote()}
            for adapter in wanted:
                if adapter["name"] not in present:
                    await handle.add_lora.remote(adapter["name"], adapter["path"], adapter["base_model_name"])
        except Exception as error:
            logger.error("%s: copying LoRA adapters to a new replica failed: %s", self.group, short_reason(error))

    def _begin_drain(self, replica: EngineReplica, now: float) -> None:
        if replica.state == "starting":
            # Its start task sees the state change and stops the engine once it is up.
            self.replicas.pop(replica.index, None)
            replica.state = "stopping"
            return
        replica.state, replica.since = "draining", now
        self._publish(replica)
        logger.info("%s: draining engine replica %d (target %d)", self.group, replica.index, self.target)

    async def _drained(self, replica: EngineReplica, now: float) -> bool:
        """No ingress routes to the replica any more and nothing of theirs is left in it."""
        if now - replica.since > DRAIN_TIMEOUT_S:
            logger.warning(
                "%s: engine replica %d still busy after draining %.0f s; stopping it",
                self.group,
                replica.index,
                DRAIN_TIMEOUT_S,
            )
            return True
        if not self._confirmed(replica, now):
            return False
        if any(report.in_flight_by_index.get(replica.index, 0) for report in self.ingresses.values()):
            return False
        try:
            stats = await asyncio.wait_for(replica.handle.stats.remote(), RAY_CALL_TIMEOUT_S)
        except Exception:
            return True  # gone already
        return stats.num_tracked_requests == 0

    async def _stop(self, replica: EngineReplica) -> None:
        self.replicas.pop(replica.index, None)
        replica.state = "stopping"
        if replica.handle is not None:
            await self._kill(replica.handle)
            logger.info("%s: engine replica %d stopped (target %d)", self.group, replica.index, self.target)

    async def _kill(self, handle: Any) -> None:
        try:
            await asyncio.wait_for(handle.shutdown.remote(), RAY_CALL_TIMEOUT_S)
        except Exception as error:
            logger.warning("%s: engine shutdown failed: %s", self.group, short_reason(error))
        ray.kill(handle, no_restart=True)

    async def _ping_engines(self) -> None:
        """Keeps the engines from ending as orphans, and forgets the ones that died (the loop starts others)."""
        running = [replica for replica in self.replicas.values() if replica.state in ("running", "draining")]
        results = await asyncio.gather(
            *(asyncio.wait_for(replica.handle.ping.remote(self.client_id), RAY_CALL_TIMEOUT_S) for replica in running),
            return_exceptions=True,
        )
        for replica, result in zip(running, results):
            if isinstance(result, ray.exceptions.RayActorError):
                logger.error("%s: engine replica %d died: %s", self.group, replica.index, short_reason(result))
                self.replicas.pop(replica.index, None)
                self.version += 1

    async def _shutdown(self, reason: str) -> None:
        logger.info("%s: stopping every engine replica and the autoscaler: %s", self.group, reason)
        if self.loop_task is not None and self.loop_task is not asyncio.current_task():
            self.loop_task.cancel()
        await asyncio.gather(*(self._stop(replica) for replica in list(self.replicas.values())))
        # Its name frees for the next deployment's autoscaler.
        ray.kill(ray.get_runtime_context().current_actor)

    async def engine_names(self) -> list[str]:
        """The engine actors it runs now (operators and tests)."""
        return [engine_actor_name(self.group, index) for index in sorted(self.replicas)]
