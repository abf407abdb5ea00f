"""The engine: scheduler, KV-cache manager, step loop, and the offline `LLM` API."""

from configs.sampling_params import SamplingParams, StructuredOutputsParams
from executor.engine import LLMEngine
from executor.llm import LLM
from executor.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = [
    "LLM",
    "CompletionOutput",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
