"""The serving configuration: the engine's sections plus `serve` (the HTTP ingress and its engine replicas), one
YAML file."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from configs.engine_config import EngineConfig
from configs.sections import Section

CONFIG_DIR = Path(__file__).parent


class ServeConfig(Section):
    """The HTTP side: where it listens, who may call it, its limits, and how many engines stand behind it."""

    host: str = Field("127.0.0.1", description="Address the HTTP server binds.")
    port: int = Field(8000, ge=1, le=65535, description="Port of the OpenAI API.")
    route_prefix: str = Field("/", description="Path the app is served under.")
    app_name: str = Field("pagedserve", description="Ray Serve application name (engine actors are named after it).")
    ingress_replicas: int = Field(1, ge=1, description="Ray Serve replicas of the HTTP ingress.")
    max_ongoing_requests: int = Field(256, ge=1, description="Concurrent requests per ingress replica.")
    ingress_num_cpus: float = Field(0.5, ge=0, description="Logical Ray CPUs each ingress replica reserves.")
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
    def _direct_ingress_has_one_replica(self) -> ServeConfig:
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


class AppConfig(EngineConfig):
    """The engine's sections plus `serve`."""

    serve: ServeConfig = ServeConfig()

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> AppConfig:
        """Load a preset; a bare name like `default` means configs/default.yaml. Flat keyword overrides win."""
        path = Path(path)
        if not path.exists() and (CONFIG_DIR / f"{path.name}.yaml").exists():
            path = CONFIG_DIR / f"{path.name}.yaml"
        with open(path) as config_file:
            values = yaml.safe_load(config_file) or {}
        try:
            return cls.model_validate({**values, **overrides})
        except ValidationError as error:
            raise ValueError(f"invalid config {path}: {error}") from error

    def engine_config(self) -> EngineConfig:
        """The engine replicas' config: the same sections, with Ray worker actors (a served engine is an actor)."""
        parallel = self.parallel.model_copy(update={"distributed_executor": "ray"})
        return EngineConfig(**{**self.engine_sections(), "parallel": parallel})
