"""Engine configuration: validated at the user boundary (Python kwargs, YAML presets)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_MODEL = "smollm2-135m-instruct"


class SpeculativeConfig(BaseModel):
    """Speculative decoding by n-gram lookup (vLLM's `"method": "ngram"`): a request's last tokens are looked up
    earlier in its own prompt and output, the tokens that followed there are proposed as drafts, and one step
    verifies them all. Tokens and their distribution are those of decoding one token a step."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram"] = Field("ngram", description="Where drafts come from: ngram, the request's own tokens.")
    num_speculative_tokens: int = Field(4, ge=1, description="Most drafts a request verifies in one step.")
    prompt_lookup_max: int = Field(4, ge=1, description="Longest suffix looked up (tried first).")
    prompt_lookup_min: int = Field(1, ge=1, description="Shortest suffix looked up.")
    disable_by_batch_size: int | None = Field(
        4,
        ge=1,
        description="No drafts while more requests than this run: a large batch is compute-bound, where every "
        "rejected draft costs as much as a real token. None: drafts at any batch size.",
    )

    @model_validator(mode="after")
    def _check_lookup_range(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min {self.prompt_lookup_min} is above prompt_lookup_max {self.prompt_lookup_max}"
            )
        return self


class EngineConfig(BaseModel):
    """Everything that shapes one engine replica: model, KV cache, batching limits, devices."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model: str = Field(DEFAULT_MODEL, description="A model alias (see `pagedserve fetch-model`) or a local HF dir.")
    served_model_name: str | None = Field(None, description="Model id clients use; defaults to `model`.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto picks CUDA when present.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: float32 on CPU (bf16 matmuls are slow there), bfloat16 on CUDA."
    )
    max_model_len: int | None = Field(None, ge=16, description="Context length; defaults to the model's own.")
    block_size: int = Field(16, ge=1, description="Tokens per KV-cache block.")
    kv_cache_memory_gib: float = Field(1.0, gt=0, description="Memory budget for the KV cache, in GiB.")
    num_kv_blocks: int | None = Field(None, ge=1, description="Exact number of KV blocks; overrides the budget.")
    max_num_batched_tokens: int = Field(512, ge=1, description="Token budget of one engine step (chunked prefill).")
    max_num_seqs: int = Field(128, ge=1, description="Most requests running at once.")
    prioritize_prefill: bool = Field(
        False,
        description="While requests wait and the KV cache has room, steps run prefills before running decodes: "
        "a burst gets its first tokens sooner while the streams already running pause.",
    )
    stream_interval: int = Field(
        1,
        ge=1,
        description="Tokens a stream collects before the scheduler actor hands them on (its first and last go at "
        "once): above 1, fewer SSE events per token and less CPU spent on streaming, in coarser chunks.",
    )
    async_scheduling: bool | None = Field(
        None,
        description="The scheduler actor plans the next step while the workers run this one (the tokens it will "
        "sample are placeholders until it returns); needs TP = PP = 1. None: on wherever TP = PP = 1 (CPU "
        "included: on the 2-core Intel VM 1.01-1.07x tokens/s and a lower TTFT in each of four alternated rounds).",
    )
    speculative_config: SpeculativeConfig | None = Field(
        None, description="Speculative decoding (n-gram drafts verified in one step); None: one token a step."
    )
    max_waiting_requests: int = Field(
        1024, ge=1, description="Most sequences queued for admission; beyond it requests are refused (503)."
    )
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of identical prompt prefixes.")
    seed: int = Field(0, description="Seed of the engine's random state for unseeded requests.")
    num_threads: int | None = Field(
        None, ge=1, description="torch threads per model worker; default: the machine's cores split across workers."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="Ranks that split every layer (heads, MLP, vocab).")
    pipeline_parallel_size: int = Field(1, ge=1, description="Stages that split the layers.")
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK", description="Ray placement-group strategy for the worker bundles (one bundle per worker)."
    )
    worker_num_cpus: float = Field(1.0, gt=0, description="Logical Ray CPUs each worker's bundle reserves.")
    attention_backend: Literal["auto", "cpu", "torch", "triton"] = Field(
        "auto", description="auto: Triton paged attention on CUDA; on CPU our C++ kernels (cpu), else torch."
    )
    cuda_graphs: Literal["auto", "off", "padded"] = Field(
        "auto",
        description="auto: capture decode steps as CUDA graphs on CUDA (one pipeline stage); off: always eager; "
        "padded: pad decode steps to the graph buckets but run them eagerly (checks the graph path on CPU).",
    )
    greedy_screening: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Greedy rows on CPU (fp32): the LM head in bf16, then fp32 logits only for the tokens within "
        "the bf16 error bound of the best; the same tokens, at about half the head's cost. auto: on CPUs with bf16 "
        "dot products (AVX512-BF16, AMX); on: anywhere (oneDNN emulates bf16 elsewhere, slower).",
    )
    transport: Literal["socket", "ray"] = Field(
        "socket",
        description="How the scheduler actor exchanges each step with the model workers and each step's outputs "
        "with the ingress replicas: socket, a TCP connection per worker and per ingress (a pickle and a send each "
        "way, no Ray task: less CPU beside the model's threads); ray, an actor call per step and a Ray streaming "
        "generator of outputs. Ray starts, health-checks and kills every process either way.",
    )
    cuda_graph_max_batch_size: int = Field(
        256, ge=1, description="Largest decode batch with a CUDA graph (capped at max_num_seqs); larger run eagerly."
    )
    distributed_executor: Literal["auto", "uniproc", "ray"] = Field(
        "auto", description="auto: in-process for TP=PP=1 offline use, Ray worker actors otherwise."
    )

    @model_validator(mode="after")
    def _check_async_scheduling(self) -> EngineConfig:
        if self.async_scheduling and self.world_size > 1:
            # Other ranks learn sampled tokens from the plans, which async scheduling makes before they exist.
            raise ValueError("async_scheduling needs tensor_parallel_size = pipeline_parallel_size = 1")
        return self

    def uses_async_scheduling(self) -> bool:
        """Whether the scheduler actor plans the next step while the workers run this one."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return self.world_size == 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def model_name(self) -> str:
        """The id clients see."""
        return self.served_model_name or self.model

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: object) -> EngineConfig:
        """Load a preset from configs/*.yaml; keyword overrides win over the file."""
        with open(path) as config_file:
            values = yaml.safe_load(config_file) or {}
        engine_values = values.get("engine", values)
        return cls(**{**engine_values, **overrides})
