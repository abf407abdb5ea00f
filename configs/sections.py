"""The engine's configuration sections, each field and default declared once (vLLM's ModelConfig, CacheConfig,
SchedulerConfig, ParallelConfig). `EngineConfig` composes them; the app's YAML adds a `serve` section."""

from __future__ import annotations

import json
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_MODEL = "smollm2-135m-instruct"
# vLLM's --dtype spellings that name the same precision.
DTYPE_ALIASES = {"float": "float32", "half": "float16"}
# The CPU's KV cache when the user names no budget (GPUs size theirs from gpu_memory_utilization).
DEFAULT_CPU_KV_CACHE_GIB = 1.0
# Environment variables that set a default (for processes the user does not configure directly); code reads the config.
DISABLE_CPU_KERNELS_ENV = "PAGEDSERVE_DISABLE_CPU_KERNELS"
KEEP_FREED_MEMORY_ENV = "PAGEDSERVE_KEEP_FREED_MEMORY"


class Section(BaseModel):
    # Unknown keys are rejected with the key named, so a typo never silently falls back to a default.
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


class ModelConfig(Section):
    """Which weights, in which precision, on which device."""

    name: str = Field(
        DEFAULT_MODEL,
        description="A model alias (see `pagedserve fetch-model`), a local HF dir or a Hugging Face hub id "
        "org/name[@revision].",
    )
    revision: str | None = Field(
        None, description="Branch, tag or commit of a hub id; None: the repo's default branch."
    )
    download_dir: str | None = Field(
        None,
        description="Hub cache dir for downloads (None: $HF_HUB_CACHE, else $HF_HOME/hub); a shared path all nodes "
        "see avoids per-node downloads.",
    )
    served_model_name: str | None = Field(None, description="Model id clients use; defaults to the name.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto picks CUDA when present.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="auto: the checkpoint's bfloat16/float16 on CUDA and on CPUs with bf16 dot products (AVX512-BF16 "
        "or AMX-BF16; float16 runs as bfloat16 there), float32 on other CPUs; a float32 checkpoint: float32 on CPU "
        "(exact against HF fp32), bfloat16 on CUDA.",
    )
    max_model_len: int | None = Field(None, ge=16, description="Context length; defaults to the model's own.")
    seed: int = Field(0, description="Seed of the engine's random state for unseeded requests.")
    generation_config: Literal["auto", "vllm"] = Field(
        "auto",
        description="auto: the model's generation_config.json supplies default temperature, top_p, top_k, min_p, "
        "repetition_penalty and max_tokens for requests that omit them; vllm: ignore it (vLLM's own defaults).",
    )
    max_logprobs: int = Field(
        20, ge=0, description="Most logprobs (and top_logprobs) a request may ask for (a 400 above it)."
    )

    @field_validator("dtype", mode="before")
    @classmethod
    def _canonical_dtype(cls, value: object) -> object:
        return DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value


class CacheConfig(Section):
    """The paged KV cache."""

    block_size: int = Field(16, ge=1, description="Tokens per KV-cache block.")
    # vLLM's --kv-cache-dtype; its fp8 caches are not built here, so they are refused rather than served as auto.
    kv_cache_dtype: Literal["auto"] = Field(
        "auto", description="The KV cache's dtype: auto, the model's (bfloat16 halves float32's bytes per token)."
    )
    kv_cache_memory_gib: float | None = Field(
        None,
        gt=0,
        description=f"KV cache budget in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE idea). None: {DEFAULT_CPU_KV_CACHE_GIB} on "
        "CPU; on CUDA what gpu_memory_utilization leaves after the weights and a profiled peak step.",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Share of the GPU's memory this engine may use (weights, activations, KV cache)."
    )
    num_kv_blocks: int | None = Field(None, ge=1, description="Exact number of KV blocks; overrides the budget.")
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of identical prompt prefixes.")


class SpeculativeConfig(Section):
    """Speculative decoding by n-gram lookup (vLLM's `"method": "ngram"`): a request's last tokens are looked up
    earlier in its own prompt and output, the tokens that followed there are proposed as drafts, and one step
    verifies them all. Tokens and their distribution are those of decoding one token a step."""

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


class SchedulerConfig(Section):
    """Continuous batching: what a step may hold, how requests queue, how outputs go out."""

    max_num_batched_tokens: int = Field(512, ge=1, description="Token budget of one engine step (chunked prefill).")
    max_num_seqs: int = Field(128, ge=1, description="Most requests running at once.")
    enable_chunked_prefill: bool = Field(
        True,
        description="Split long prompts into budget-sized chunks that share steps with decodes; off: a prompt is "
        "prefilled whole in one step (max_num_batched_tokens must then hold max_model_len).",
    )
    max_waiting_requests: int = Field(
        1024, ge=1, description="Most sequences queued for admission; beyond it requests are refused (503)."
    )
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
        "sample are placeholders until it returns); needs TP = PP = 1. None: on wherever TP = PP = 1.",
    )
    speculative_config: SpeculativeConfig | None = Field(
        None, description="Speculative decoding (n-gram drafts verified in one step); None: one token a step."
    )


class ParallelConfig(Section):
    """How the model is split over worker processes, and where Ray places them."""

    tensor_parallel_size: int = Field(1, ge=1, description="Ranks that split every layer (heads, MLP, vocab).")
    pipeline_parallel_size: int = Field(1, ge=1, description="Stages that split the layers.")
    distributed_executor: Literal["auto", "uniproc", "ray"] = Field(
        "auto", description="auto: in-process for TP=PP=1 offline use, Ray worker actors otherwise (always in serving)."
    )
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK", description="Ray placement-group strategy for the worker bundles (one bundle per worker)."
    )
    worker_num_cpus: float = Field(1.0, gt=0, description="Logical Ray CPUs each worker's bundle reserves.")
    num_threads: int | None = Field(
        None, ge=1, description="torch threads per model worker; default: the machine's cores split across workers."
    )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def parse_lora_module(text: str) -> dict[str, object]:
    """One `--lora-modules` entry: `name=path` or a JSON object (`{"name": ..., "path": ..., "base_model_name": ...}`).
    Raises ValueError naming what is wrong."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"LoRA module {text!r} is not valid JSON ({error.msg})") from None
        if not isinstance(value, dict):
            raise ValueError(f"LoRA module {text!r} must be a JSON object")
        return value
    name, separator, path = text.partition("=")
    if not separator or not name.strip() or not path.strip():
        raise ValueError(f"LoRA module {text!r} must be NAME=PATH or a JSON object with name and path")
    return {"name": name.strip(), "path": path.strip()}


class LoRAModule(Section):
    """One LoRA adapter loaded at start-up (vLLM's `--lora-modules` entry)."""

    name: str = Field(..., min_length=1, description="The adapter's name: the `model` a request names to use it.")
    path: str = Field(
        ...,
        min_length=1,
        description="Directory of a PEFT LoRA adapter (adapter_config.json and "
        "adapter_model.safetensors), readable on every worker's node.",
    )
    base_model_name: str | None = Field(
        None, description="The base model /v1/models lists as the adapter's parent; None: the served model name."
    )


class LoRAConfig(Section):
    """Multi-LoRA serving (vLLM's names): PEFT LoRA adapters on top of the base model, requested by name; requests
    for different adapters and for the base model share one batch."""

    enable_lora: bool = Field(False, description="Serve LoRA adapters (loaded at start or at run time).")
    max_loras: int = Field(
        1, ge=1, description="Most distinct adapters in one step (adapter slots on each worker); others wait."
    )
    max_lora_rank: int = Field(16, ge=1, description="Largest adapter rank accepted (the slots are sized for it).")
    lora_modules: list[LoRAModule] = Field(
        default_factory=list,
        description="Adapters loaded at start-up: NAME=PATH, or a JSON object with name, path and base_model_name.",
    )

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _name_equals_path(cls, value: object) -> object:
        # vLLM's short form `name=path` (the CLI, a YAML list of strings) beside the object form.
        if not isinstance(value, list):
            return value
        return [parse_lora_module(item) if isinstance(item, str) else item for item in value]

    @model_validator(mode="after")
    def _modules_need_lora_enabled(self) -> LoRAConfig:
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora (--enable-lora)")
        names = [module.name for module in self.lora_modules]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"lora_modules names must differ; {repeated} repeat")
        return self


def _cpu_kernels_default() -> Literal["auto", "off"]:
    return "off" if os.environ.get(DISABLE_CPU_KERNELS_ENV) == "1" else "auto"


def _keep_freed_memory_default() -> bool:
    return os.environ.get(KEEP_FREED_MEMORY_ENV) != "0"


class RuntimeConfig(Section):
    """Which kernels and data paths run the model: chosen once at start-up, never per call."""

    attention_backend: Literal["auto", "cpu", "torch", "triton"] = Field(
        "auto", description="auto: Triton paged attention on CUDA; on CPU our C++ kernels (cpu), else torch."
    )
    cuda_graphs: Literal["auto", "off", "padded"] = Field(
        "auto",
        description="auto: capture decode steps as CUDA graphs on CUDA (one pipeline stage); off: always eager; "
        "padded: pad decode steps to the graph buckets but run them eagerly (checks the graph path on CPU).",
    )
    cuda_graph_max_batch_size: int = Field(
        256, ge=1, description="Largest decode batch with a CUDA graph (capped at max_num_seqs); larger run eagerly."
    )
    greedy_screening: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Greedy rows on CPU without their full logits, the same tokens. fp32: the LM head in bf16, "
        "then fp32 logits only for the tokens within the bf16 error bound of the best (half the head's cost); auto: "
        "on CPUs with bf16 dot products (AVX512-BF16, AMX); on: anywhere (oneDNN emulates bf16 elsewhere, slower). "
        "bf16 on AMX (auto or on): each row's argmax kept as the head's tiles produce its logits. off: every row's "
        "logits.",
    )
    cpu_kernels: Literal["auto", "on", "off"] = Field(
        default_factory=_cpu_kernels_default,
        description="Our C++ CPU kernels (attention, linear panels, decoder stack). auto: where they build; on: "
        f"fail if they cannot; off: pure torch. Default off when ${DISABLE_CPU_KERNELS_ENV}=1.",
    )
    keep_freed_memory: bool = Field(
        default_factory=_keep_freed_memory_default,
        description="glibc keeps what a model step frees for the next step instead of returning pages to the "
        f"kernel (no page faults per step). Default off when ${KEEP_FREED_MEMORY_ENV}=0.",
    )
    transport: Literal["socket", "ray"] = Field(
        "socket",
        description="How the scheduler actor exchanges steps with the workers and outputs with the ingress: "
        "socket, a TCP connection each (a pickle and a send, no Ray task); ray, actor calls and a Ray streaming "
        "generator (for clusters where workers cannot open TCP connections to each other).",
    )
