"""A model worker: one process per (pp_rank, tp_rank), holding its model shard and KV cache.

Plain class, wrapped with `ray.remote` by the Ray executor, so the same code runs in-process in tests of the
parallel layers and as a Ray actor in the cluster.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket

import torch
import torch.distributed as dist

from configs.engine_config import EngineConfig
from executor.heap import freeze_startup_heap
from model_executor.model_fetch import resolve_model
from model_executor.model_info import ModelInfo
from model_executor.model_runner import ModelRunner
from model_executor.parallel_state import ParallelContext
from model_executor.step_plan import StepPlan, StepResult

logger = logging.getLogger(__name__)


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


class ModelWorker:
    def __init__(self, model_info: ModelInfo, config: EngineConfig, pp_rank: int, tp_rank: int, num_threads: int):
        if not model_info.model_dir.exists():
            # On another node of the cluster: fetch or find the model there.
            model_info = dataclasses.replace(model_info, model_dir=resolve_model(config.model))
        self.model_info = model_info
        self.config = config
        self.pp_rank = pp_rank
        self.tp_rank = tp_rank
        # Ray sets OMP_NUM_THREADS=1 in workers; each worker takes its own share of the cores instead.
        torch.set_num_threads(num_threads)
        os.environ["OMP_NUM_THREADS"] = str(num_threads)
        self.runner: ModelRunner | None = None

    def address_and_free_port(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), find_free_port()

    def init_distributed(self, master_address: str, master_port: int) -> None:
        """Join the world (NCCL on CUDA, gloo on CPU) and build every stage's tensor-parallel group."""
        tp_size, pp_size = self.config.tensor_parallel_size, self.config.pipeline_parallel_size
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
        parallel = getattr(self, "parallel", None) or ParallelContext()
        self.runner = ModelRunner(
            self.model_info,
            self.config.block_size,
            parallel,
            attention_backend=self.config.attention_backend,
            seed=self.config.seed,
            show_progress=show_progress,
            cuda_graphs=self.config.cuda_graphs,
            greedy_screening=self.config.greedy_screening,
            cuda_graph_max_batch_size=min(self.config.cuda_graph_max_batch_size, self.config.max_num_seqs),
        )
        return self.runner.num_kv_blocks_for_budget(int(self.config.kv_cache_memory_gib * 2**30))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        # Ranks of a parallel group would each need the same dummy plan at once; one rank warms up alone.
        if self.config.world_size == 1:
            self.runner.warm_up(self.config.max_num_batched_tokens)

    def execute(self, plan: StepPlan) -> StepResult:
        return self.runner.execute(plan)

    def freeze_startup_heap(self) -> int:
        """In a worker process of its own (a Ray actor), once the model and cache are in: see executor.heap. Never
        in-process, where the heap is the user's program's."""
        return freeze_startup_heap(f"model worker pp{self.pp_rank}-tp{self.tp_rank}")

    def ping(self) -> str:
        return f"pp{self.pp_rank}-tp{self.tp_rank}"

    def identity(self) -> dict[str, int]:
        """Where this worker runs: for operators and topology tests."""
        return {
            "pp_rank": self.pp_rank,
            "tp_rank": self.tp_rank,
            "pid": os.getpid(),
            "threads": torch.get_num_threads(),
        }

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
