"""Executors run a StepPlan on the model workers: in-process, or on Ray worker actors (TP x PP)."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import pickle
from abc import ABC, abstractmethod

from configs.engine_config import EngineConfig
from configs.sections import ParallelConfig
from executor.errors import EngineDeadError
from executor.step_channel import StepChannel
from executor.worker import ModelWorker
from model_executor.hub import hub_environment
from model_executor.model_info import ModelInfo
from model_executor.step_plan import StepPlan, StepResult

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0
HEALTH_TIMEOUT_S = 30.0


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
    """One Ray actor per (pp_rank, tp_rank) in a placement group; the plan goes to every rank each step."""

    def __init__(self, config: EngineConfig, model_info: ModelInfo):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        start_ray_for_workers(config)
        self.config = config
        self.step_channels: list[StepChannel] = []
        use_gpu = model_info.device == "cuda"
        bundle = {"CPU": config.parallel.worker_num_cpus, **({"GPU": 1.0} if use_gpu else {})}
        self.placement_group = placement_group(
            [bundle] * config.world_size, strategy=config.parallel.placement_strategy
        )
        try:
            ray.get(self.placement_group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError as error:
            ray.util.remove_placement_group(self.placement_group)
            raise RuntimeError(
                f"could not reserve {config.world_size} worker bundles of {bundle} "
                f"({config.parallel.placement_strategy}) "
                f"within {PLACEMENT_TIMEOUT_S:.0f}s; the cluster has {ray.available_resources()} available"
            ) from error
        threads = default_threads_per_worker(config)
        worker_class = ray.remote(ModelWorker)
        # A raylet on another node has its own environment: the hub's token, cache and offline switch go along.
        hub_env = hub_environment()
        runtime_env = {"runtime_env": {"env_vars": hub_env}} if hub_env else {}
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
                        **runtime_env,
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
        except Exception:
            self.shutdown()
            raise
        logger.info(
            "%d model workers up (TP=%d, PP=%d, %d threads each), %d KV blocks",
            config.world_size,
            config.parallel.tensor_parallel_size,
            config.parallel.pipeline_parallel_size,
            threads,
            self.num_kv_blocks,
        )

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
        try:
            return ray.get(self._submit(plan))[self.driver_index]
        except ray.exceptions.RayError as error:
            raise EngineDeadError(f"model worker failed: {error}") from error

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
                raise EngineDeadError(f"model worker failed: {failure}") from failure
        # The first failure ends the step: the other ranks may be waiting for the failed one in a collective.
        done, _ = await asyncio.wait(replies, return_when=asyncio.FIRST_EXCEPTION)
        failures = [reply.exception() for reply in done if reply.exception() is not None]
        if failures:
            raise EngineDeadError(f"model worker failed: {failures[0]}") from failures[0]
        return replies[self.driver_index].result()

    async def _driver_result(self, step_refs: list) -> StepResult:
        import ray

        try:
            return (await asyncio.gather(*step_refs))[self.driver_index]
        except ray.exceptions.RayError as error:
            raise EngineDeadError(f"model worker failed: {error}") from error

    def check_health(self) -> None:
        import ray

        try:
            ray.get([worker.ping.remote() for worker in self.workers], timeout=HEALTH_TIMEOUT_S)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as error:
            raise EngineDeadError(f"model worker unhealthy: {error}") from error

    async def check_health_async(self) -> None:
        import ray

        try:
            await asyncio.wait_for(asyncio.gather(*[worker.ping.remote() for worker in self.workers]), HEALTH_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError) as error:
            raise EngineDeadError(f"model worker unhealthy: {error!r}") from error

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


def make_executor(config: EngineConfig, model_info: ModelInfo, show_progress: bool = True) -> Executor:
    kind = config.parallel.distributed_executor
    if kind == "auto":
        kind = "uniproc" if config.world_size == 1 else "ray"
    if kind == "uniproc":
        if config.world_size > 1:
            raise ValueError("tensor/pipeline parallelism needs distributed_executor 'ray'")
        return UniProcExecutor(config, model_info, show_progress)
    return RayExecutor(config, model_info)
