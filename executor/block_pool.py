"""KV-cache blocks, their O(1) free queue, and the prefix-cache map from block hash to block."""

from __future__ import annotations

from collections.abc import Iterable


class KVCacheBlock:
    """One block of block_size token slots in every layer's cache."""

    __slots__ = ("block_hash", "block_id", "next_free", "parent_hash", "prev_free", "ref_cnt", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block holds a full, reusable block of tokens (it may still sit in the free queue).
        self.block_hash: int | None = None
        self.parent_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Intrusive doubly linked list: pop the least recently freed block, remove any block, all O(1)."""

    def __init__(self, blocks: Iterable[KVCacheBlock]):
        self.head = KVCacheBlock(-1)  # sentinels: no None checks on the hot path
        self.tail = KVCacheBlock(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self.tail
        self.tail.prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free
        if block is self.tail:
            raise RuntimeError("no free KV-cache blocks")
        self.remove(block)
        return block

    def block_ids(self) -> list[int]:
        """Front (evicted first) to back; for tests and debugging."""
        ids, block = [], self.head.next_free
        while block is not self.tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    """Owns every block; hands out free ones, evicting cached contents lazily (LRU) when reused."""

    def __init__(self, num_blocks: int):
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[int, KVCacheBlock] = {}
        self.num_evictions = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, count: int) -> list[KVCacheBlock]:
        if count > self.num_free_blocks:
            raise RuntimeError(f"asked for {count} blocks with {self.num_free_blocks} free")
        allocated = []
        for _ in range(count):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            allocated.append(block)
        return allocated

    def _evict(self, block: KVCacheBlock) -> None:
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
        block.block_hash = block.parent_hash = block.token_ids = None
        self.num_evictions += 1

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache hits; a hit waiting in the free queue leaves it."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; callers pass a request's blocks tail first so its last blocks are evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def lookup(self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> KVCacheBlock | None:
        """A cached block with exactly these tokens after exactly this parent; the hash alone is not trusted."""
        block = self.cached_blocks.get(block_hash)
        if block is None or block.token_ids != token_ids or block.parent_hash != parent_hash:
            return None
        return block

    def register(
        self, block: KVCacheBlock, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]
    ) -> None:
        """Mark a full block as reusable under its hash (the first block with a hash keeps the entry)."""
        if block.block_hash is not None:
            return
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        self.cached_blocks.setdefault(block_hash, block)

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.block_hash is not None:
                self._evict(block)
