"""The engine: scheduler, KV-cache manager, step loop, and the offline `LLM` API."""

from configs.sampling_params import SamplingParams, StructuredOutputsParams
from executor.engine import LLMEngine
from executor.llm import LLM
from executor.lora_request import LoRARequest
from executor.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = [
    "LLM",
    "CompletionOutput",
    "LLMEngine",
    "LoRARequest",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
