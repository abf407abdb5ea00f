"""LLMEngine: validation, tokenization, the step loop and detokenization around scheduler and runner."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from transformers import AutoTokenizer

from configs.engine_config import EngineConfig
from configs.sampling_params import SamplingParams
from executor.detokenizer import IncrementalDetokenizer
from executor.executors import make_executor
from executor.outputs import CompletionOutput, RequestOutput
from executor.request import Request, RequestStatus
from executor.scheduler import Scheduler
from model_executor.model_fetch import resolve_model
from model_executor.model_info import ModelInfo, load_model_info

logger = logging.getLogger(__name__)


@dataclass
class ChildState:
    """Engine-side view of one of a request's n completions."""

    request_id: str
    output: CompletionOutput
    detokenizer: IncrementalDetokenizer


@dataclass
class ParentState:
    output: RequestOutput
    children: list[ChildState] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(child.output.finished for child in self.children)


def child_request_id(parent_id: str, index: int) -> str:
    return f"{parent_id}#{index}"


def validate_prompt(prompt_token_ids: Sequence[int], params: SamplingParams, model_info: ModelInfo) -> int:
    """Checks that need the model; returns the request's effective max_tokens. Raises ValueError."""
    num_prompt = len(prompt_token_ids)
    max_model_len = model_info.max_model_len
    if num_prompt == 0:
        raise ValueError("prompt must not be empty.")
    out_of_vocab = [t for t in prompt_token_ids if not 0 <= t < model_info.vocab_size]
    if out_of_vocab:
        raise ValueError(
            f"prompt token id {out_of_vocab[0]} is out of the vocabulary (valid ids: 0..{model_info.vocab_size - 1})."
        )
    if num_prompt >= max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{num_prompt} input tokens. Please reduce the length of the input."
        )
    params.verify_against_vocab(model_info.vocab_size)
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
    capacity = num_kv_blocks * config.block_size
    if model_info.max_model_len <= capacity:
        return model_info
    if config.max_model_len is not None:
        raise ValueError(
            f"max_model_len {config.max_model_len} is larger than the KV cache can hold ({capacity} tokens in "
            f"{num_kv_blocks} blocks of {config.block_size}); raise kv_cache_memory_gib or lower max_model_len."
        )
    logger.warning("max_model_len lowered from %d to %d to fit the KV cache", model_info.max_model_len, capacity)
    return dataclasses.replace(model_info, max_model_len=capacity)


class LLMEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = True):
        self.config = config
        model_dir = resolve_model(config.model)
        self.model_info = load_model_info(model_dir, config)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.executor = make_executor(config, self.model_info, show_progress=show_progress)
        self.model_info = fit_context_to_kv_cache(self.model_info, config, self.executor.num_kv_blocks)
        self.scheduler = Scheduler(
            config, self.executor.num_kv_blocks, self.model_info.max_model_len, self.model_info.eos_token_ids
        )
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, tuple[str, int]] = {}

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return [int(token_id) for token_id in prompt]

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams) -> None:
        """Validate and queue a request (n completions). Raises ValueError and changes nothing on bad input."""
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_token_ids = self.tokenize(prompt)
        max_tokens = validate_prompt(prompt_token_ids, params, self.model_info)
        output = RequestOutput(request_id, prompt if isinstance(prompt, str) else None, prompt_token_ids)
        parent = ParentState(output)
        first_child_id = child_request_id(request_id, 0)
        for index in range(params.n):
            child_id = child_request_id(request_id, index)
            child_params = params
            if params.n > 1 and params.seed is not None:
                # Each completion draws its own random stream, reproducibly.
                child_params = dataclasses.replace(params, seed=params.seed + index)
            request = Request(child_id, prompt_token_ids, child_params, max_tokens, first_child_id if index else None)
            self.scheduler.add_request(request)
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                params.skip_special_tokens,
                params.stop,
                params.include_stop_str_in_output,
            )
            completion = CompletionOutput(index, "", [], logprobs=[] if params.logprobs is not None else None)
            parent.children.append(ChildState(child_id, completion, detokenizer))
            output.outputs.append(completion)
            self.child_to_parent[child_id] = (request_id, index)
        self.parents[request_id] = parent

    def abort_request(self, request_ids: Sequence[str]) -> None:
        """Stop requests now and free their KV blocks; unknown or finished ids are ignored."""
        for request_id in request_ids:
            parent = self.parents.pop(request_id, None)
            if parent is None:
                continue
            child_ids = [child.request_id for child in parent.children]
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            for child in parent.children:
                self.child_to_parent.pop(child.request_id, None)
                if not child.output.finished:
                    child.output.finish_reason = "abort"
            parent.output.finished = True

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that changed (finished ones have finished=True)."""
        plan = self.scheduler.schedule()
        result = self.executor.execute(plan)
        updates = self.scheduler.update_from_output(plan, result)
        changed: dict[str, ParentState] = {}
        for update in updates:
            parent_id, index = self.child_to_parent[update.request.request_id]
            parent = self.parents[parent_id]
            child = parent.children[index]
            completion = child.output
            stop_string = None
            for token_id in update.new_token_ids:
                completion.token_ids.append(token_id)
                stop_string = child.detokenizer.add_token(token_id)
            if completion.logprobs is not None:
                completion.logprobs.extend(update.new_logprobs)
            if stop_string is not None and not update.finished:
                self.scheduler.finish_requests([child.request_id], RequestStatus.FINISHED_STOPPED, stop_string)
            request = update.request
            if stop_string is not None:
                completion.finish_reason, completion.stop_reason = "stop", stop_string
            elif request.status.is_finished:
                completion.finish_reason, completion.stop_reason = request.finish_reason, request.stop_reason
            completion.text = child.detokenizer.output_text
            changed[parent_id] = parent
        for parent_id, parent in changed.items():
            if parent.finished:
                parent.output.finished = True
                del self.parents[parent_id]
                for child in parent.children:
                    self.child_to_parent.pop(child.request_id, None)
        return [parent.output for parent in changed.values()]
