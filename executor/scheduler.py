"""Scheduler: one token-budget loop over running then waiting requests; never touches tensors.

There is no prefill phase or decode phase: each request has num_computed_tokens, and every step the scheduler
decides how many tokens each request advances, under max_num_batched_tokens and max_num_seqs. Chunked
prefill, prefix caching and recompute preemption fall out of that loop. With prioritize_prefill the loop visits
prompts (half done, then waiting) before running decodes while the cache has room. With enable_chunked_prefill off
a waiting request is admitted only when every token it has left to compute fits the step's remaining budget.

Progress advances when a step is scheduled, not when it returns, so the next step can be planned while this one
runs (async scheduling): a token a step in flight will sample is a placeholder until its result comes back. A
single-rank runner keeps the tokens it samples, so plans never carry them back to it.

With speculative decoding a request that has every token known and one to run may instead run that token plus
n-gram drafts (`spec_token_ids` of the plan); the step returns the drafts it accepted and one more token, and the
request's progress goes back by the drafts it rejected. A request with drafts in flight is not planned again until
they come back: how far it got is not known before.

With LoRA, a request admitted with an adapter pins that adapter's worker slot while it runs (`AdapterSlots`): a
waiting request whose adapter would be one more than `max_loras` stays in the queue (those behind it may go first)
until a running adapter's last request leaves. An adapter new to its slot goes to the workers in the plan.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from configs.engine_config import EngineConfig, check_chunked_prefill_budget
from executor.kv_cache_manager import KVCacheManager
from executor.lora_slots import AdapterSlots
from executor.ngram_proposer import propose_ngram_drafts
from executor.request import Request, RequestStatus
from model_executor.step_plan import CachedRequestData, LoRALoad, NewRequestData, StepPlan, StepResult

logger = logging.getLogger(__name__)

# Longest a request goes without drafts after its drafts failed step after step (the back-off doubles up to it).
MAX_DRAFT_BACKOFF_STEPS = 16


@dataclass(slots=True)
class RequestUpdate:
    """What one step did to one request: tokens it gained, and whether it is done."""

    request: Request
    new_token_ids: list[int]
    new_logprobs: list
    finished: bool


class Scheduler:
    def __init__(self, config: EngineConfig, num_kv_blocks: int, max_model_len: int, eos_token_ids: Iterable[int]):
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.prioritize_prefill = config.scheduler.prioritize_prefill
        # One rank samples and is the only one that needs the tokens: it appends them itself.
        self.runner_keeps_sampled_tokens = config.world_size == 1
        self.enable_chunked_prefill = config.scheduler.enable_chunked_prefill
        capacity = num_kv_blocks * config.cache.block_size
        if max_model_len > capacity:
            # A request that outgrew the whole cache could only be preempted, forever.
            raise ValueError(
                f"max_model_len {max_model_len} is larger than the KV cache can ever hold: {capacity} tokens "
                f"({num_kv_blocks} blocks of {config.cache.block_size}); raise the cache's size or lower max_model_len"
            )
        check_chunked_prefill_budget(self.enable_chunked_prefill, self.max_num_batched_tokens, max_model_len)
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv_cache = KVCacheManager(num_kv_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Gone since the last plan; the runner is told once, in the next plan.
        self.finished_since_last_plan: list[str] = []
        self.num_preemptions = 0
        self.speculative = config.scheduler.speculative_config
        # Drafts proposed and accepted, cumulative (the metrics read them).
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0
        lora = config.lora
        self.lora_slots = AdapterSlots(lora.max_loras) if lora.enable_lora else None
        self.lora_capacity = (lora.max_loras, lora.max_lora_rank)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if -(-(request.num_prompt_tokens + 1) // self.kv_cache.block_size) > self.kv_cache.pool.num_blocks:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens needs more KV blocks than the cache has "
                f"({self.kv_cache.pool.num_blocks} blocks of {self.kv_cache.block_size})"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: free the blocks, keep the tokens, go back to the front of the queue."""
        self.kv_cache.free(request)
        self._release_lora(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_tokens_sent = 0
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        logger.debug("preempted %s", request.request_id)

    def _is_gated(self, request: Request, plan: StepPlan) -> bool:
        """A sibling waits until an earlier plan than this one has scheduled the prompt it shares with the first."""
        gate = self.requests.get(request.gate_request_id) if request.gate_request_id else None
        if gate is None:
            return False
        num_planned_before = gate.num_computed_tokens - plan.num_scheduled_tokens.get(gate.request_id, 0)
        return num_planned_before < gate.num_prompt_tokens - 1

    def _length_limit(self, request: Request) -> int:
        """Tokens (prompt included) at which the request finishes by length: max_tokens or the context."""
        return min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)

    def _length_limit_in_flight(self, request: Request) -> bool:
        """The steps in flight sample the request's last token: nothing left to run."""
        return request.num_tokens_with_placeholders >= self._length_limit(request)

    def _speculates(self, request: Request) -> bool:
        """Whether the request gets drafts once its tokens are all known: speculation is on, and the batch size,
        the request's sampling and its back-off allow them."""
        speculative = self.speculative
        if speculative is None or request.steps_until_drafts:
            return False
        limit = speculative.disable_by_batch_size
        if limit is not None and len(self.running) > limit:
            return False
        params = request.sampling_params
        # Penalties and min_tokens read the tokens before each position, which differ between a step's drafts.
        return not params.needs_penalties and request.num_output_tokens >= params.min_tokens

    def _propose_drafts(self, request: Request, token_budget: int) -> list[int]:
        """The drafts the request verifies this step; none for a plain decode step, or no decode at all."""
        if request.num_output_placeholders or request.num_computed_tokens != request.num_tokens - 1:
            return []  # a token still in flight, or a prompt (or a resumed request) still being computed
        if not self._speculates(request):
            return []
        speculative = self.speculative
        # The verified drafts and the token after them must fit the length limit and the step's budget.
        num_drafts = min(
            request.max_next_drafts or speculative.num_speculative_tokens,
            self._length_limit(request) - request.num_tokens - 1,
            token_budget - 1,
        )
        if num_drafts <= 0:
            return []
        return propose_ngram_drafts(
            request.token_ids, num_drafts, speculative.prompt_lookup_max, speculative.prompt_lookup_min
        )

    def _advance(self, plan: StepPlan, request: Request, num_new: int, num_drafts: int = 0) -> None:
        """Count the step's tokens as computed now; reaching the end of the known tokens (and the drafts after
        them) means one is sampled."""
        plan.num_scheduled_tokens[request.request_id] = num_new
        request.num_computed_tokens += num_new
        if request.num_computed_tokens == request.num_tokens_with_placeholders + num_drafts:
            request.num_output_placeholders += 1

    def schedule(self) -> StepPlan:
        plan = StepPlan(finished_request_ids=self.finished_since_last_plan)
        self.finished_since_last_plan = []
        token_budget = self.max_num_batched_tokens
        if self.prioritize_prefill:
            prefilling = [r for r in self.running if r.num_tokens_with_placeholders - r.num_computed_tokens > 1]
            decoding = [r for r in self.running if r.num_tokens_with_placeholders - r.num_computed_tokens <= 1]
            if self._defer_decodes(prefilling):
                # Prefill first: chunks in progress, then admissions, then decodes with what is left, never
                # preempting for them (the cache had room for every decode's next block; short, one step waits).
                token_budget = self._schedule_running(plan, prefilling, token_budget, allow_preemption=True)
                token_budget = self._schedule_waiting(plan, token_budget)
                self._schedule_running(plan, decoding, token_budget, allow_preemption=False)
                return plan
        token_budget = self._schedule_running(plan, list(self.running), token_budget, allow_preemption=True)
        self._schedule_waiting(plan, token_budget)
        return plan

    def waits_only_for_grammars(self) -> bool:
        """Nothing is running and every waiting request waits for its grammar to compile."""
        return not self.running and bool(self.waiting) and all(request.waits_for_grammar for request in self.waiting)

    def defer_runner_news(self, plan: StepPlan) -> None:
        """A plan that runs nothing was not sent: its finished ids go out with the next one."""
        self.finished_since_last_plan[:0] = plan.finished_request_ids

    def _defer_decodes(self, prefilling: list[Request]) -> bool:
        """A prompt is being or waits to be prefilled, and the cache holds a full step of prompt blocks on top of
        every running request's next block: under memory pressure the step is decode-first, as usual."""
        num_admissible = min(len(self.waiting), self.max_num_seqs - len(self.running))
        if not prefilling and num_admissible <= 0:
            return False
        prompt_blocks = -(-self.max_num_batched_tokens // self.kv_cache.block_size) + max(num_admissible, 0)
        return self.kv_cache.num_free_blocks >= len(self.running) + prompt_blocks

    def _preemption_victim(self, plan: StepPlan) -> Request | None:
        """The newest running request this plan has not scheduled yet."""
        for request in reversed(self.running):
            if request.request_id not in plan.num_scheduled_tokens:
                return request
        return None

    def _schedule_running(
        self, plan: StepPlan, candidates: list[Request], token_budget: int, allow_preemption: bool
    ) -> int:
        """Running requests in the given order; blocks run out -> preempt the newest unscheduled one (or stop)."""
        for request in candidates:
            if token_budget <= 0:
                break
            if request.status == RequestStatus.PREEMPTED:
                continue  # a victim of an earlier request in this pass
            if self._length_limit_in_flight(request):
                continue  # async scheduling: finishes when the step in flight returns
            if request.num_drafts_in_flight is not None:
                continue  # where it resumes depends on the drafts the step in flight accepts
            if request.num_output_placeholders and self._speculates(request):
                continue  # a step ahead would be one token; after the step in flight, drafts can go too
            drafts = self._propose_drafts(request, token_budget)
            num_new = request.num_tokens_with_placeholders - request.num_computed_tokens
            if num_new > token_budget:
                if not self.enable_chunked_prefill:
                    continue  # never split (admission ran the prompt whole; a decode is one token)
                num_new = token_budget
            num_new += len(drafts)
            new_block_ids = self.kv_cache.allocate_slots(request, num_new)
            while new_block_ids is None and allow_preemption:
                victim = self._preemption_victim(plan)
                if victim is None:
                    break
                self.running.remove(victim)
                self._preempt(victim)
                plan.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    break
                new_block_ids = self.kv_cache.allocate_slots(request, num_new)
            if new_block_ids is None:
                if allow_preemption:
                    break
                continue
            plan.cached_requests.append(
                CachedRequestData(
                    request.request_id,
                    new_block_ids,
                    request.num_computed_tokens,
                    request.token_ids[request.num_tokens_sent :],
                )
            )
            request.num_tokens_sent = request.num_tokens
            self._advance(plan, request, num_new, len(drafts))
            if drafts:
                plan.spec_token_ids[request.request_id] = drafts
                request.num_drafts_in_flight = len(drafts)
                self.num_draft_tokens += len(drafts)
            elif request.steps_until_drafts:
                request.steps_until_drafts -= 1
            token_budget -= num_new
        return token_budget

    def _schedule_waiting(self, plan: StepPlan, token_budget: int) -> int:
        """Waiting requests in arrival order, unless this step had to preempt."""
        skipped: list[Request] = []
        while self.waiting and token_budget > 0 and len(self.running) < self.max_num_seqs:
            if plan.preempted_request_ids:
                break
            request = self.waiting[0]
            # A preempted request whose last step is still in flight waits for that step's token too; a structured
            # request waits for its grammar.
            if self._is_gated(request, plan) or request.num_output_placeholders or request.waits_for_grammar:
                skipped.append(self.waiting.popleft())
                continue
            if request.lora is not None and not self.lora_slots.can_run(request.lora.adapter_id):
                skipped.append(self.waiting.popleft())  # every slot is pinned by other running adapters
                continue
            computed_blocks, num_cached = self.kv_cache.get_computed_blocks(
                request, allow_sharing=request.gate_request_id is not None
            )
            num_new = request.num_tokens - num_cached
            if num_new > token_budget:
                if not self.enable_chunked_prefill:
                    break  # whole or not at all; the queue keeps its order (vLLM's behaviour)
                num_new = token_budget
            new_block_ids = self.kv_cache.allocate_slots(request, num_new, computed_blocks, num_cached)
            if new_block_ids is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            plan.new_requests.append(
                NewRequestData(
                    request.request_id,
                    request.prompt_token_ids,
                    request.output_token_ids,
                    request.sampling_params,
                    self.kv_cache.block_ids(request.request_id),
                    num_cached,
                    request.grammar_key,
                    self._acquire_lora(plan, request),
                )
            )
            request.num_tokens_sent = request.num_tokens
            self._advance(plan, request, num_new)
            token_budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return token_budget

    def _acquire_lora(self, plan: StepPlan, request: Request) -> int:
        """The slot of the request's adapter, which it pins while it runs (loaded by this plan if new there)."""
        adapter = request.lora
        if adapter is None:
            return -1
        assignment = self.lora_slots.acquire(adapter.adapter_id)
        if assignment.needs_load:
            plan.lora_loads.append(LoRALoad(adapter.name, assignment.slot, adapter.path, adapter.scaling))
            plan.lora_capacity = self.lora_capacity
        return assignment.slot

    def _release_lora(self, request: Request) -> None:
        if request.lora is not None:
            self.lora_slots.release(request.lora.adapter_id)

    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[RequestUpdate]:
        """Append the plan's sampled tokens (placeholders until now), finish requests that hit a stop condition.

        Requests finished or aborted since the plan was made are gone: their tokens are dropped.
        """
        updates = []
        for position, (request_id, token_ids) in enumerate(zip(result.request_ids, result.sampled_token_ids)):
            request = self.requests.get(request_id)
            if request is None:
                continue
            request.num_output_placeholders -= 1
            num_drafts = request.num_drafts_in_flight
            if num_drafts is not None:
                request.num_drafts_in_flight = None
                num_accepted = len(token_ids) - 1
                self.num_accepted_draft_tokens += num_accepted
                # One more draft than the last step accepted, and none for a while (doubling) after steps that
                # accepted none: a request whose drafts keep failing (sampling at a high temperature, text that
                # does not repeat) soon costs a row now and then, not num_speculative_tokens rows a step.
                request.max_next_drafts = num_accepted + 1
                request.num_failed_verifies = 0 if num_accepted else request.num_failed_verifies + 1
                if request.num_failed_verifies:
                    request.steps_until_drafts = min(2 ** (request.num_failed_verifies - 1), MAX_DRAFT_BACKOFF_STEPS)
                if request.status == RequestStatus.RUNNING:
                    # The rejected drafts' KV slots are rewritten by the tokens that really come there.
                    request.num_computed_tokens -= num_drafts - num_accepted
            step_logprobs = result.logprobs[position] if result.logprobs else None
            new_token_ids: list[int] = []
            new_logprobs: list = []
            finished = False
            for index, token_id in enumerate(token_ids):
                request.token_ids.append(token_id)
                new_token_ids.append(token_id)
                if step_logprobs is not None and step_logprobs[index] is not None:
                    new_logprobs.append(step_logprobs[index])
                finished = self._check_stop(request, token_id)
                if finished:
                    break  # tokens accepted after a stop are dropped
            if self.runner_keeps_sampled_tokens and request.status == RequestStatus.RUNNING:
                request.num_tokens_sent = request.num_tokens
            if finished:
                self._finish(request)
            updates.append(RequestUpdate(request, new_token_ids, new_logprobs, finished))
        return updates

    def _check_stop(self, request: Request, token_id: int) -> bool:
        params = request.sampling_params
        num_output = request.num_output_tokens
        if num_output >= params.min_tokens:
            if token_id in self.eos_token_ids and not params.ignore_eos:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if token_id in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return True
        if request.num_tokens >= self._length_limit(request):
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def finish_requests(
        self, request_ids: Iterable[str], status: RequestStatus, stop_reason: str | None = None
    ) -> None:
        """Abort, or stop on a stop string found by the detokenizer: blocks are freed at once."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status.is_finished:
                continue
            request.status = status
            request.stop_reason = stop_reason
            self._finish(request)

    def _finish(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
            self._release_lora(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache.free(request)
        del self.requests[request.request_id]
        # Told even when preempted: the runner still holds a seeded request's generator.
        self.finished_since_last_plan.append(request.request_id)
