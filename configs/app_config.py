"""The serving configuration: one YAML file with model, cache, scheduler, parallel and serve sections."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from configs.engine_config import DEFAULT_MODEL, EngineConfig, SpeculativeConfig

CONFIG_DIR = Path(__file__).parent


class Section(BaseModel):
    # Unknown keys are rejected with the key named, so a typo never silently falls back to a default.
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


class ModelSection(Section):
    name: str = Field(DEFAULT_MODEL, description="Model alias or local HF directory.")
    served_model_name: str | None = Field(None, description="Model id in the API; defaults to the name.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: int | None = Field(None, ge=16)


class CacheSection(Section):
    block_size: int = Field(16, ge=1)
    kv_cache_memory_gib: float = Field(1.0, gt=0)
    num_kv_blocks: int | None = Field(None, ge=1)
    enable_prefix_caching: bool = True


class SchedulerSection(Section):
    max_num_batched_tokens: int = Field(512, ge=1)
    max_num_seqs: int = Field(128, ge=1)
    prioritize_prefill: bool = False
    stream_interval: int = Field(1, ge=1, description="Tokens per streamed chunk (first and last at once).")
    async_scheduling: bool | None = Field(None, description="Plan a step ahead; None: with one worker.")
    speculative_config: SpeculativeConfig | None = Field(None, description="n-gram drafts (see EngineConfig).")
    max_waiting_requests: int = Field(1024, ge=1, description="Queue cap; beyond it requests get 503 + Retry-After.")
    seed: int = 0


class ParallelSection(Section):
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    worker_num_cpus: float = Field(1.0, gt=0, description="Logical Ray CPUs per model worker.")
    num_threads: int | None = Field(None, ge=1, description="torch threads per worker; default cores / workers.")
    attention_backend: Literal["auto", "cpu", "torch", "triton"] = "auto"
    cuda_graphs: Literal["auto", "off", "padded"] = Field("auto", description="Decode CUDA graphs (see EngineConfig).")
    cuda_graph_max_batch_size: int = Field(256, ge=1, description="Largest decode batch captured as a graph.")
    greedy_screening: Literal["auto", "on", "off"] = Field(
        "auto", description="Greedy rows: bf16 LM head, exact fp32 argmax (see EngineConfig)."
    )
    transport: Literal["socket", "ray"] = Field(
        "socket", description="Steps and outputs over sockets, or as Ray calls (see EngineConfig)."
    )


class ServeSection(Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    route_prefix: str = "/"
    app_name: str = "pagedserve"
    ingress_replicas: int = Field(1, ge=1, description="Ray Serve replicas of the HTTP ingress.")
    max_ongoing_requests: int = Field(256, ge=1, description="Concurrent requests per ingress replica.")
    ingress_num_cpus: float = Field(0.5, ge=0)
    api_key: str | None = Field(
        None, description="Bearer key for /v1, /tokenize, /detokenize; falls back to $PAGEDSERVE_API_KEY."
    )
    cors_allow_origins: list[str] = Field(default_factory=list, description="Origins allowed by CORS ('*' = any).")
    max_body_bytes: int = Field(4 * 2**20, ge=1024, description="Largest request body accepted (413 beyond).")
    request_timeout_s: float | None = Field(
        None, gt=0, description="End-to-end limit per request: 504 (or an SSE error) and its blocks freed."
    )
    max_n: int = Field(64, ge=1, description="Largest n (completions per prompt) a request may ask for.")
    max_logit_bias_entries: int = Field(300, ge=1, description="Most logit_bias entries per request.")
    engine_replicas: int = Field(1, ge=1, description="Engine replicas (scheduler actor + workers) behind the ingress.")
    routing: Literal["least_loaded", "prefix"] = Field(
        "least_loaded", description="How the ingress spreads requests over engine replicas."
    )
    routing_prefix_tokens: int = Field(256, ge=1, description="Prompt tokens that decide the replica for 'prefix'.")
    autoscaling_config: dict[str, Any] | None = Field(
        None, description="Ray Serve autoscaling_config for the ingress (replaces ingress_replicas)."
    )
    direct_ingress: bool | None = Field(
        None,
        description="The ingress replica serves HTTP on `port` itself, without the hop through Serve's proxy "
        "(which moves to port + 1): less CPU per streamed token. One ingress replica; an embedded Ray only. "
        "None: on where it applies (the Ray `pagedserve serve` starts, one ingress replica), off elsewhere.",
    )

    @model_validator(mode="after")
    def _direct_ingress_has_one_replica(self) -> ServeSection:
        # Every direct-ingress replica binds a port of its own: more than one would need a balancer in front.
        if self.direct_ingress and (self.ingress_replicas > 1 or self.autoscaling_config is not None):
            raise ValueError("serve.direct_ingress serves from one ingress replica: set ingress_replicas to 1")
        if self.direct_ingress and self.port == 65535:
            raise ValueError("serve.direct_ingress puts Serve's proxy on port + 1: port must be below 65535")
        return self

    def uses_direct_ingress(self, owns_ray: bool) -> bool:
        """Whether the ingress replica serves `port` itself, for a Ray this process starts (owns_ray) or joins."""
        if self.direct_ingress is not None:
            return self.direct_ingress
        single_replica = self.ingress_replicas == 1 and self.autoscaling_config is None
        return owns_ray and single_replica and self.port < 65535


class AppConfig(Section):
    model: ModelSection = ModelSection()
    cache: CacheSection = CacheSection()
    scheduler: SchedulerSection = SchedulerSection()
    parallel: ParallelSection = ParallelSection()
    serve: ServeSection = ServeSection()

    @classmethod
    def from_yaml(cls, path: str | Path) -> AppConfig:
        """Load a preset; a bare name like `default` means configs/default.yaml."""
        path = Path(path)
        if not path.exists() and (CONFIG_DIR / f"{path.name}.yaml").exists():
            path = CONFIG_DIR / f"{path.name}.yaml"
        with open(path) as config_file:
            values = yaml.safe_load(config_file) or {}
        try:
            return cls.model_validate(values)
        except ValidationError as error:
            raise ValueError(f"invalid config {path}: {error}") from error

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model.name,
            served_model_name=self.model.served_model_name,
            dtype=self.model.dtype,
            device=self.model.device,
            max_model_len=self.model.max_model_len,
            **self.cache.model_dump(),
            **self.scheduler.model_dump(),
            **self.parallel.model_dump(),
            distributed_executor="ray",
        )
