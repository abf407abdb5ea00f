"""Executors run a StepPlan on the model workers: in-process, or on Ray worker actors (TP x PP)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import pickle
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from configs.engine_config import EngineConfig
from configs.sections import ParallelConfig
from executor.errors import EngineDeadError, short_reason
from executor.step_channel import StepChannel
from executor.worker import ModelWorker
from model_executor.hub import hub_environment
from model_executor.model_info import ModelInfo
from model_executor.step_plan import StepPlan, StepResult

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0
# A placement still waiting says what it waits for this often (to on_placement_wait).
PLACEMENT_POLL_S = 2.0
HEALTH_TIMEOUT_S = 30.0
# After a worker fails, how long to ask Ray about it (a dead actor answers at once, and so learns its node's fate).
FAILURE_PROBE_S = 2.0


def default_threads_per_worker(config: EngineConfig) -> int:
    if config.parallel.num_threads:
        return config.parallel.num_threads
    return max(1, (os.cpu_count() or 1) // config.world_size)


def embedded_ray_num_cpus(parallel: ParallelConfig, other_num_cpus: float = 0.0) -> int:
    """Logical CPUs for a Ray this process starts: every worker bundle (and `other_num_cpus` for other actors, such
    as the server's ingress) fits however few cores the machine has; each worker sets its torch threads apart."""
    needed = parallel.worker_num_cpus * parallel.world_size + other_num_cpus
    return max(math.ceil(needed) + 2, os.cpu_count() or 1)


def start_ray_for_workers(config: EngineConfig) -> bool:
    """Connect to RAY_ADDRESS, or start a local Ray sized for the config's workers, unless Ray is already up (the
    server's scheduler actor, a user's `ray.init()`); True when this call started Ray."""
    import ray

    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    if address:
        logger.info("attaching to the Ray cluster at %s", address)
        ray.init(address=address)
        return False
    num_cpus = embedded_ray_num_cpus(config.parallel)
    logger.info("starting a local Ray with %d logical CPUs for %d model workers", num_cpus, config.world_size)
    # "local": a new Ray of our size, never a head that some `ray start` left running (set RAY_ADDRESS for that).
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)
    return True


def dead_node_ids() -> set[str]:
    """Ids of the nodes Ray reports dead (a removed node, one that failed its health checks); none when Ray cannot
    say (only error messages use this)."""
    import ray

    try:
        return {node["NodeID"] for node in ray.nodes() if not node["Alive"]}
    except Exception as error:
        logger.warning("could not read Ray's node table: %s", short_reason(error))
        return set()


def free_resources_summary() -> str:
    """What the cluster could still place a bundle on: its free CPUs, GPUs and custom resources, and live nodes."""
    import ray

    free = {
        name: amount
        for name, amount in sorted(ray.available_resources().items())
        # A placement group's own bundles show as resources of their own: not room for another.
        if not name.startswith(("node:", "bundle_group_")) and name not in ("memory", "object_store_memory")
    }
    num_alive = sum(1 for node in ray.nodes() if node["Alive"])
    return f"free now: {free or 'nothing'} on {num_alive} live node{'s' if num_alive != 1 else ''}"


class Executor(ABC):
    num_kv_blocks: int

    @abstractmethod
    def execute(self, plan: StepPlan) -> StepResult: ...

    def submit(self, plan: StepPlan) -> asyncio.Future:
        """Start the step and return at once (inside a running event loop); the future resolves to its result."""
        return asyncio.ensure_future(asyncio.to_thread(self.execute, plan))

    @abstractmethod
    def check_health(self) -> None:
        """Raise EngineDeadError when a worker is gone."""

    async def check_health_async(self) -> None:
        self.check_health()

    async def open_step_channels(self) -> None:
        """Send steps to the workers over sockets of their own from now on, where the workers are actors."""
        return

    def worker_handles(self) -> list:
        """The model worker actors; none when the model runs in this process."""
        return []

    @property
    def placement_group_id(self) -> str | None:
        return None

    @abstractmethod
    def shutdown(self) -> None:
        """Release workers and their resources."""


class UniProcExecutor(Executor):
    """The model in this process: offline use with TP = PP = 1."""

    def __init__(self, config: EngineConfig, model_info: ModelInfo, show_progress: bool = True):
        self.worker = ModelWorker(model_info, config, 0, 0, default_threads_per_worker(config))
        budget_blocks = self.worker.load_model(show_progress=show_progress)
        self.num_kv_blocks = config.cache.num_kv_blocks or budget_blocks
        self.worker.allocate_kv_cache(self.num_kv_blocks)

    def execute(self, plan: StepPlan) -> StepResult:
        return self.worker.execute(plan)

    def check_health(self) -> None:
        """In-process: a failing forward raises in the caller; nothing can die separately."""

    def shutdown(self) -> None:
        self.worker.runner = None


class RayExecutor(Executor):
    """One Ray actor per (pp_rank, tp_rank) in a placement group; the plan goes to every rank each step.

    The placement group's strategy is `parallel.placement_strategy` (Ray's names: STRICT_PACK keeps every rank on
    one node, SPREAD / STRICT_SPREAD put them on different nodes)."""

    def __init__(
        self,
        config: EngineConfig,
        model_info: ModelInfo,
        placement_timeout_s: float | None = PLACEMENT_TIMEOUT_S,
        on_placement_wait: Callable[[str], None] | None = None,
    ):
        """`placement_timeout_s`: how long to wait for the cluster to place the worker bundles (None: until it
        can, e.g. a node joins). `on_placement_wait(status)` runs every PLACEMENT_POLL_S while they wait, with what
        is missing; it may raise to give up."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        start_ray_for_workers(config)
        self.config = config
        self.step_channels: list[StepChannel] = []
        # Where each worker runs (ModelWorker.identity: ranks, pid, node id and IP), in worker order.
        self.worker_identities: list[dict[str, Any]] = []
        use_gpu = model_info.device == "cuda"
        bundle = {"CPU": config.parallel.worker_num_cpus, **({"GPU": 1.0} if use_gpu else {})}
        self.placement_group = self._reserve_bundles(bundle, placement_timeout_s, on_placement_wait)
        threads = default_threads_per_worker(config)
        worker_class = ray.remote(ModelWorker)
        runtime_env = {"env_vars": worker_environment()}
        self.workers = []
        for pp_rank in range(config.parallel.pipeline_parallel_size):
            for tp_rank in range(config.parallel.tensor_parallel_size):
                bundle_index = pp_rank * config.parallel.tensor_parallel_size + tp_rank
                self.workers.append(
                    worker_class.options(
                        num_cpus=config.parallel.worker_num_cpus,
                        num_gpus=1 if use_gpu else 0,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, bundle_index),
                        name=None,
                        runtime_env=runtime_env,
                    ).remote(model_info, config, pp_rank, tp_rank, threads, compute_thread=True)
                )
        # The last stage's first TP rank samples and returns the step's tokens.
        self.driver_index = (config.parallel.pipeline_parallel_size - 1) * config.parallel.tensor_parallel_size
        try:
            if config.world_size > 1:
                address, port = ray.get(self.workers[0].address_and_free_port.remote())
                ray.get([worker.init_distributed.remote(address, port) for worker in self.workers])
            budget_blocks = ray.get([worker.load_model.remote() for worker in self.workers])
            self.num_kv_blocks = config.cache.num_kv_blocks or min(budget_blocks)
            ray.get([worker.allocate_kv_cache.remote(self.num_kv_blocks) for worker in self.workers])
            ray.get([worker.freeze_startup_heap.remote() for worker in self.workers])
            self.worker_identities = ray.get([worker.identity.remote() for worker in self.workers])
        except Exception:
            self.shutdown()
            raise
        logger.info(
            "%d model workers up (TP=%d, PP=%d, %d threads each, %s on %d node(s)), %d KV blocks",
            config.world_size,
            config.parallel.tensor_parallel_size,
            config.parallel.pipeline_parallel_size,
            threads,
            config.parallel.placement_strategy,
            len({identity["node_id"] for identity in self.worker_identities}),
            self.num_kv_blocks,
        )

    def _reserve_bundles(
        self, bundle: dict[str, float], timeout_s: float | None, on_wait: Callable[[str], None] | None
    ) -> Any:
        """A ready placement group of one bundle per worker; removed again if the wait fails or is given up."""
        import ray
        from ray.util.placement_group import placement_group

        world_size, strategy = self.config.world_size, self.config.parallel.placement_strategy
        group = placement_group([bundle] * world_size, strategy=strategy)
        demand = f"{world_size} worker bundle{'s' if world_size != 1 else ''} of {bundle} ({strategy})"
        started = time.monotonic()
        try:
            while True:
                try:
                    ray.get(group.ready(), timeout=PLACEMENT_POLL_S)
                    return group
                except ray.exceptions.GetTimeoutError:
                    waited = time.monotonic() - started
                if timeout_s is not None and waited >= timeout_s:
                    raise RuntimeError(
                        f"could not reserve {demand} within {timeout_s:.0f}s; {free_resources_summary()}"
                    )
                if on_wait is not None:
                    on_wait(f"waiting {waited:.0f}s for the cluster to place {demand}; {free_resources_summary()}")
        except BaseException:
            ray.util.remove_placement_group(group)
            raise

    def worker_label(self, index: int) -> str:
        """`model worker pp0-tp1 on node 1a2b3c4d5e6f (10.0.0.7)`: which rank, and where it ran."""
        tp_size = self.config.parallel.tensor_parallel_size
        label = f"model worker pp{index // tp_size}-tp{index % tp_size}"
        identity = self.worker_identities[index] if index < len(self.worker_identities) else {}
        if identity.get("node_id"):
            label += f" on node {identity['node_id'][:12]} ({identity.get('node_ip')})"
        return label

    @staticmethod
    def _failed_ref_index(refs: Sequence[Any]) -> int | None:
        """The first of the step's calls that has failed by now (a Ray error names no actor when its node died)."""
        import ray

        for index, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.GetTimeoutError:
                continue
            except Exception:
                return index
        return None

    def _worker_failure(self, index: int | None, error: BaseException, lost_nodes: set[str]) -> EngineDeadError:
        """EngineDeadError naming the failed worker and its node, first, and saying whether Ray lost that node."""
        import ray

        if isinstance(error, ray.exceptions.ActorUnavailableError):
            # Ray's text is an RPC error; what it means: the process cannot be reached (yet not declared dead).
            reason = "its actor is unreachable"
        else:
            reason = short_reason(error)
        if index is None:
            return EngineDeadError(f"model worker failed: {reason}")
        node_id = (self.worker_identities[index] if index < len(self.worker_identities) else {}).get("node_id")
        if node_id in lost_nodes:
            tp_size = self.config.parallel.tensor_parallel_size
            ip = self.worker_identities[index].get("node_ip")
            return EngineDeadError(
                f"model worker pp{index // tp_size}-tp{index % tp_size} lost with its node {node_id[:12]} ({ip}), "
                f"which Ray reports dead: {reason}"
            )
        return EngineDeadError(f"{self.worker_label(index)} failed: {reason}")

    async def _describe_failure(self, index: int | None, error: BaseException) -> EngineDeadError:
        """What a failed step or health check tells the engine's users: which worker, on which node, and whether
        the node is gone. Asks Ray briefly (FAILURE_PROBE_S at most per question)."""
        if index is not None:
            # A dead actor's call fails at once; the answer comes after Ray recorded why (its node died).
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.workers[index].ping.remote(), FAILURE_PROBE_S)
        lost_nodes: set[str] = set()
        with contextlib.suppress(TimeoutError):
            lost_nodes = await asyncio.wait_for(asyncio.to_thread(dead_node_ids), FAILURE_PROBE_S)
        return self._worker_failure(index, error, lost_nodes)

    async def open_step_channels(self) -> None:
        """From now on `submit` sends each plan over a socket per worker instead of an actor call (call on the event
        loop that submits; `execute` is then refused: a step must never run on two threads of a worker at once)."""
        addresses = await asyncio.gather(*[worker.open_step_channel.remote() for worker in self.workers])
        self.step_channels = [
            await StepChannel.connect(host, port, secret, f"model worker {index}")
            for index, (host, port, secret) in enumerate(addresses)
        ]

    def worker_handles(self) -> list:
        return list(self.workers)

    @property
    def placement_group_id(self) -> str | None:
        return self.placement_group.id.hex() if self.placement_group is not None else None

    def _submit(self, plan: StepPlan) -> list:
        import ray

        plan_ref = ray.put(plan) if len(self.workers) > 1 else plan
        return [worker.execute.remote(plan_ref) for worker in self.workers]

    def execute(self, plan: StepPlan) -> StepResult:
        import ray

        if self.step_channels:
            raise RuntimeError("this executor's steps go over its step channels: use submit")
        step_refs = self._submit(plan)
        try:
            return ray.get(step_refs)[self.driver_index]
        except ray.exceptions.RayError as error:
            raise self._worker_failure(self._failed_ref_index(step_refs), error, dead_node_ids()) from error

    def submit(self, plan: StepPlan) -> asyncio.Future:
        """The workers get the step now, queued behind any step still running (a channel, or an actor, runs them
        in order)."""
        if self.step_channels:
            payload = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
            replies = [channel.send(payload) for channel in self.step_channels]
            return asyncio.ensure_future(self._channel_result(replies))
        return asyncio.ensure_future(self._driver_result(self._submit(plan)))

    async def _channel_result(self, replies: list[asyncio.Future]) -> StepResult:
        if len(replies) == 1:
            # One worker (no parallelism): its reply is the step's, without asyncio.wait's per-step bookkeeping.
            try:
                return await replies[0]
            except Exception as failure:
                raise await self._describe_failure(0, failure) from failure
        return await self._first_failure_or_result(replies)

    async def _first_failure_or_result(self, replies: Sequence[asyncio.Future]) -> StepResult:
        """The driver rank's reply, or the first failure, named: the other ranks may be waiting for the failed
        one in a collective."""
        done, pending = await asyncio.wait(replies, return_when=asyncio.FIRST_EXCEPTION)
        for reply in pending:
            # The ranks left waiting fail too once the step is abandoned: their errors are this one's echo.
            reply.add_done_callback(lambda late: late.cancelled() or late.exception())
        for index, reply in enumerate(replies):
            if reply in done and reply.exception() is not None:
                failure = reply.exception()
                raise await self._describe_failure(index, failure) from failure
        return replies[self.driver_index].result()

    async def _driver_result(self, step_refs: list) -> StepResult:
        return await self._first_failure_or_result([asyncio.ensure_future(ref) for ref in step_refs])

    def check_health(self) -> None:
        import ray

        pings = [worker.ping.remote() for worker in self.workers]
        for index, ping in enumerate(pings):
            try:
                ray.get(ping, timeout=HEALTH_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError as error:
                raise EngineDeadError(
                    f"{self.worker_label(index)} did not answer a health check within {HEALTH_TIMEOUT_S:.0f}s"
                ) from error
            except ray.exceptions.RayError as error:
                raise self._worker_failure(index, error, dead_node_ids()) from error

    async def check_health_async(self) -> None:
        """Every worker answers a ping within HEALTH_TIMEOUT_S, or EngineDeadError names the first that did not."""
        pings = [asyncio.ensure_future(worker.ping.remote()) for worker in self.workers]
        done, pending = await asyncio.wait(pings, timeout=HEALTH_TIMEOUT_S, return_when=asyncio.FIRST_EXCEPTION)
        for index, ping in enumerate(pings):
            if ping in done and ping.exception() is not None:
                for other in pending:
                    other.cancel()
                failure = ping.exception()
                raise await self._describe_failure(index, failure) from failure
        if pending:
            index = next(index for index, ping in enumerate(pings) if ping in pending)
            for ping in pending:
                ping.cancel()
            raise EngineDeadError(
                f"{self.worker_label(index)} did not answer a health check within {HEALTH_TIMEOUT_S:.0f}s"
            )

    def shutdown(self) -> None:
        import ray

        for channel in getattr(self, "step_channels", []):
            channel.close()
        self.step_channels = []
        for worker in getattr(self, "workers", []):
            ray.kill(worker)
        self.workers = []
        if getattr(self, "placement_group", None) is not None:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None


# OpenMP's idle-thread behaviour, chosen where the cluster is launched.
OMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def worker_environment() -> dict[str, str]:
    """Variables the model workers' processes start with. A raylet on another node has its own environment: the
    hub's token, cache and offline switch go along, and the OpenMP wait settings chosen here."""
    # libgomp's own default (spin a while, then sleep) unless the user chose: a passive policy's futex wake-up at
    # every parallel region costs a step more than its spin takes from the serving processes.
    omp_settings = {name: os.environ[name] for name in OMP_WAIT_VARS if name in os.environ}
    return {**hub_environment(), **omp_settings}


def make_executor(config: EngineConfig, model_info: ModelInfo, show_progress: bool = True) -> Executor:
    kind = config.parallel.distributed_executor
    if kind == "auto":
        kind = "uniproc" if config.world_size == 1 else "ray"
    if kind == "uniproc":
        if config.world_size > 1:
            raise ValueError("tensor/pipeline parallelism needs distributed_executor 'ray'")
        return UniProcExecutor(config, model_info, show_progress)
    return RayExecutor(config, model_info)
