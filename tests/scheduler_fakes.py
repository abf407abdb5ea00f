"""Shared scaffolding for the scheduler tests: a scheduler and requests built by hand, a fake runner that mirrors
what the model runner keeps from the plans (with a shadow KV cache), step helpers driven by hand-made StepResults,
and a seeded random workload. No model runs."""

from __future__ import annotations

import random
from collections.abc import Callable

from configs.engine_config import EngineConfig
from configs.sampling_params import SamplingParams
from executor.request import Request, RequestStatus
from executor.scheduler import RequestUpdate, Scheduler
from model_executor.step_plan import StepPlan, StepResult

EOS = 2
TOKEN = 5  # what the fake model samples unless told otherwise
BLOCK_SIZE = 4


def make_scheduler(num_blocks: int = 256, max_model_len: int | None = None, **config: object) -> Scheduler:
    """max_model_len defaults to what the cache holds, so one request can always fit on its own."""
    engine_config = EngineConfig(**{"block_size": BLOCK_SIZE, **config})
    if max_model_len is None:
        max_model_len = num_blocks * engine_config.cache.block_size
    return Scheduler(engine_config, num_blocks, max_model_len, eos_token_ids={EOS})


def make_request(
    request_id: str, prompt: list[int], max_tokens: int = 16, gate: str | None = None, **params: object
) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params), max_tokens, gate)


def prompt_of(length: int, start: int = 1000) -> list[int]:
    """Distinct token ids per start, so different requests share no prefix."""
    return list(range(start, start + length))


def sampling_ids(scheduler: Scheduler, plan: StepPlan) -> list[str]:
    """Requests that reach the end of their known tokens this step, i.e. get a sampled token (one step in flight:
    every placeholder is this plan's)."""
    return [
        request_id for request_id in plan.num_scheduled_tokens if scheduler.requests[request_id].num_output_placeholders
    ]


class FakeRunner:
    """Mirrors what the model runner keeps from the plans alone, and checks it against the scheduler.

    It also keeps a shadow KV cache holding the token id written at each (block, slot): every request must read
    back exactly its own tokens at every position it attends to, including prefix-cache hits.
    """

    def __init__(self) -> None:
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.kv: dict[tuple[int, int], int] = {}

    def apply(self, scheduler: Scheduler, plan: StepPlan) -> None:
        block_size = scheduler.kv_cache.block_size
        for request_id in plan.finished_request_ids + plan.preempted_request_ids:
            self.block_tables.pop(request_id, None)
            self.num_computed.pop(request_id, None)
        for new in plan.new_requests:
            assert new.request_id not in self.block_tables, f"{new.request_id} sent as new twice"
            self.block_tables[new.request_id] = list(new.block_ids)
            self.num_computed[new.request_id] = new.num_computed_tokens
        for cached in plan.cached_requests:
            assert cached.request_id in self.block_tables, f"{cached.request_id} sent as cached before new"
            self.block_tables[cached.request_id].extend(cached.new_block_ids)
            assert cached.num_computed_tokens == self.num_computed[cached.request_id]
        assert set(plan.num_scheduled_tokens) == {r.request_id for r in plan.new_requests} | {
            r.request_id for r in plan.cached_requests
        }
        # Every token's KV is written before attention reads any (one flattened batch per layer).
        written: dict[tuple[int, int], int] = {}
        for request_id, num in plan.num_scheduled_tokens.items():
            table, tokens = self.block_tables[request_id], scheduler.requests[request_id].token_ids
            assert table == scheduler.kv_cache.block_ids(request_id)
            start = self.num_computed[request_id]
            assert start + num <= len(table) * block_size
            assert start + num <= len(tokens)
            for position in range(start, start + num):
                slot = (table[position // block_size], position % block_size)
                assert written.setdefault(slot, tokens[position]) == tokens[position], "two tokens in one slot"
                self.kv[slot] = tokens[position]
        for request_id, num in plan.num_scheduled_tokens.items():
            table, tokens = self.block_tables[request_id], scheduler.requests[request_id].token_ids
            self.num_computed[request_id] += num
            read = [self.kv.get((table[p // block_size], p % block_size)) for p in range(self.num_computed[request_id])]
            assert read == tokens[: self.num_computed[request_id]], f"{request_id} attends to wrong KV"


def step(
    scheduler: Scheduler, token_for: Callable[[str], int] = lambda _: TOKEN, runner: FakeRunner | None = None
) -> tuple[StepPlan, list[RequestUpdate]]:
    plan = scheduler.schedule()
    assert plan.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
    if runner is not None:
        runner.apply(scheduler, plan)
    ids = sampling_ids(scheduler, plan)
    return plan, scheduler.update_from_output(plan, StepResult(ids, [[token_for(i)] for i in ids]))


def run_to_completion(
    scheduler: Scheduler, max_steps: int = 1000, runner: FakeRunner | None = None
) -> tuple[dict[str, list[int]], list[StepPlan]]:
    outputs: dict[str, list[int]] = {}
    plans = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs, plans
        plan, updates = step(scheduler, runner=runner)
        plans.append(plan)
        for update in updates:
            outputs.setdefault(update.request.request_id, []).extend(update.new_token_ids)
    raise AssertionError(f"requests still unfinished after {max_steps} steps: {list(scheduler.requests)}")


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    pool = scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert scheduler.kv_cache.request_blocks == {}


def drive(scheduler: Scheduler, tokens: list[int]) -> list[RequestUpdate]:
    """Prefill then decode the single request, sampling the given tokens in order until it finishes."""
    remaining = iter(tokens)
    updates: list[RequestUpdate] = []
    while scheduler.has_unfinished_requests():
        _, step_updates = step(scheduler, token_for=lambda _: next(remaining))
        updates += step_updates
    return updates


class RandomWorkload:
    """A seeded mix for the invariant tests: a scheduler of random shape and cache size; parents of 1-3 siblings
    whose prompts share prefixes, with random max_tokens and ignore_eos; random aborts and sampled tokens."""

    def __init__(self, seed: int, prioritize_prefill: bool):
        rng = self.rng = random.Random(seed)
        self.block_size = rng.choice([1, 2, 4, 16])
        self.num_blocks = rng.randint(4, 40)
        self.scheduler = make_scheduler(
            self.num_blocks,
            block_size=self.block_size,
            max_num_batched_tokens=rng.choice([1, 3, 8, 32, 128]),
            max_num_seqs=rng.choice([1, 2, 4, 64]),
            enable_prefix_caching=rng.random() < 0.7,
            prioritize_prefill=prioritize_prefill,
        )
        self.prefixes = [
            [rng.randrange(3, 50) for _ in range(rng.randint(1, 3 * self.block_size + 3))] for _ in range(3)
        ]
        self.requests: dict[str, Request] = {}
        self.num_parents = 0
        self.aborted: set[str] = set()

    def maybe_add_parent(self) -> None:
        rng = self.rng
        if rng.random() >= 0.3:
            return
        prompt = rng.choice(self.prefixes) + [rng.randrange(3, 50) for _ in range(rng.randint(0, 2 * self.block_size))]
        prompt = prompt[: self.num_blocks * self.block_size - 1]
        max_tokens, ignore_eos = rng.randint(1, 12), rng.random() < 0.5
        parent = self.num_parents
        for index in range(rng.choice([1, 1, 2, 3])):
            gate = f"p{parent}#0" if index else None
            request = make_request(f"p{parent}#{index}", prompt, max_tokens, gate, ignore_eos=ignore_eos)
            self.scheduler.add_request(request)
            self.requests[request.request_id] = request
        self.num_parents += 1

    def maybe_abort(self) -> None:
        scheduler = self.scheduler
        if scheduler.requests and self.rng.random() < 0.05:
            victim = self.rng.choice(list(scheduler.requests))
            scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            self.aborted.add(victim)

    def sample(self, _request_id: str = "") -> int:
        return EOS if self.rng.random() < 0.1 else self.rng.randrange(3, 50)

    def assert_blocks_accounted(self) -> None:
        """Every block's ref count is the number of requests holding it; the free queue is the unheld blocks."""
        scheduler, pool = self.scheduler, self.scheduler.kv_cache.pool
        holders: dict[int, int] = {}
        for blocks in scheduler.kv_cache.request_blocks.values():
            for block in blocks:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        assert [block.ref_cnt for block in pool.blocks] == [holders.get(i, 0) for i in range(self.num_blocks)]
        assert sorted(pool.free_queue.block_ids()) == [block.block_id for block in pool.blocks if block.ref_cnt == 0]
        assert len(scheduler.running) <= scheduler.max_num_seqs
