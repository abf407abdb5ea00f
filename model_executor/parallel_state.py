"""Tensor-parallel context handed to every parallel layer (no module globals)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelContext:
    """This rank's place in its tensor-parallel group; world size 1 needs no process group."""

    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None  # torch.distributed.ProcessGroup when tp_size > 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside a tensor-parallel group of {self.tp_size}")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank {self.pp_rank} is outside a pipeline of {self.pp_size} stages")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def global_rank(self) -> int:
        """Rank in the whole torch.distributed world: stages outer, tensor-parallel ranks inner."""
        return self.pp_rank * self.tp_size + self.tp_rank

    def stage_layer_range(self, num_layers: int) -> tuple[int, int]:
        """[start, end) of the decoder layers this pipeline stage owns; earlier stages take any remainder."""
        if num_layers < self.pp_size:
            raise ValueError(f"{num_layers} layers cannot be split into {self.pp_size} pipeline stages")
        base, remainder = divmod(num_layers, self.pp_size)
        start = self.pp_rank * base + min(self.pp_rank, remainder)
        return start, start + base + (1 if self.pp_rank < remainder else 0)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum partial results of a row-parallel layer across the group (in place)."""
        if self.tp_size > 1:
            dist.all_reduce(tensor, group=self.tp_group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's slice of the last dimension (vocab-parallel logits)."""
        if self.tp_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)


def divide(numerator: int, denominator: int, what: str) -> int:
    """Split a dimension evenly across ranks, or explain why it cannot be."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator
