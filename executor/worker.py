"""A model worker: one process per (pp_rank, tp_rank), holding its model shard and KV cache.

Plain class, wrapped with `ray.remote` by the Ray executor, so the same code runs in-process in tests of the
parallel layers and as a Ray actor in the cluster.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import queue
import socket
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from configs.engine_config import EngineConfig
from configs.sections import DEFAULT_CPU_KV_CACHE_GIB
from executor.heap import freeze_startup_heap, keep_freed_memory
from executor.step_channel import open_step_listener
from model_executor.model_fetch import resolve_configured_model
from model_executor.model_info import ModelInfo
from model_executor.model_runner import ModelRunner
from model_executor.parallel_state import ParallelContext
from model_executor.step_plan import StepPlan, StepResult

logger = logging.getLogger(__name__)


def kv_cache_memory_bytes(
    total_bytes: int,
    gpu_memory_utilization: float,
    weights_bytes: int,
    peak_activation_bytes: int,
    non_torch_bytes: int,
) -> int:
    """vLLM's KV-cache budget on a GPU: the share of its memory this engine may use, less what the weights, the peak
    step's activations and memory outside torch's allocator take. Raises ValueError when nothing is left."""
    requested = int(total_bytes * gpu_memory_utilization)
    non_kv_cache = weights_bytes + peak_activation_bytes + non_torch_bytes
    budget = requested - non_kv_cache
    if budget <= 0:
        raise ValueError(
            f"no GPU memory is left for the KV cache: gpu_memory_utilization {gpu_memory_utilization} of "
            f"{_gib(total_bytes)} GiB is {_gib(requested)} GiB, and {_gib(non_kv_cache)} GiB of it is taken (weights "
            f"{_gib(weights_bytes)} GiB, peak activations {_gib(peak_activation_bytes)} GiB, outside torch "
            f"{_gib(non_torch_bytes)} GiB); raise gpu_memory_utilization, lower max_num_batched_tokens or "
            "max_num_seqs, or set cache.kv_cache_memory_gib"
        )
    return budget


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f}"


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def current_ray_node() -> tuple[str | None, str | None]:
    """(node id hex, node IP) of the Ray node this process runs on; (None, None) outside Ray."""
    import ray

    if not ray.is_initialized():
        return None, None
    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


class ComputeThread:
    """One daemon thread that runs a worker actor's torch work, call after call.

    Ray runs a worker's calls on the process's main thread, and the step channel's server is a loop of its own: if
    both ran torch code, libgomp would give each of the two threads a team of OpenMP threads, and with more of its
    threads than cores it throttles their spin-waits, so every parallel region starts with futex wake-ups. On one
    thread, one team.
    """

    def __init__(self, name: str):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.busy_forever = False
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def call(self, function: Callable[..., Any], *args: Any) -> Any:
        if self.busy_forever:
            raise RuntimeError("this worker's compute thread serves its step channel: steps go there")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.jobs.put((future, function, args))
        return future.result()

    def run_forever(self, loop: Callable[[], None]) -> None:
        """Hand the thread a loop that keeps it (the step server); later calls are refused, not queued forever."""
        self.busy_forever = True
        self.jobs.put((None, loop, ()))

    def _run(self) -> None:
        while True:
            future, function, args = self.jobs.get()
            try:
                result = function(*args)
            except BaseException as error:
                if future is None:
                    logger.exception("the compute thread's loop failed")
                else:
                    future.set_exception(error)
            else:
                if future is not None:
                    future.set_result(result)


class ModelWorker:
    def __init__(
        self,
        model_info: ModelInfo,
        config: EngineConfig,
        pp_rank: int,
        tp_rank: int,
        num_threads: int,
        compute_thread: bool = False,
    ):
        """`compute_thread`: run every torch call on a ComputeThread (a Ray actor, whose steps may come over a
        step channel); in-process, the caller's thread runs them."""
        self.model_info = model_info
        self.config = config
        self.pp_rank = pp_rank
        self.tp_rank = tp_rank
        keep_freed_memory(self.config.runtime.keep_freed_memory, single_arena=compute_thread)
        self.compute = ComputeThread(f"model-pp{pp_rank}-tp{tp_rank}") if compute_thread else None
        # Ray sets OMP_NUM_THREADS=1 in workers; each worker takes its own share of the cores instead.
        os.environ["OMP_NUM_THREADS"] = str(num_threads)
        self._on_compute(torch.set_num_threads, num_threads)  # a per-thread setting in OpenMP
        self.runner: ModelRunner | None = None

    def _on_compute(self, function: Callable[..., Any], *args: Any) -> Any:
        return function(*args) if self.compute is None else self.compute.call(function, *args)

    def address_and_free_port(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), find_free_port()

    def init_distributed(self, master_address: str, master_port: int) -> None:
        """Join the world (NCCL on CUDA, gloo on CPU) and build every stage's tensor-parallel group."""
        self._on_compute(self._init_distributed, master_address, master_port)

    def _init_distributed(self, master_address: str, master_port: int) -> None:
        tp_size, pp_size = self.config.parallel.tensor_parallel_size, self.config.parallel.pipeline_parallel_size
        backend = "nccl" if self.model_info.device == "cuda" else "gloo"
        rank = self.pp_rank * tp_size + self.tp_rank
        if self.model_info.device == "cuda":
            torch.cuda.set_device(0)  # Ray pins one GPU per worker and makes it device 0
        dist.init_process_group(
            backend, init_method=f"tcp://{master_address}:{master_port}", rank=rank, world_size=tp_size * pp_size
        )
        tp_group = None
        for stage in range(pp_size):
            # Every rank must create every group, in the same order.
            group = dist.new_group([stage * tp_size + tp for tp in range(tp_size)], backend=backend)
            if stage == self.pp_rank:
                tp_group = group
        self.parallel = ParallelContext(self.tp_rank, tp_size, tp_group, self.pp_rank, pp_size)

    def load_model(self, show_progress: bool = False) -> int:
        """Load this rank's shard; returns how many KV blocks fit the configured memory budget here."""
        self._find_model(show_progress)
        return self._on_compute(self._load_model, show_progress)

    def _find_model(self, show_progress: bool) -> None:
        """The model's files on this node: a hub id's weights (the engine read only its config, maybe on another
        node), an alias fetched here. Here rather than at the actor's start: a long download must not look like a
        hung actor."""
        model_info = self.model_info
        if model_info.hub_commit is None and model_info.model_dir.exists():
            return
        model_dir = resolve_configured_model(
            self.config.model, weights=True, hub_commit=model_info.hub_commit, show_progress=show_progress
        )
        self.model_info = dataclasses.replace(model_info, model_dir=model_dir)

    def _load_model(self, show_progress: bool) -> int:
        parallel = getattr(self, "parallel", None) or ParallelContext()
        torch_bytes_before_load = (0, 0)
        if self.model_info.device == "cuda":
            torch.cuda.empty_cache()
            torch_bytes_before_load = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
        lora = self.config.lora
        self.runner = ModelRunner(
            self.model_info,
            self.config.cache.block_size,
            parallel,
            attention_backend=self.config.runtime.attention_backend,
            seed=self.config.model.seed,
            show_progress=show_progress,
            cuda_graphs=self.config.runtime.cuda_graphs,
            greedy_screening=self.config.runtime.greedy_screening,
            cpu_kernels=self.config.runtime.cpu_kernels,
            cuda_graph_max_batch_size=min(
                self.config.runtime.cuda_graph_max_batch_size, self.config.scheduler.max_num_seqs
            ),
            # Adapter slots sized before the KV cache is, so they come out of its budget.
            lora_capacity=(lora.max_loras, lora.max_lora_rank) if lora.enable_lora else None,
        )
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks  # the executor takes this over any budget: nothing to size or profile
        if cache.kv_cache_memory_gib is None and self.model_info.device == "cuda":
            budget_bytes = self._profile_kv_cache_budget(*torch_bytes_before_load)
        else:
            budget_bytes = int((cache.kv_cache_memory_gib or DEFAULT_CPU_KV_CACHE_GIB) * 2**30)
        return self.runner.num_kv_blocks_for_budget(budget_bytes)

    def _profile_kv_cache_budget(self, allocated_before_load: int, reserved_before_load: int) -> int:
        """vLLM's sizing: run the largest step the scheduler can plan, measure the peak, and give the KV cache what
        gpu_memory_utilization leaves of the GPU after the weights, that peak and memory outside torch."""
        scheduler = self.config.scheduler
        weights_bytes = torch.cuda.memory_allocated() - allocated_before_load
        peak_activation_bytes = self.runner.profile_run(
            scheduler.max_num_batched_tokens, scheduler.max_num_seqs, self.config.model.max_logprobs
        )
        torch.cuda.empty_cache()
        free_bytes, total_bytes = torch.cuda.mem_get_info()
        # Everything in use on the GPU that this engine's torch allocator did not take since it started: the CUDA
        # context, NCCL's buffers, other processes (and tensors this process held before the model loaded).
        non_torch_bytes = max(0, (total_bytes - free_bytes) - (torch.cuda.memory_reserved() - reserved_before_load))
        budget = kv_cache_memory_bytes(
            total_bytes, self.config.cache.gpu_memory_utilization, weights_bytes, peak_activation_bytes, non_torch_bytes
        )
        logger.info(
            "memory profile: %s GiB x gpu_memory_utilization %s = %s GiB; weights %s GiB, peak activations %s GiB "
            "(%d tokens in %d sequences), outside torch %s GiB; KV cache %s GiB",
            _gib(total_bytes),
            self.config.cache.gpu_memory_utilization,
            _gib(total_bytes * self.config.cache.gpu_memory_utilization),
            _gib(weights_bytes),
            _gib(peak_activation_bytes),
            scheduler.max_num_batched_tokens,
            min(scheduler.max_num_seqs, scheduler.max_num_batched_tokens),
            _gib(non_torch_bytes),
            _gib(budget),
        )
        return budget

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._on_compute(self._allocate_kv_cache, num_blocks)

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        # Ranks of a parallel group would each need the same dummy plan at once; one rank warms up alone.
        if self.config.world_size == 1:
            self.runner.warm_up(self.config.scheduler.max_num_batched_tokens)

    def execute(self, plan: StepPlan) -> StepResult:
        return self._on_compute(self._execute, plan)

    def _execute(self, plan: StepPlan) -> StepResult:
        return self.runner.execute(plan)

    def open_step_channel(self) -> tuple[str, int, bytes]:
        """From now on the compute thread serves steps over a socket (see executor.step_channel) and `execute`
        is refused; returns (host, port, secret)."""
        import ray

        if self.compute is None:
            raise RuntimeError("a step channel needs the worker's compute thread (compute_thread=True)")
        return open_step_listener(ray.util.get_node_ip_address(), self._execute, self.compute.run_forever)

    def freeze_startup_heap(self) -> int:
        """In a worker process of its own (a Ray actor), once the model and cache are in: see executor.heap. Never
        in-process, where the heap is the user's program's."""
        return freeze_startup_heap(f"model worker pp{self.pp_rank}-tp{self.tp_rank}")

    def ping(self) -> str:
        return f"pp{self.pp_rank}-tp{self.tp_rank}"

    def identity(self) -> dict[str, int | str | None]:
        """Where this worker runs: ranks, process, threads and its Ray node (id and IP; None in-process without
        Ray). For operators, topology tests and errors that name a lost node."""
        node_id, node_ip = current_ray_node()
        return {
            "pp_rank": self.pp_rank,
            "tp_rank": self.tp_rank,
            "pid": os.getpid(),
            "threads": torch.get_num_threads(),
            "node_id": node_id,
            "node_ip": node_ip,
        }

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
