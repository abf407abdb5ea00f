"""LLMEngine: the offline engine in one process: tokenize, EngineCore steps, detokenize."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from transformers import AutoTokenizer

from configs.engine_config import EngineConfig
from configs.sampling_params import SamplingParams
from executor.engine_core import EngineCore
from executor.executors import make_executor
from executor.output_processor import OutputProcessor
from executor.outputs import RequestOutput
from model_executor.model_fetch import resolve_configured_model
from model_executor.model_info import load_model_info

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = True):
        self.config = config
        # In-process: this process is the worker too, so the weights come now (with the bar when it shows one).
        model_dir = resolve_configured_model(config.model, weights=True, show_progress=show_progress)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model_info = load_model_info(model_dir, config)
        self.core = EngineCore(config, model_info, make_executor(config, model_info, show_progress=show_progress))
        self.output_processor = OutputProcessor(self.tokenizer)

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def model_info(self):
        return self.core.model_info

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return [int(token_id) for token_id in prompt]

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams) -> None:
        """Validate and queue a request (n completions). Raises ValueError and changes nothing on bad input."""
        prompt_token_ids = self.tokenize(prompt)
        self.core.add_request(request_id, prompt_token_ids, params)
        self.output_processor.add_request(
            request_id, prompt if isinstance(prompt, str) else None, prompt_token_ids, params
        )

    def abort_request(self, request_ids: Sequence[str]) -> None:
        """Stop requests now and free their KV blocks; unknown or finished ids are ignored."""
        self.core.abort_request(request_ids)
        for request_id in request_ids:
            self.output_processor.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that changed (finished ones have finished=True)."""
        processed = self.output_processor.process(self.core.step())
        for request_id, index, stop_string in processed.stop_strings:
            self.core.stop_completion(request_id, index, stop_string)
        return [state.output for state in processed.changed]

    def shutdown(self) -> None:
        self.core.shutdown()
