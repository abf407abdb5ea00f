"""EngineCore: scheduler + executor in token ids only. The offline engine and the scheduler actor wrap it.

A request with n > 1 becomes n sequences `"{request_id}#{index}"`; the later ones wait until the first has
scheduled the shared prompt, then reuse its KV blocks.

LoRA adapters (`add_lora`, `remove_lora`, `list_loras`) are checked and registered here; a request names one in
`SamplingParams.lora_name`, and the scheduler ships it to the workers' slots when its first request runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from configs.engine_config import EngineConfig
from configs.sampling_params import SamplingParams
from executor.errors import EngineOverloadedError
from executor.executors import Executor
from executor.metrics import EngineMetrics
from executor.outputs import CoreStats
from executor.request import Request, RequestStatus
from executor.scheduler import Scheduler
from model_executor.lora import LoRAAdapter, read_lora_adapter
from model_executor.model_info import ModelInfo
from model_executor.models import check_architectures
from model_executor.step_plan import StepPlan
from model_executor.structured_output import GrammarCompiler, check_structured_outputs, grammar_key

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineOutput:
    """New tokens of one completion (request_id, index) from one engine step."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def copy(self) -> EngineOutput:
        """A copy whose token and logprob lists can be extended without touching the engine's."""
        return dataclasses.replace(self, new_token_ids=list(self.new_token_ids), new_logprobs=list(self.new_logprobs))

    def extend(self, later: EngineOutput) -> None:
        """Append a later step of the same completion: its tokens, and its finish if it has one."""
        self.new_token_ids.extend(later.new_token_ids)
        self.new_logprobs.extend(later.new_logprobs)
        self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason


def child_request_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


def validate_prompt(
    prompt_token_ids: Sequence[int], params: SamplingParams, max_model_len: int, vocab_size: int
) -> int:
    """Checks that need the model; returns the request's effective max_tokens. Raises ValueError.

    The ingress runs the same checks before a request reaches the scheduler; the engine runs them again.
    """
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise ValueError("prompt must not be empty.")
    out_of_vocab = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if out_of_vocab:
        raise ValueError(
            f"prompt token id {out_of_vocab[0]} is out of the vocabulary (valid ids: 0..{vocab_size - 1})."
        )
    if num_prompt >= max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{num_prompt} input tokens. Please reduce the length of the input."
        )
    params.verify_against_vocab(vocab_size)
    if params.max_tokens is None:
        return max_model_len - num_prompt
    if num_prompt + params.max_tokens > max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt + params.max_tokens} tokens ({num_prompt} in the prompt, {params.max_tokens} in "
            f"max_tokens). Please reduce the length of the prompt or max_tokens."
        )
    return params.max_tokens


def fit_context_to_kv_cache(model_info: ModelInfo, config: EngineConfig, num_kv_blocks: int) -> ModelInfo:
    """Every admitted request must fit the cache alone, or preemption could never make room for it."""
    capacity = num_kv_blocks * config.cache.block_size
    if model_info.max_model_len <= capacity:
        return model_info
    if config.model.max_model_len is not None:
        raise ValueError(
            f"max_model_len {config.model.max_model_len} is larger than the KV cache can ever hold: {capacity} tokens "
            f"({num_kv_blocks} blocks of {config.cache.block_size}); raise cache.kv_cache_memory_gib (or, on a GPU, "
            f"cache.gpu_memory_utilization) or lower max_model_len to at most {capacity}."
        )
    logger.warning("max_model_len lowered from %d to %d to fit the KV cache", model_info.max_model_len, capacity)
    return dataclasses.replace(model_info, max_model_len=capacity)


def log_kv_cache_capacity(num_kv_blocks: int, block_size: int, max_model_len: int) -> None:
    """Once at start-up, as vLLM does: the cache's size in tokens and how many full-length requests it holds at once."""
    max_concurrency = num_kv_blocks / -(-max_model_len // block_size)
    logger.info(
        "KV cache size: %d blocks, %d tokens. Maximum concurrency for %d tokens per request: %.2fx",
        num_kv_blocks,
        num_kv_blocks * block_size,
        max_model_len,
        max_concurrency,
    )


class EngineCore:
    def __init__(self, config: EngineConfig, model_info: ModelInfo, executor: Executor, engine_index: int = 0):
        self.config = config
        self.executor = executor
        try:
            self.model_info = fit_context_to_kv_cache(model_info, config, executor.num_kv_blocks)
            self.scheduler = Scheduler(
                config, executor.num_kv_blocks, self.model_info.max_model_len, self.model_info.eos_token_ids
            )
        except Exception:
            executor.shutdown()  # a refused configuration must not leave worker actors and their GPUs behind
            raise
        log_kv_cache_capacity(executor.num_kv_blocks, config.cache.block_size, self.model_info.max_model_len)
        self.metrics = EngineMetrics(config.model_name, engine_index)
        self.children: dict[str, list[str]] = {}  # request id -> its sequences' ids
        self.sequence_owner: dict[str, tuple[str, int]] = {}
        # Started on the workers, oldest first; two deep with async scheduling.
        self.steps_in_flight: deque[tuple[StepPlan, asyncio.Future]] = deque()
        self.num_steps_planned_ahead = 0  # started while another step was still running
        # Structured outputs: constraints compile here, off the step loop; the sampling rank gets each grammar once.
        info = self.model_info
        self.grammar_compiler = GrammarCompiler(info.model_dir, info.vocab_size, sorted(info.eos_token_ids))
        self.grammars_shipped: set[str] = set()
        self.tokenizer_info_shipped = False
        # Called (from the compile thread) when a grammar is ready: the scheduler actor's loop may be waiting for it.
        self.on_grammar_ready: Callable[[], None] | None = None
        # Finishes of requests whose grammar failed to compile, handed on with the next step's outputs.
        self.grammar_failures: list[EngineOutput] = []
        # LoRA adapters by name; ids are never reused, so a reloaded name never hits the old adapter's cached blocks.
        self.loras: dict[str, LoRAAdapter] = {}
        self.lora_ids = itertools.count(1)
        try:
            for module in config.lora.lora_modules:
                self.add_lora(module.name, module.path, module.base_model_name)
        except Exception:
            self.shutdown()
            raise

    @property
    def num_kv_blocks(self) -> int:
        return self.executor.num_kv_blocks

    @property
    def num_steps_in_flight(self) -> int:
        return len(self.steps_in_flight)

    def has_request(self, request_id: str) -> bool:
        """Whether any completion of the request is still queued or running here."""
        return request_id in self.children

    def add_lora(self, name: str, path: str, base_model_name: str | None = None) -> dict:
        """Check a PEFT LoRA adapter directory against the base model and register it under `name` (workers load it
        when a request first uses it). Returns what `list_loras` lists for it. Raises ValueError naming the cause:
        LoRA not enabled, a name in use (an adapter's or the base model's), no such directory, not a LoRA adapter,
        rank above max_lora_rank, target modules other than q/k/v/o/gate/up/down_proj, shapes of another model."""
        lora_config = self.config.lora
        if not lora_config.enable_lora:
            raise ValueError("LoRA adapters are not enabled: start the engine with enable_lora (--enable-lora)")
        if not isinstance(name, str) or not name:
            raise ValueError(f"a LoRA adapter's name must be a non-empty string, got {name!r}")
        if name in self.loras:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded (from {self.loras[name].path})")
        if name in (self.config.model_name, self.config.model.name):
            raise ValueError(f"{name!r} is the base model's name; give the LoRA adapter another")
        hf_config = self.model_info.hf_config
        adapter = read_lora_adapter(
            name,
            path,
            hf_config,
            check_architectures(hf_config),
            lora_config.max_lora_rank,
            next(self.lora_ids),
            base_model_name,
        )
        self.loras[name] = adapter
        logger.info("LoRA adapter %s registered: rank %d, %s", name, adapter.rank, ", ".join(adapter.target_modules))
        return adapter.describe()

    def remove_lora(self, name: str) -> bool:
        """Unload an adapter: True when it was loaded, False for an unknown name. Refused (ValueError) while any
        request, waiting or running, uses it: abort those or wait for them first."""
        adapter = self.loras.get(name)
        if adapter is None:
            return False
        users = [request.request_id for request in self.scheduler.requests.values() if request.lora is adapter]
        if users:
            raise ValueError(f"LoRA adapter {name!r} is in use by {len(users)} request(s); unload it when they finish")
        del self.loras[name]
        self.scheduler.lora_slots.forget(adapter.adapter_id)
        logger.info("LoRA adapter %s unloaded", name)
        return True

    def list_loras(self) -> list[dict]:
        """The loaded adapters, in load order: name, path, rank, alpha, target_modules, base_model_name, id."""
        return [adapter.describe() for adapter in self.loras.values()]

    def _request_lora(self, params: SamplingParams) -> LoRAAdapter | None:
        name = params.lora_name
        if name is None:
            return None
        adapter = self.loras.get(name)
        if adapter is None:
            if not self.config.lora.enable_lora:
                raise ValueError(f"lora_name {name!r}: LoRA adapters are not enabled on this engine (--enable-lora)")
            loaded = ", ".join(sorted(self.loras)) or "none"
            raise ValueError(f"LoRA adapter {name!r} is not loaded (loaded: {loaded})")
        return adapter

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Validate and queue; raises ValueError and changes nothing on bad input."""
        if request_id in self.children:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_token_ids = list(prompt_token_ids)
        if len(self.scheduler.waiting) + params.n > self.config.scheduler.max_waiting_requests:
            raise EngineOverloadedError(
                f"the engine is overloaded: {len(self.scheduler.waiting)} sequences are waiting "
                f"(max_waiting_requests {self.config.scheduler.max_waiting_requests}); retry later"
            )
        info = self.model_info
        max_tokens = validate_prompt(prompt_token_ids, params, info.max_model_len, info.vocab_size)
        params.verify_max_logprobs(self.config.model.max_logprobs)
        lora = self._request_lora(params)
        grammar, key = None, None
        if params.structured_outputs is not None:
            check_structured_outputs(params.structured_outputs)
            key = grammar_key(params.structured_outputs)
            grammar = self.grammar_compiler.submit(params.structured_outputs, self._grammar_ready)
        first_child = child_request_id(request_id, 0)
        child_ids = []
        for index in range(params.n):
            child_id = child_request_id(request_id, index)
            child_params = params
            if params.n > 1 and params.seed is not None:
                # Each completion draws its own random stream, reproducibly.
                child_params = dataclasses.replace(params, seed=params.seed + index)
            self.scheduler.add_request(
                Request(
                    child_id,
                    prompt_token_ids,
                    child_params,
                    max_tokens,
                    first_child if index else None,
                    grammar,
                    key,
                    lora,
                )
            )
            self.sequence_owner[child_id] = (request_id, index)
            child_ids.append(child_id)
        self.children[request_id] = child_ids
        self.metrics.increment(self.metrics.prompt_tokens, len(prompt_token_ids))

    def abort_request(self, request_ids: Sequence[str]) -> None:
        """Stop requests now and free their KV blocks; unknown or finished ids are ignored."""
        for request_id in request_ids:
            child_ids = self.children.pop(request_id, [])
            for child_id in child_ids:
                if child_id in self.scheduler.requests:
                    self._record_finish(self.scheduler.requests[child_id], "abort")
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            for child_id in child_ids:
                self.sequence_owner.pop(child_id, None)

    def abort_all_requests(self) -> int:
        """Stop every request now and free its blocks; returns how many there were."""
        request_ids = list(self.children)
        self.abort_request(request_ids)
        return len(request_ids)

    def stop_completion(self, request_id: str, index: int, stop_string: str) -> None:
        """A stop string was found downstream (by the detokenizer): finish that completion and free its blocks."""
        request = self.scheduler.requests.get(child_request_id(request_id, index))
        if request is not None:
            self._record_finish(request, "stop")
        self.scheduler.finish_requests(
            [child_request_id(request_id, index)], RequestStatus.FINISHED_STOPPED, stop_string
        )
        self._forget_if_done(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.grammar_failures)

    def step(self) -> list[EngineOutput]:
        if self.waits_only_for_grammars():
            # Nothing can run before a grammar compiles: wait for one rather than spin.
            pending = [request.grammar for request in self.scheduler.waiting if request.waits_for_grammar]
            concurrent.futures.wait(pending, timeout=1.0, return_when=concurrent.futures.FIRST_COMPLETED)
        plan = self._plan()
        result = self.executor.execute(plan)
        return self._collect(plan, result)

    def submit_step(self) -> bool:
        """Plan a step and start it on the workers, behind any still running. False: the plan had nothing to run
        (what it had to tell the runner waits for the next plan): a step is in flight, or every request waits for
        its grammar to compile (`waits_only_for_grammars`)."""
        self._fail_broken_grammars()
        if not self.steps_in_flight and self.waits_only_for_grammars():
            return False
        plan = self.scheduler.schedule()
        if self.steps_in_flight and not (plan.num_scheduled_tokens or plan.preempted_request_ids):
            self.scheduler.defer_runner_news(plan)
            return False
        self._ship_grammars(plan)
        self.num_steps_planned_ahead += bool(self.steps_in_flight)
        self.steps_in_flight.append((plan, self.executor.submit(plan)))
        return True

    def waits_only_for_grammars(self) -> bool:
        return self.scheduler.waits_only_for_grammars()

    def _plan(self) -> StepPlan:
        self._fail_broken_grammars()
        plan = self.scheduler.schedule()
        self._ship_grammars(plan)
        return plan

    def _grammar_ready(self) -> None:
        if self.on_grammar_ready is not None:
            self.on_grammar_ready()

    def _fail_broken_grammars(self) -> None:
        """A request whose grammar failed to compile finishes as aborted (the constraint passed the check before it
        was queued, so this is the grammar engine's own failure)."""
        for request in list(self.scheduler.waiting):
            grammar = request.grammar
            if grammar is None or not grammar.done() or grammar.exception() is None:
                continue
            logger.error("the grammar of %s failed to compile: %s", request.request_id, grammar.exception())
            self._record_finish(request, "abort")
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
            owner = self.sequence_owner.get(request.request_id)
            if owner is not None:
                self.grammar_failures.append(EngineOutput(owner[0], owner[1], [], [], "abort"))

    def _ship_grammars(self, plan: StepPlan) -> None:
        """The compiled grammars the plan's new requests need that the sampling rank has not had, and the ones it
        may forget."""
        for new in plan.new_requests:
            key = new.grammar_key
            if key is None or key in self.grammars_shipped:
                continue
            compiled = self.scheduler.requests[new.request_id].grammar.result()
            if not self.tokenizer_info_shipped:
                plan.grammar_tokenizer_info = self.grammar_compiler.tokenizer_info_payload()
                self.tokenizer_info_shipped = True
            plan.grammars[key] = compiled.payload
            self.grammars_shipped.add(key)
        if plan.grammars:
            in_use = {request.grammar_key for request in self.scheduler.requests.values()}
            evicted = self.grammar_compiler.evict(in_use)
            self.grammars_shipped.difference_update(evicted)
            plan.evicted_grammars.extend(evicted)

    async def finish_oldest_step(self) -> list[EngineOutput]:
        """Wait for the oldest step in flight; its sampled tokens, stops and finishes as outputs."""
        plan, pending = self.steps_in_flight.popleft()
        return self._collect(plan, await pending)

    def _record_tokens(self, request: Request, now: float) -> None:
        metrics = self.metrics
        if request.first_token_time is None:
            request.first_token_time = now
            metrics.observe(metrics.ttft, now - request.arrival_time)
        else:
            metrics.observe(metrics.itl, now - request.last_token_time)
        request.last_token_time = now

    def _record_finish(self, request: Request, finish_reason: str) -> None:
        metrics, now = self.metrics, time.monotonic()
        metrics.observe(metrics.e2e, now - request.arrival_time)
        if request.first_scheduled_time is not None:
            metrics.observe(metrics.queue_time, request.first_scheduled_time - request.arrival_time)
        metrics.increment(metrics.request_success, finished_reason=finish_reason)

    def _collect(self, plan, result) -> list[EngineOutput]:
        outputs, self.grammar_failures = self.grammar_failures, []
        finished_parents = {output.request_id for output in outputs}
        now = time.monotonic()
        num_new_tokens = 0
        for update in self.scheduler.update_from_output(plan, result):
            self._record_tokens(update.request, now)
            num_new_tokens += len(update.new_token_ids)
            if update.finished:
                self._record_finish(update.request, update.request.finish_reason)
            owner = self.sequence_owner.get(update.request.request_id)
            if owner is None:
                continue
            request_id, index = owner
            request = update.request
            outputs.append(
                EngineOutput(
                    request_id,
                    index,
                    update.new_token_ids,
                    update.new_logprobs,
                    request.finish_reason if update.finished else None,
                    request.stop_reason if update.finished else None,
                )
            )
            if update.finished:
                finished_parents.add(request_id)
        self.metrics.increment(self.metrics.generation_tokens, num_new_tokens)
        for request_id in finished_parents:
            self._forget_if_done(request_id)
        return outputs

    def _forget_if_done(self, request_id: str) -> None:
        child_ids = self.children.get(request_id, [])
        if all(child_id not in self.scheduler.requests for child_id in child_ids):
            self.children.pop(request_id, None)
            for child_id in child_ids:
                self.sequence_owner.pop(child_id, None)

    def abandon_steps_in_flight(self) -> None:
        """A step failed: the ones queued behind it are dropped (call on the event loop's thread)."""
        for _, pending in self.steps_in_flight:
            if pending.done() and not pending.cancelled():
                pending.exception()  # retrieved: the failure was already reported by the step that raised
            pending.cancel()
        self.steps_in_flight.clear()

    def stats(self) -> CoreStats:
        scheduler, kv_cache = self.scheduler, self.scheduler.kv_cache
        return CoreStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_free_blocks=kv_cache.num_free_blocks,
            num_kv_blocks=self.num_kv_blocks,
            kv_cache_usage=kv_cache.usage,
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=kv_cache.prefix_cache_queries,
            prefix_cache_hits=kv_cache.prefix_cache_hits,
            num_draft_tokens=scheduler.num_draft_tokens,
            num_accepted_draft_tokens=scheduler.num_accepted_draft_tokens,
            num_steps_planned_ahead=self.num_steps_planned_ahead,
            num_requests=len(self.children),
        )

    def metrics_text(self) -> bytes:
        """Prometheus exposition of this engine's metrics, gauges read now."""
        self.metrics.update(self.stats())
        return self.metrics.exposition()

    async def open_step_channels(self) -> None:
        """Send each step to the workers over a socket of their own from now on (call on the step loop's loop)."""
        await self.executor.open_step_channels()

    async def check_health(self) -> None:
        """Raises EngineDeadError when a model worker is gone or does not answer."""
        await self.executor.check_health_async()

    def worker_handles(self) -> list:
        """The model worker actors (none when the model runs in this process)."""
        return self.executor.worker_handles()

    @property
    def placement_group_id(self) -> str | None:
        return self.executor.placement_group_id

    def shutdown(self) -> None:
        self.grammar_compiler.shutdown()
        self.executor.shutdown()
