"""Turns EngineOutputs (token ids) into text: incremental detokenization, stop strings, n > 1 aggregation.

Runs wherever text is needed: in the offline engine's process, and in each HTTP ingress replica.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from configs.sampling_params import SamplingParams
from executor.detokenizer import IncrementalDetokenizer
from executor.engine_core import EngineOutput
from executor.outputs import CompletionOutput, RequestOutput


@dataclass(slots=True)
class CompletionDelta:
    """What one completion gained in one step: for streaming."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Any]
    finish_reason: str | None
    stop_reason: str | int | None


@dataclass
class RequestState:
    output: RequestOutput
    detokenizers: list[IncrementalDetokenizer]
    deltas: list[CompletionDelta] = field(default_factory=list)


@dataclass(slots=True)
class ProcessedStep:
    changed: list[RequestState]
    """Requests that gained tokens; each one's `deltas` holds this step's deltas."""
    stop_strings: list[tuple[str, int, str]]
    """(request_id, index, stop string) to finish in the engine: the text already ends there."""


class OutputProcessor:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> RequestState:
        output = RequestOutput(request_id, prompt, list(prompt_token_ids))
        detokenizers = []
        for index in range(params.n):
            wants_logprobs = params.logprobs is not None
            output.outputs.append(
                CompletionOutput(
                    index,
                    "",
                    [],
                    logprobs=[] if wants_logprobs else None,
                    cumulative_logprob=0.0 if wants_logprobs else None,
                )
            )
            detokenizers.append(
                IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_token_ids,
                    params.skip_special_tokens,
                    params.stop,
                    params.include_stop_str_in_output,
                )
            )
        state = RequestState(output, detokenizers)
        self.requests[request_id] = state
        return state

    def abort_request(self, request_id: str) -> RequestState | None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            for completion in state.output.outputs:
                if completion.finish_reason is None:
                    completion.finish_reason = "abort"
            state.output.finished = True
        return state

    def process(self, engine_outputs: Iterable[EngineOutput]) -> ProcessedStep:
        changed: dict[str, RequestState] = {}
        stop_strings = []
        for engine_output in engine_outputs:
            state = self.requests.get(engine_output.request_id)
            if state is None:
                continue
            completion = state.output.outputs[engine_output.index]
            if completion.finish_reason is not None:
                continue  # stopped by a stop string while the engine was still producing
            detokenizer = state.detokenizers[engine_output.index]
            if engine_output.request_id not in changed:
                state.deltas = []
                changed[engine_output.request_id] = state
            stop_string = None
            num_kept = 0
            for token_id in engine_output.new_token_ids:
                completion.token_ids.append(token_id)
                num_kept += 1
                stop_string = detokenizer.add_token(token_id)
                if stop_string is not None:
                    break
            if completion.logprobs is not None:
                # Only the kept tokens' entries: a stop string can end the completion inside a step of several tokens.
                kept_logprobs = engine_output.new_logprobs[:num_kept]
                completion.logprobs.extend(kept_logprobs)
                completion.cumulative_logprob += sum(entry.logprob for entry in kept_logprobs)
            if stop_string is not None:
                completion.finish_reason, completion.stop_reason = "stop", stop_string
                if engine_output.finish_reason is None:
                    stop_strings.append((engine_output.request_id, engine_output.index, stop_string))
            elif engine_output.finish_reason is not None:
                completion.finish_reason = engine_output.finish_reason
                completion.stop_reason = engine_output.stop_reason
            completion.text = detokenizer.output_text
            state.deltas.append(
                CompletionDelta(
                    engine_output.index,
                    detokenizer.take_delta(completion.finish_reason is not None),
                    engine_output.new_token_ids,
                    engine_output.new_logprobs,
                    completion.finish_reason,
                    completion.stop_reason,
                )
            )
        for request_id, state in changed.items():
            if all(completion.finish_reason is not None for completion in state.output.outputs):
                state.output.finished = True
                del self.requests[request_id]
        return ProcessedStep(list(changed.values()), stop_strings)
