"""KV-cache blocks: the O(1) free queue, the block pool's ref counts and lazy LRU eviction, and the
KVCacheManager's prefix-cache hits (chained hashes verified by token ids and parent hash) and allocation."""

from __future__ import annotations

import pytest

from configs.sampling_params import SamplingParams
from executor.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from executor.kv_cache_manager import KVCacheManager, hash_block
from executor.request import Request

BLOCK_SIZE = 4


def make_request(request_id: str, prompt: list[int], max_tokens: int = 16) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), max_tokens)


def admit(manager: KVCacheManager, request: Request) -> tuple[list[int], int]:
    """Schedule a waiting request's whole prompt the way the scheduler does; returns (new block ids, cached tokens)."""
    computed, num_cached = manager.get_computed_blocks(request)
    block_ids = manager.allocate_slots(request, request.num_tokens - num_cached, computed, num_cached)
    assert block_ids is not None
    request.num_computed_tokens = request.num_tokens
    return block_ids, num_cached


def assert_all_free(pool: BlockPool) -> None:
    assert pool.num_free_blocks == pool.num_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert sorted(pool.free_queue.block_ids()) == list(range(pool.num_blocks))


# --- FreeBlockQueue ---------------------------------------------------------------------------------------------------


def test_free_queue_pops_in_insertion_order() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert queue.num_free_blocks == 5
    assert queue.block_ids() == [0, 1, 2, 3, 4]
    assert queue.popleft() is blocks[0]
    assert queue.popleft() is blocks[1]
    assert queue.num_free_blocks == 3
    assert queue.block_ids() == [2, 3, 4]


def test_free_queue_remove_from_middle_and_ends_keeps_order() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[3])
    assert queue.block_ids() == [0, 1, 2, 4, 5]
    assert queue.num_free_blocks == 5
    assert blocks[3].prev_free is None and blocks[3].next_free is None
    queue.remove(blocks[0])  # head
    queue.remove(blocks[5])  # tail
    assert queue.block_ids() == [1, 2, 4]
    assert queue.num_free_blocks == 3
    assert [queue.popleft().block_id for _ in range(3)] == [1, 2, 4]


def test_free_queue_append_goes_to_the_back() -> None:
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeBlockQueue(blocks[:2])
    queue.append(blocks[3])
    queue.append(blocks[2])
    assert queue.block_ids() == [0, 1, 3, 2]
    assert queue.num_free_blocks == 4
    popped = queue.popleft()
    queue.append(popped)
    assert queue.block_ids() == [1, 3, 2, 0]
    assert queue.num_free_blocks == 4


def test_free_queue_popleft_on_empty_raises() -> None:
    queue = FreeBlockQueue([])
    assert queue.num_free_blocks == 0
    assert queue.block_ids() == []
    with pytest.raises(RuntimeError):
        queue.popleft()
    block = KVCacheBlock(7)
    queue.append(block)
    assert queue.popleft() is block
    with pytest.raises(RuntimeError):
        queue.popleft()
    assert queue.num_free_blocks == 0


# --- BlockPool --------------------------------------------------------------------------------------------------------


def test_pool_allocate_and_free_ref_counts() -> None:
    pool = BlockPool(4)
    assert pool.num_blocks == 4 and pool.num_free_blocks == 4 and pool.usage == 0.0
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)
    pool.touch(blocks[:1])  # a second holder
    assert blocks[0].ref_cnt == 2
    pool.free(blocks)
    assert [b.ref_cnt for b in blocks] == [1, 0, 0]
    assert pool.num_free_blocks == 3
    assert pool.free_queue.block_ids() == [3, 1, 2]
    pool.free(blocks[:1])
    assert_all_free(pool)


def test_pool_allocate_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    assert pool.free_queue.block_ids() == [2]


def test_pool_freed_blocks_are_reused_in_free_order() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.free(reversed(blocks))  # how the manager frees one request: tail first
    assert pool.free_queue.block_ids() == [3, 2, 1, 0]
    assert [b.block_id for b in pool.allocate(2)] == [3, 2]


def test_pool_reuse_of_cached_block_evicts_it_lazily() -> None:
    pool = BlockPool(2)
    block = pool.allocate(1)[0]
    tokens = (1, 2, 3, 4)
    block_hash = hash_block(None, tokens)
    pool.register(block, block_hash, None, tokens)
    pool.free([block])
    # Freed but still cached: found by lookup while it waits in the free queue.
    assert pool.lookup(block_hash, None, tokens) is block
    assert pool.num_evictions == 0
    first, second = pool.allocate(2)
    assert first.block_id == 1  # the never-used block was ahead in the queue
    assert second is block
    assert pool.num_evictions == 1
    assert block_hash not in pool.cached_blocks
    assert pool.lookup(block_hash, None, tokens) is None
    assert block.block_hash is None and block.token_ids is None and block.parent_hash is None


def test_pool_touch_on_cached_free_block_takes_it_out_of_free_queue() -> None:
    pool = BlockPool(3)
    block = pool.allocate(1)[0]
    tokens = (5, 6, 7, 8)
    pool.register(block, hash_block(None, tokens), None, tokens)
    pool.free([block])
    assert pool.num_free_blocks == 3
    assert block.block_id in pool.free_queue.block_ids()
    pool.touch([block])
    assert block.ref_cnt == 1
    assert pool.num_free_blocks == 2
    assert block.block_id not in pool.free_queue.block_ids()
    # Allocating everything left must not hand out (or evict) the touched block.
    others = pool.allocate(2)
    assert block not in others
    assert pool.num_evictions == 0
    assert pool.lookup(hash_block(None, tokens), None, tokens) is block


def test_pool_lookup_checks_tokens_and_parent_not_just_the_hash() -> None:
    pool = BlockPool(3)
    parent_tokens, tokens = (1, 2, 3, 4), (5, 6, 7, 8)
    parent_hash = hash_block(None, parent_tokens)
    child_hash = hash_block(parent_hash, tokens)
    block = pool.allocate(1)[0]
    pool.register(block, child_hash, parent_hash, tokens)
    assert pool.lookup(child_hash, parent_hash, tokens) is block
    # Same hash, other tokens: a hash collision must not produce a hit.
    assert pool.lookup(child_hash, parent_hash, (5, 6, 7, 9)) is None
    # Same hash and tokens after another parent.
    assert pool.lookup(child_hash, parent_hash + 1, tokens) is None
    assert pool.lookup(child_hash, None, tokens) is None
    # A block registered under a colliding hash with different tokens is never returned for these tokens.
    colliding = pool.allocate(1)[0]
    other_hash = hash_block(None, (9, 9, 9, 9))
    pool.register(colliding, other_hash, None, (1, 1, 1, 1))
    assert pool.lookup(other_hash, None, (9, 9, 9, 9)) is None
    assert pool.lookup(other_hash, None, (1, 1, 1, 1)) is colliding


def test_pool_register_keeps_the_first_block_for_a_hash() -> None:
    pool = BlockPool(3)
    tokens = (1, 2, 3, 4)
    block_hash = hash_block(None, tokens)
    first, second = pool.allocate(2)
    pool.register(first, block_hash, None, tokens)
    pool.register(second, block_hash, None, tokens)
    assert pool.lookup(block_hash, None, tokens) is first
    # Evicting the duplicate must not drop the entry of the block that owns it.
    pool.free([second])
    pool.allocate(2)  # block 2, then the duplicate (evicted)
    assert pool.lookup(block_hash, None, tokens) is first


# --- KVCacheManager ---------------------------------------------------------------------------------------------------


def test_second_request_with_same_prompt_hits_full_blocks() -> None:
    manager = KVCacheManager(16, BLOCK_SIZE, enable_prefix_caching=True)
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks + 2 tokens
    first = make_request("a", prompt)
    first_ids, cached = admit(manager, first)
    assert cached == 0 and len(first_ids) == 3
    second = make_request("b", prompt)
    computed, num_cached = manager.get_computed_blocks(second)
    assert num_cached == 8
    assert [b.block_id for b in computed] == first_ids[:2]
    second_ids = manager.allocate_slots(second, second.num_tokens - num_cached, computed, num_cached)
    assert second_ids[:2] == first_ids[:2]
    assert second_ids[2] not in first_ids
    for block in computed:
        assert block.ref_cnt == 2
    assert manager.pool.blocks[first_ids[2]].ref_cnt == 1
    assert manager.num_free_blocks == 16 - 4


def test_prompt_of_whole_blocks_leaves_last_block_to_compute() -> None:
    manager = KVCacheManager(16, BLOCK_SIZE, enable_prefix_caching=True)
    prompt = list(range(200, 212))  # exactly 3 blocks
    first_ids, _ = admit(manager, make_request("a", prompt))
    assert len(first_ids) == 3
    second = make_request("b", prompt)
    computed, num_cached = manager.get_computed_blocks(second)
    assert num_cached == 8  # k - 1 blocks: the last token's logits are needed
    assert [b.block_id for b in computed] == first_ids[:2]
    new_ids = manager.allocate_slots(second, 4, computed, num_cached)
    assert len(new_ids) == 3 and new_ids[2] != first_ids[2]


def test_partial_prefix_hit_stops_at_first_diverging_block() -> None:
    manager = KVCacheManager(16, BLOCK_SIZE, enable_prefix_caching=True)
    prompt = list(range(300, 318))  # 4 full blocks + 2
    first_ids, _ = admit(manager, make_request("a", prompt))
    diverged = [*prompt[:8], 999, *prompt[9:]]  # differs in block 2 only; blocks 3+ match token-wise
    second = make_request("b", diverged)
    computed, num_cached = manager.get_computed_blocks(second)
    assert num_cached == 8
    assert [b.block_id for b in computed] == first_ids[:2]
    assert manager.prefix_cache_hits == 8
    assert manager.prefix_cache_queries == 2 * len(prompt)


def test_hits_are_a_contiguous_prefix() -> None:
    manager = KVCacheManager(8, BLOCK_SIZE, enable_prefix_caching=True)
    prompt = list(range(20, 37))  # 4 full blocks + 1
    chunks = [tuple(prompt[i : i + BLOCK_SIZE]) for i in range(0, 16, BLOCK_SIZE)]
    hashes = []
    for chunk in chunks:
        hashes.append(hash_block(hashes[-1] if hashes else None, chunk))
    # Blocks 0, 1 and 3 are cached; block 2 was evicted: block 3 is unreachable.
    blocks = manager.pool.allocate(4)
    for index in (0, 1, 3):
        manager.pool.register(blocks[index], hashes[index], hashes[index - 1] if index else None, chunks[index])
    computed, num_cached = manager.get_computed_blocks(make_request("a", prompt))
    assert [b.block_id for b in computed] == [blocks[0].block_id, blocks[1].block_id]
    assert num_cached == 8


def test_block_hash_chains_the_parent() -> None:
    tokens = (1, 2, 3, 4)
    assert hash_block(None, tokens) == hash_block(None, tokens)
    assert hash_block(None, tokens) != hash_block(hash_block(None, (9, 9, 9, 9)), tokens)
    assert hash_block(None, tokens) != hash_block(None, (1, 2, 3, 5))


def test_same_tokens_after_different_prefix_do_not_hit() -> None:
    manager = KVCacheManager(16, BLOCK_SIZE, enable_prefix_caching=True)
    admit(manager, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Block 1 holds the same tokens as "a"'s block 1, but after another block 0: chained hash must miss.
    computed, num_cached = manager.get_computed_blocks(make_request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert computed == [] and num_cached == 0


def test_no_hits_when_prefix_caching_disabled() -> None:
    manager = KVCacheManager(16, BLOCK_SIZE, enable_prefix_caching=False)
    prompt = list(range(400, 410))
    first_ids, _ = admit(manager, make_request("a", prompt))
    second = make_request("b", prompt)
    assert manager.get_computed_blocks(second) == ([], 0)
    second_ids, cached = admit(manager, second)
    assert cached == 0
    assert not set(first_ids) & set(second_ids)
    assert all(block.ref_cnt <= 1 for block in manager.pool.blocks)


def test_allocate_slots_returns_none_when_full_and_changes_nothing() -> None:
    manager = KVCacheManager(4, BLOCK_SIZE, enable_prefix_caching=True)
    first = make_request("a", list(range(10)))  # 3 blocks
    admit(manager, first)
    queue_before = manager.pool.free_queue.block_ids()
    second = make_request("b", list(range(50, 56)))  # needs 2, 1 free
    assert manager.allocate_slots(second, 6) is None
    assert manager.num_free_blocks == 1
    assert manager.pool.free_queue.block_ids() == queue_before
    assert manager.block_ids("b") == []
    assert "b" not in manager.request_blocks
    # A running request that can't grow keeps exactly what it had.
    held = manager.block_ids("a")
    assert manager.allocate_slots(first, 7) is None  # 17 tokens: 5 blocks, 2 more with 1 free
    assert manager.block_ids("a") == held
    assert manager.num_free_blocks == 1
    # Growing into the one free block works.
    assert manager.allocate_slots(first, 6) == [3]
    assert manager.num_free_blocks == 0


def test_hits_waiting_in_free_queue_count_against_capacity() -> None:
    manager = KVCacheManager(4, BLOCK_SIZE, enable_prefix_caching=True)
    prompt = list(range(500, 509))  # 9 tokens: blocks 0, 1 full, 1 token in block 2
    first = make_request("a", prompt)
    admit(manager, first)
    manager.free(first)
    assert manager.num_free_blocks == 4
    blocker = make_request("x", list(range(600, 604)))  # holds 1 block
    admit(manager, blocker)
    assert manager.num_free_blocks == 3
    second = make_request("b", [*prompt, 7, 7, 7, 7, 7, 7, 7])  # 16 tokens: 2 hits + 2 fresh blocks
    computed, num_cached = manager.get_computed_blocks(second)
    assert num_cached == 8 and all(b.ref_cnt == 0 for b in computed)
    # 3 free blocks, but 2 of them are the hits themselves: only 1 left for the 2 fresh ones.
    assert manager.allocate_slots(second, second.num_tokens - num_cached, computed, num_cached) is None
    assert manager.num_free_blocks == 3
    assert all(b.ref_cnt == 0 for b in computed)
    assert manager.pool.num_evictions == 0
    # With one fresh block needed it fits exactly, and the hits leave the free queue.
    third = make_request("c", [*prompt, 7, 7, 7])  # 12 tokens: 2 hits + 1 fresh
    computed, num_cached = manager.get_computed_blocks(third)
    new_ids = manager.allocate_slots(third, third.num_tokens - num_cached, computed, num_cached)
    assert new_ids is not None and len(new_ids) == 3
    assert manager.num_free_blocks == 0
    assert [manager.pool.blocks[i].ref_cnt for i in new_ids] == [1, 1, 1]


def test_shared_blocks_ref_counts_and_everything_free_at_the_end() -> None:
    manager = KVCacheManager(8, BLOCK_SIZE, enable_prefix_caching=True)
    prompt = list(range(700, 713))  # 3 full blocks + 1
    first, second = make_request("a", prompt), make_request("b", prompt)
    first_ids, _ = admit(manager, first)
    second_ids, cached = admit(manager, second)
    assert cached == 12
    shared = first_ids[:3]
    assert second_ids[:3] == shared
    assert [manager.pool.blocks[i].ref_cnt for i in shared] == [2, 2, 2]
    assert manager.num_free_blocks == 8 - 5
    # Decode a few tokens on both; their tails stay private.
    for request in (first, second):
        for token in (1, 2, 3, 4):
            request.token_ids.append(token)
            assert manager.allocate_slots(request, 1) is not None
            request.num_computed_tokens += 1
    assert manager.num_free_blocks == 8 - 7  # 3 shared + 2 private each (17 tokens)
    manager.free(first)
    assert [manager.pool.blocks[i].ref_cnt for i in shared] == [1, 1, 1]
    assert manager.num_free_blocks == 8 - 5  # only first's two private blocks came back
    manager.free(second)
    assert_all_free(manager.pool)
    assert manager.request_blocks == {}
    assert manager.num_registered_blocks == {}


def test_request_is_freed_tail_first() -> None:
    manager = KVCacheManager(6, BLOCK_SIZE, enable_prefix_caching=True)
    request = make_request("a", list(range(12)))  # 3 blocks
    block_ids, _ = admit(manager, request)
    manager.free(request)
    queue = manager.pool.free_queue.block_ids()
    # Never-used blocks first, then this request's blocks from its last to its first.
    assert queue[-3:] == block_ids[::-1]


def test_lru_evicts_least_recently_freed_cached_block_first() -> None:
    manager = KVCacheManager(4, BLOCK_SIZE, enable_prefix_caching=True)
    old = make_request("old", [1, 2, 3, 4, 9])  # 1 full (cached) block + 1 partial block
    new = make_request("new", [5, 6, 7, 8, 9])
    admit(manager, old)
    admit(manager, new)
    manager.free(old)
    manager.free(new)
    assert manager.num_free_blocks == 4
    # Free queue: old's partial tail, old's cached block, new's partial tail, new's cached block.
    filler = make_request("filler", list(range(40, 48)))  # 2 blocks: old's tail, then old's cached block
    admit(manager, filler)
    assert manager.pool.num_evictions == 1
    computed_old, cached_old = manager.get_computed_blocks(make_request("old2", [1, 2, 3, 4, 9]))
    computed_new, cached_new = manager.get_computed_blocks(make_request("new2", [5, 6, 7, 8, 9]))
    assert cached_old == 0 and computed_old == []
    assert cached_new == 4 and len(computed_new) == 1


def test_hit_refreshes_lru_position() -> None:
    manager = KVCacheManager(3, BLOCK_SIZE, enable_prefix_caching=True)
    x, y = make_request("x", [1, 2, 3, 4]), make_request("y", [5, 6, 7, 8])
    (x_block,), _ = admit(manager, x)
    (y_block,), _ = admit(manager, y)
    manager.free(x)
    manager.free(y)  # x's block was freed first: it would be evicted before y's
    z = make_request("z", [1, 2, 3, 4, 9])  # reuses x's block, then frees it again
    computed, num_cached = manager.get_computed_blocks(z)
    assert [b.block_id for b in computed] == [x_block] and num_cached == 4
    assert manager.allocate_slots(z, 1, computed, num_cached) is not None
    manager.free(z)
    admit(manager, make_request("w", list(range(30, 38))))  # 2 blocks: evicts y's block, not x's
    assert manager.get_computed_blocks(make_request("x2", [1, 2, 3, 4, 0]))[1] == 4
    assert manager.get_computed_blocks(make_request("y2", [5, 6, 7, 8, 0]))[1] == 0
    assert manager.pool.blocks[y_block].token_ids != (5, 6, 7, 8)


def test_preempted_request_hits_its_own_blocks_including_output() -> None:
    manager = KVCacheManager(8, BLOCK_SIZE, enable_prefix_caching=True)
    request = make_request("a", [1, 2, 3, 4, 5, 6])
    admit(manager, request)
    for token in (7, 8, 9):
        request.token_ids.append(token)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
    held = manager.block_ids("a")
    manager.free(request)
    request.num_computed_tokens = 0
    computed, num_cached = manager.get_computed_blocks(request)
    assert num_cached == 8  # two full blocks, one of them holding generated tokens
    assert [b.block_id for b in computed] == held[:2]


def test_reset_prefix_cache_drops_all_hits() -> None:
    manager = KVCacheManager(8, BLOCK_SIZE, enable_prefix_caching=True)
    request = make_request("a", list(range(9)))
    admit(manager, request)
    manager.free(request)
    manager.reset_prefix_cache()
    assert manager.pool.cached_blocks == {}
    assert manager.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
