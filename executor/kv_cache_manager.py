"""KVCacheManager: which blocks each request holds, prefix-cache hits, allocation for a step.

The scheduler sees block ids and counts only; blocks, hashes and the free queue stay in here.
"""

from __future__ import annotations

import logging

from executor.block_pool import BlockPool, KVCacheBlock
from executor.request import Request

logger = logging.getLogger(__name__)


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained block hash: a block's identity includes every token before it."""
    return hash((parent_hash, token_ids))


def root_hash(request: Request) -> int | None:
    """The parent of a request's first block: None for the base model, the adapter's own for a LoRA request (its KV
    differs from the base model's, so a cache hit never crosses adapters). Adapter ids are never reused."""
    return None if request.lora is None else hash(("lora", request.lora.adapter_id))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.request_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of a request's leading blocks are already registered in the prefix cache.
        self.num_registered_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.request_blocks.get(request_id, [])]

    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend request.block_hashes to cover every full block among its first num_tokens tokens."""
        block_size, hashes, tokens = self.block_size, request.block_hashes, request.token_ids
        while (len(hashes) + 1) * block_size <= num_tokens:
            index = len(hashes)
            parent = hashes[-1] if hashes else root_hash(request)
            hashes.append(hash_block(parent, tuple(tokens[index * block_size : (index + 1) * block_size])))

    def get_computed_blocks(self, request: Request, allow_sharing: bool = False) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request's tokens: (blocks, number of tokens they hold).

        At least one token is always left to compute, since its logits are needed to sample.
        allow_sharing lets n > 1 siblings reuse their shared prompt even with prefix caching off.
        """
        if not (self.enable_prefix_caching or allow_sharing):
            return [], 0
        max_cached_tokens = request.num_tokens - 1
        self._update_block_hashes(request, max_cached_tokens)
        hits: list[KVCacheBlock] = []
        tokens, block_size = request.token_ids, self.block_size
        root = root_hash(request)
        for index, block_hash in enumerate(request.block_hashes[: max_cached_tokens // block_size]):
            parent = request.block_hashes[index - 1] if index else root
            block = self.pool.lookup(block_hash, parent, tuple(tokens[index * block_size : (index + 1) * block_size]))
            if block is None:
                break
            hits.append(block)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * block_size
        return hits, len(hits) * block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVCacheBlock] | None = None,
        num_computed_tokens: int | None = None,
    ) -> list[int] | None:
        """Blocks for num_new_tokens more tokens (after any prefix-cache hits); None when they don't fit.

        Returns the ids of the blocks added to the request (hits first, then fresh ones).
        """
        computed_blocks = computed_blocks or []
        held = self.request_blocks.setdefault(request.request_id, [])
        if num_computed_tokens is None:
            num_computed_tokens = request.num_computed_tokens
        num_needed = -(-(num_computed_tokens + num_new_tokens) // self.block_size)
        num_fresh = num_needed - len(held) - len(computed_blocks)
        # Hits that sit in the free queue stop being free once touched.
        num_evictable_hits = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        if num_fresh > self.pool.num_free_blocks - num_evictable_hits:
            if not held:
                del self.request_blocks[request.request_id]
            return None
        self.pool.touch(computed_blocks)
        new_blocks = computed_blocks + self.pool.allocate(max(num_fresh, 0))
        held.extend(new_blocks)
        # A token a step in flight will sample is not known yet: its block registers on a later step.
        self._register_full_blocks(request, held, min(num_computed_tokens + num_new_tokens, request.num_tokens))
        return [block.block_id for block in new_blocks]

    def _register_full_blocks(self, request: Request, held: list[KVCacheBlock], num_tokens: int) -> None:
        """Make the request's full blocks findable; their KV is written in this step, before anyone reads it."""
        self._update_block_hashes(request, num_tokens)
        num_full = min(num_tokens // self.block_size, len(held))
        start = self.num_registered_blocks.get(request.request_id, 0)
        tokens, block_size, hashes = request.token_ids, self.block_size, request.block_hashes
        for index in range(start, num_full):
            parent = hashes[index - 1] if index else root_hash(request)
            self.pool.register(
                held[index], hashes[index], parent, tuple(tokens[index * block_size : (index + 1) * block_size])
            )
        self.num_registered_blocks[request.request_id] = max(start, num_full)

    def free(self, request: Request) -> None:
        """Release every block of the request, tail first (its last blocks are the least likely to be reused)."""
        blocks = self.request_blocks.pop(request.request_id, [])
        self.num_registered_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
