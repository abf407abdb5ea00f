"""Vocabulary-parallel embedding and LM head: each rank owns a contiguous range of token ids."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from model_executor.layers.linear import PackableWeight, copy_into
from model_executor.parallel_state import ParallelContext


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by token id; ids owned by other ranks contribute zeros to the all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelContext):
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.vocab_per_rank = -(-vocab_size // parallel.tp_size)
        self.vocab_start = parallel.tp_rank * self.vocab_per_rank
        self.vocab_end = min(self.vocab_start + self.vocab_per_rank, vocab_size)
        # Padded to equal shards so the gathered logits line up; padding rows stay zero.
        self.weight = nn.Parameter(torch.zeros(self.vocab_per_rank, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(owned, input_ids - self.vocab_start, 0)
        embeddings = nn.functional.embedding(local_ids, self.weight) * owned.unsqueeze(-1)
        return self.parallel.all_reduce(embeddings)

    def load_weight(self, param_name: str, loaded_weight: Any, shard_id: Any = None) -> None:
        rows = self.vocab_end - self.vocab_start
        copy_into(self.weight.data[:rows], loaded_weight[self.vocab_start : self.vocab_end])


class ParallelLMHead(PackableWeight, VocabParallelEmbedding):
    """Logits over the vocabulary: each rank scores its own token ids, then the slices are gathered."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        local_logits = self.linear_method.apply(self, hidden_states)
        return self.parallel.all_gather_last_dim(local_logits)[:, : self.vocab_size]
