"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, shaped as vLLM's `LLM`."""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import json
import logging
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path
from typing import Any

from tqdm import tqdm

from configs.engine_config import DEFAULT_MODEL, ENGINE_SECTIONS, VLLM_KEYWORD_ALIASES, EngineConfig
from configs.sampling_params import SamplingParams
from executor.engine import LLMEngine
from executor.engine_core import validate_prompt
from executor.errors import EngineOverloadedError
from executor.lora_request import LoRARequest
from executor.outputs import Logprob, RequestOutput, SampleLogprobs
from model_executor.model_info import generation_defaults

logger = logging.getLogger(__name__)

# vLLM's prompt dicts: TextPrompt {"prompt": str} and TokensPrompt {"prompt_token_ids": list[int]}.
PROMPT_KEYS = ("prompt", "prompt_token_ids")
Prompt = str | Mapping[str, Any] | Sequence[int]
Message = dict[str, Any]


@dataclass
class _PendingRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams


def _check_engine_args(engine_args: Mapping[str, Any]) -> None:
    """Unknown keyword arguments fail here, each named (with the closest known key), as an unknown argument does."""
    known = {"model", *ENGINE_SECTIONS, *VLLM_KEYWORD_ALIASES}
    known.update(key for section in ENGINE_SECTIONS.values() for key in section.model_fields)
    for key in engine_args:
        if key in known:
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TypeError(f"LLM() got an unexpected keyword argument {key!r}{hint}")


def _with_parsed_tool_arguments(message: Message) -> Message:
    """An assistant message's tool-call arguments as objects (templates read them so), from OpenAI's JSON text."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    parsed = []
    for call in calls:
        function = dict(call.get("function", {}))
        if isinstance(function.get("arguments"), str):
            function["arguments"] = json.loads(function["arguments"])
        parsed.append({**call, "function": function})
    return {**message, "tool_calls": parsed}


class LLM:
    """Batch generation over the same engine the server uses.

    `engine_args` are EngineConfig keys, flat (tensor_parallel_size, pipeline_parallel_size, dtype, max_model_len,
    gpu_memory_utilization, seed, max_num_seqs, enable_prefix_caching, ...) plus vLLM's `enforce_eager`.
    """

    def __init__(self, model: str = DEFAULT_MODEL, show_progress: bool = True, **engine_args: Any):
        _check_engine_args(engine_args)
        self.config = EngineConfig(model=model, **engine_args)
        self.engine = LLMEngine(self.config, show_progress=show_progress)
        self.tokenizer = self.engine.tokenizer
        self._request_counter = itertools.count()
        self._default_sampling_params: dict[str, Any] | None = None
        self._token_texts: dict[int, str] = {}

    def get_tokenizer(self) -> Any:
        """The HF tokenizer that encodes string prompts and decodes outputs."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no SamplingParams: the sampling defaults the model ships in
        generation_config.json (vLLM's), or SamplingParams() under generation_config "vllm" or when it has none."""
        if self._default_sampling_params is None:
            self._default_sampling_params = generation_defaults(
                self.engine.model_info.model_dir, self.config.model.generation_config
            )
        return SamplingParams(**self._default_sampling_params)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is a string, {"prompt": str}, {"prompt_token_ids":
        [ids]} or a list of token ids; `prompts` is one prompt or a list of them. `lora_request`: the LoRA adapter
        for every prompt, or one (or None: the base model) per prompt; an adapter not loaded yet is loaded first.

        Raises TypeError on a prompt of another type, and ValueError naming the parameter on bad values, before any
        prompt of this call runs.
        """
        prompt_list = self._as_prompt_list(prompts)
        default_max_tokens = False
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
            default_max_tokens = "max_tokens" in (self._default_sampling_params or {})
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        elif isinstance(sampling_params, Sequence) and all(isinstance(p, SamplingParams) for p in sampling_params):
            params_list = list(sampling_params)
        else:
            raise TypeError(
                f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}"
            )
        if len(params_list) != len(prompt_list):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompt_list)} prompts")
        params_list = self._with_lora(params_list, lora_request)
        pending = [
            self._prepare(f"offline-{next(self._request_counter)}", prompt, params, default_max_tokens)
            for prompt, params in zip(prompt_list, params_list)
        ]
        return self._run_to_completion(pending, use_tqdm)

    def _with_lora(
        self, params_list: list[SamplingParams], lora_request: LoRARequest | Sequence[LoRARequest | None] | None
    ) -> list[SamplingParams]:
        """Each prompt's params naming its adapter (loaded here on first use)."""
        if lora_request is None:
            return params_list
        if isinstance(lora_request, LoRARequest):
            requests = [lora_request] * len(params_list)
        elif isinstance(lora_request, Sequence) and all(r is None or isinstance(r, LoRARequest) for r in lora_request):
            requests = list(lora_request)
        else:
            raise TypeError(f"lora_request must be a LoRARequest or a list of them, got {type(lora_request).__name__}")
        if len(requests) != len(params_list):
            raise ValueError(f"got {len(requests)} LoRA requests for {len(params_list)} prompts")
        for request in {request for request in requests if request is not None}:
            self._load_lora(request)
        return [
            params if request is None else dataclasses.replace(params, lora_name=request.lora_name)
            for params, request in zip(params_list, requests)
        ]

    def _load_lora(self, request: LoRARequest) -> None:
        core = self.engine.core
        loaded = {adapter["name"]: adapter for adapter in core.list_loras()}
        adapter = loaded.get(request.lora_name)
        if adapter is None:
            core.add_lora(request.lora_name, request.lora_path, request.base_model_name)
        elif adapter["path"] != str(Path(request.lora_path).expanduser()):
            raise ValueError(
                f"LoRA adapter {request.lora_name!r} is loaded from {adapter['path']}, not {request.lora_path}: give "
                "another adapter another name"
            )

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now rather than on its first request; True once it is loaded (or was already)."""
        self._load_lora(lora_request)
        return True

    def remove_lora(self, lora_name: str) -> bool:
        """Unload an adapter by name; False when none of that name is loaded."""
        return self.engine.core.remove_lora(lora_name)

    def list_loras(self) -> list[dict[str, Any]]:
        """The loaded adapters: name, path, rank, alpha, target_modules, base_model_name, id."""
        return self.engine.core.list_loras()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (as vLLM's `LLM.reset_prefix_cache`); False, and nothing done, while
        requests are running (between `generate` calls none is)."""
        scheduler = self.engine.scheduler
        if scheduler.has_unfinished_requests():
            return False
        scheduler.kv_cache.reset_prefix_cache()
        return True

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        use_tqdm: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate. `tools`:
        OpenAI-shaped tool definitions the template shows the model (its calls come back as text, as in vLLM);
        `lora_request` as in `generate`."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            self.apply_chat_template(conversation, add_generation_prompt, continue_final_message, tools)
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        if not messages:
            raise ValueError("messages must not be empty.")
        text = self.tokenizer.apply_chat_template(
            [_with_parsed_tool_arguments(message) for message in messages],
            tools=list(tools) if tools else None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
        )
        # The template already holds any special tokens the model expects.
        return self.tokenizer.encode(text, add_special_tokens=False)

    @staticmethod
    def _is_token_ids(value: Any) -> bool:
        return (
            isinstance(value, Sequence)
            and not isinstance(value, str | bytes)
            and bool(value)
            and all(isinstance(token_id, Integral) and not isinstance(token_id, bool) for token_id in value)
        )

    def _as_prompt_list(self, prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str | Mapping) or self._is_token_ids(prompts):
            return [prompts]
        if isinstance(prompts, Sequence) and not isinstance(prompts, bytes):
            return list(prompts)
        raise TypeError(
            "prompts must be a string, a {'prompt': str} or {'prompt_token_ids': [int, ...]} dict, a list of token "
            f"ids, or a list of these; got {type(prompts).__name__}"
        )

    def _prepare(
        self, request_id: str, prompt: Any, params: SamplingParams, default_max_tokens: bool = False
    ) -> _PendingRequest:
        """Tokenize one prompt and run the engine's checks on it, so bad input fails before anything runs.

        `default_max_tokens`: params.max_tokens is the model's default, not the caller's: capped at the room the
        prompt leaves in the context (nobody asked for more), as the server does.
        """
        text: str | None = None
        if isinstance(prompt, Mapping):
            unknown = sorted(set(prompt) - set(PROMPT_KEYS))
            if unknown:
                raise ValueError(f"prompt key {unknown[0]!r} is not supported (use 'prompt' or 'prompt_token_ids')")
            if len(prompt) != 1:
                raise ValueError("a prompt dict holds exactly one of 'prompt' (text) and 'prompt_token_ids'")
            if "prompt" in prompt:
                prompt = prompt["prompt"]
                if not isinstance(prompt, str):
                    raise TypeError(f"'prompt' must be a string, got {type(prompt).__name__}")
            else:
                prompt = prompt["prompt_token_ids"]
                if not isinstance(prompt, Sequence) or isinstance(prompt, str | bytes):
                    raise TypeError(f"'prompt_token_ids' must be a list of ints, got {type(prompt).__name__}")
        if isinstance(prompt, str):
            text = prompt
            token_ids = self.engine.tokenize(prompt)
        elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
            bad = [token_id for token_id in prompt if not isinstance(token_id, Integral) or isinstance(token_id, bool)]
            if bad:
                raise TypeError(f"prompt token ids must be ints, got {bad[0]!r}")
            token_ids = [int(token_id) for token_id in prompt]
        else:
            raise TypeError(
                "each prompt must be a string, a {'prompt': str} or {'prompt_token_ids': [int, ...]} dict, or a list "
                f"of token ids; got {type(prompt).__name__}"
            )
        info = self.engine.model_info
        room = info.max_model_len - len(token_ids)
        if default_max_tokens and params.max_tokens is not None and 1 <= room < params.max_tokens:
            params = dataclasses.replace(params, max_tokens=room)
        params.verify_max_logprobs(self.config.model.max_logprobs)
        validate_prompt(token_ids, params, info.max_model_len, info.vocab_size)
        if params.n > self.config.scheduler.max_waiting_requests:
            raise ValueError(
                f"n must be at most max_waiting_requests ({self.config.scheduler.max_waiting_requests}), got {params.n}"
            )
        return _PendingRequest(request_id, text, token_ids, params)

    def _run_to_completion(self, pending: list[_PendingRequest], use_tqdm: bool) -> list[RequestOutput]:
        """Feed the requests in as the engine's waiting queue has room (any number of prompts), step to the end."""
        finished: dict[str, RequestOutput] = {}
        queue = deque(pending)
        added: list[str] = []
        try:
            with tqdm(total=len(pending), desc="generating", unit="req", disable=not use_tqdm) as progress:
                while queue or len(finished) < len(added):
                    while queue:
                        request = queue[0]
                        try:
                            self.engine.add_request(request.request_id, request.prompt_token_ids, request.params)
                        except EngineOverloadedError:
                            if not self.engine.has_unfinished_requests():
                                raise  # nothing running could ever make room
                            break  # the waiting queue is full of this call's requests: step until some start
                        added.append(queue.popleft().request_id)
                    for output in self.engine.step():
                        if output.finished:
                            finished[output.request_id] = output
                            progress.update(1)
        except BaseException:
            # An interrupted or failed call leaves nothing behind to run in the next one.
            self.engine.abort_request([request_id for request_id in added if request_id not in finished])
            raise
        outputs = []
        for request in pending:
            output = finished[request.request_id]
            output.prompt = request.prompt
            for completion in output.outputs:
                if completion.logprobs is not None:
                    completion.logprobs = self._as_sample_logprobs(completion.logprobs)
            outputs.append(output)
        return outputs

    def _token_text(self, token_id: int) -> str:
        # As vLLM's decoded_token: the token decoded alone (cached: the same ids recur across positions).
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _as_sample_logprobs(self, entries: list[Any]) -> SampleLogprobs:
        """The sampler's TokenLogprobs as vLLM's per-position dicts: the sampled token first, then the top ones."""
        sample_logprobs = []
        for entry in entries:
            position = {entry.token_id: Logprob(entry.logprob, entry.rank, self._token_text(entry.token_id))}
            for top_rank, (token_id, logprob) in enumerate(entry.top_logprobs, start=1):
                position.setdefault(token_id, Logprob(logprob, top_rank, self._token_text(token_id)))
            sample_logprobs.append(position)
        return sample_logprobs
