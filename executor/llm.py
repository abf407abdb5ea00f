"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from configs.engine_config import DEFAULT_MODEL, EngineConfig
from configs.sampling_params import SamplingParams
from executor.engine import LLMEngine
from executor.outputs import RequestOutput

Prompt = str | Sequence[int]
Message = dict[str, Any]


class LLM:
    """Batch generation over the same engine the server uses.

    `engine_args` are EngineConfig fields (max_num_seqs, max_num_batched_tokens, enable_prefix_caching, ...).
    """

    def __init__(self, model: str = DEFAULT_MODEL, show_progress: bool = True, **engine_args: Any):
        self.config = EngineConfig(model=model, **engine_args)
        self.engine = LLMEngine(self.config, show_progress=show_progress)
        self.tokenizer = self.engine.tokenizer
        self._request_counter = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is a string or a list of token ids.

        Raises ValueError naming the parameter on bad input, before any prompt of this call runs.
        """
        prompt_list = self._as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(prompt_list)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompt_list):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompt_list)} prompts")
        request_ids = [f"offline-{next(self._request_counter)}" for _ in prompt_list]
        added: list[str] = []
        try:
            for request_id, prompt, params in zip(request_ids, prompt_list, params_list):
                self.engine.add_request(request_id, prompt, params)
                added.append(request_id)
        except ValueError:
            self.engine.abort_request(added)
            raise
        return self._run_to_completion(request_ids, use_tqdm)

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
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            self.apply_chat_template(conversation, add_generation_prompt, continue_final_message)
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, continue_final_message: bool = False
    ) -> list[int]:
        if not messages:
            raise ValueError("messages must not be empty.")
        text = self.tokenizer.apply_chat_template(
            list(messages),
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
        )
        # The template already holds any special tokens the model expects.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _as_prompt_list(self, prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        prompt_list = list(prompts)
        if prompt_list and all(isinstance(item, int) for item in prompt_list):
            return [prompt_list]
        return prompt_list

    def _run_to_completion(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        with tqdm(total=len(request_ids), desc="generating", unit="req", disable=not use_tqdm) as progress:
            while wanted - finished.keys():
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        progress.update(1)
        return [finished[request_id] for request_id in request_ids]
