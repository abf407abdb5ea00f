"""The serving configuration: the engine's sections plus `serve` (the HTTP ingress and its engine replicas), one
YAML file."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, TypeAdapter, ValidationError, create_model, model_validator

from configs.engine_config import ENGINE_SECTIONS, VLLM_KEYWORD_ALIASES, EngineConfig, section_of_key
from configs.sections import ModelConfig, Section

CONFIG_DIR = Path(__file__).parent


class EngineAutoscalingConfig(Section):
    """Engine replicas that follow load, in Ray Serve's autoscaling_config names: the count targets
    `ongoing requests / target_ongoing_requests`, held for the delays before it moves."""

    min_replicas: int = Field(1, ge=0, description="Fewest engine replicas; 0 scales to zero when idle.")
    max_replicas: int = Field(1, ge=1, description="Most engine replicas.")
    initial_replicas: int | None = Field(
        None, ge=0, description="Engine replicas started with the app; defaults to min_replicas."
    )
    target_ongoing_requests: float = Field(
        16.0, gt=0, description="Requests in flight per engine replica (running, waiting or queued) to aim for."
    )
    upscale_delay_s: float = Field(5.0, ge=0, description="How long the load must ask for more replicas first.")
    downscale_delay_s: float = Field(30.0, ge=0, description="How long the load must ask for fewer replicas first.")
    downscale_to_zero_delay_s: float | None = Field(
        None,
        ge=0,
        description="Idle time before the last replica stops (min_replicas 0); defaults to downscale_delay_s.",
    )

    @model_validator(mode="after")
    def _bounds_in_order(self) -> EngineAutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} is above max_replicas {self.max_replicas}")
        initial = self.initial_replicas
        if initial is not None and not self.min_replicas <= initial <= self.max_replicas:
            raise ValueError(f"initial_replicas {initial} is outside [{self.min_replicas}, {self.max_replicas}]")
        return self


class ServeConfig(Section):
    """The HTTP side: where it listens, who may call it, its limits, and how many engines stand behind it."""

    host: str = Field("127.0.0.1", description="Address the HTTP server binds.")
    port: int = Field(8000, ge=1, le=65535, description="Port of the OpenAI API.")
    route_prefix: str = Field(
        "/",
        description="Route prefix that `pagedserve serve` deploys the app under; under `serve run` / `serve deploy` "
        "Serve's own route_prefix applies (the app reads it from each request's ASGI root_path).",
    )
    app_name: str = Field(
        "pagedserve",
        description="Ray Serve application name that `pagedserve serve` deploys; under `serve run` / `serve deploy` "
        "the app takes Serve's name. Engine actors are named after the Serve application name.",
    )
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
    engine_autoscaling: EngineAutoscalingConfig | None = Field(
        None,
        description="Engine replicas that follow load between min_replicas and max_replicas (replaces "
        "engine_replicas).",
    )
    routing: Literal["least_loaded", "prefix"] = Field(
        "least_loaded", description="How the ingress spreads requests over engine replicas."
    )
    routing_prefix_tokens: int = Field(256, ge=1, description="Prompt tokens that decide the replica for 'prefix'.")
    autoscaling_config: dict[str, Any] | None = Field(
        None, description="Ray Serve autoscaling_config for the ingress (replaces ingress_replicas)."
    )
    enable_auto_tool_choice: bool = Field(
        False, description="Let the model decide when to call tools (tool_choice 'auto'); needs tool_call_parser."
    )
    tool_call_parser: Literal["hermes", "llama3_json"] | None = Field(
        None,
        description="How tool calls are read from the model's text: 'hermes' (Qwen2.5/Qwen3 <tool_call> blocks), "
        "'llama3_json' (Llama 3.1/3.2 JSON calls).",
    )
    direct_ingress: bool | None = Field(
        None,
        description="The ingress replica serves HTTP on `port` itself, without the hop through Serve's proxy "
        "(which moves to port + 1): less CPU per streamed token. One ingress replica; an embedded Ray only. "
        "None: on where it applies (the Ray `pagedserve serve` starts, one ingress replica), off elsewhere.",
    )

    @model_validator(mode="after")
    def _auto_tool_choice_has_a_parser(self) -> ServeConfig:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("serve.enable_auto_tool_choice needs serve.tool_call_parser (--tool-call-parser)")
        return self

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


class _ModelEntryBase(Section):
    @model_validator(mode="before")
    @classmethod
    def _model_as_name(cls, values: Any) -> Any:
        # `model: DIR` is model.name, as at the top level.
        if isinstance(values, dict) and isinstance(values.get("model"), str | Path):
            values = {**values, "model": {"name": str(values["model"])}}
        return values


# One model of a multi-model app (Ray Serve LLM's `llm_configs` entry): its `model` section and any of the other engine
# sections it sets differently from the app's own, and its engine replica count.
ModelEntry = create_model(
    "ModelEntry",
    __base__=_ModelEntryBase,
    model=(ModelConfig, ...),
    engine_replicas=(int | None, Field(None, ge=1)),
    engine_autoscaling=(EngineAutoscalingConfig | None, None),
    **{name: (section | None, None) for name, section in ENGINE_SECTIONS.items() if name != "model"},
)


class AppConfig(EngineConfig):
    """The engine's sections plus `serve`; like the engine's keys, `serve`'s may be given flat (`api_key=...`).

    `models` serves several models behind one /v1: each entry's sections override the app's own, section by
    section (the app's sections are the entries' defaults)."""

    serve: ServeConfig = ServeConfig()
    models: list[ModelEntry] | None = Field(  # type: ignore[valid-type]
        None, min_length=1, description="Several models behind one /v1, each with its own engines."
    )

    @model_validator(mode="after")
    def _served_names_unique(self) -> AppConfig:
        names = [app.model_name for app in self.model_apps()]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"models: served model names must differ; {repeated} repeat (set served_model_name)")
        return self

    def model_apps(self) -> list[AppConfig]:
        """One single-model config per served model: the entry's sections over the app's, the entry's engine count."""
        if not self.models:
            return [self]
        apps = []
        for entry in self.models:
            sections = {}
            for name in ENGINE_SECTIONS:
                base = getattr(self, name).model_dump(exclude_unset=True)
                override = getattr(entry, name)
                sections[name] = {**base, **(override.model_dump(exclude_unset=True) if override else {})}
            serve_updates = {
                key: getattr(entry, key) for key in ("engine_replicas", "engine_autoscaling") if getattr(entry, key)
            }
            serve = self.serve.model_copy(update=serve_updates)
            apps.append(AppConfig.model_validate({**sections, "serve": serve}))
        return apps

    @model_validator(mode="before")
    @classmethod
    def _nest_flat_keys(cls, values: Any) -> Any:
        values = super()._nest_flat_keys(values)
        if not isinstance(values, dict):
            return values
        flat = {key: values.pop(key) for key in list(values) if key in ServeConfig.model_fields}
        if flat:
            base = values.get("serve", {})
            if isinstance(base, BaseModel):
                base = base.model_dump(exclude_unset=True)
            # As for the engine's sections, a flat key wins over the same key nested (a non-dict is validation's error).
            values["serve"] = {**base, **flat} if isinstance(base, dict) else base
        return values

    @classmethod
    def from_serve_args(cls, args: dict[str, Any]) -> AppConfig:
        """The config from a Serve application builder's `args`: sections nested or keys flat (vLLM's names,
        `model=DIR tensor_parallel_size=2`), optionally over a YAML preset (`config=configs/default.yaml`).

        `serve run IMPORT_PATH key=value` passes every value as a string: each is converted to its key's type in
        the schema where that type takes the string, else read as YAML (`null`, `{...}`, `[...]`).
        """
        args = {key: _typed_arg(key, value) if isinstance(value, str) else value for key, value in args.items()}
        preset = args.pop("config", None)
        try:
            values = cls._nest_flat_keys(args)
            if preset is not None:
                values = _merge_sections(cls._nest_flat_keys(_read_yaml(resolve_config_path(preset))), values)
            return cls.model_validate(values)
        except ValueError as error:  # pydantic's ValidationError included: it names the key
            raise ValueError(f"invalid application args: {error}") from None

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> AppConfig:
        """Load a preset; a bare name like `default` means configs/default.yaml. Flat keyword overrides win."""
        path = resolve_config_path(path)
        values = _read_yaml(path)
        try:
            return cls.model_validate({**values, **overrides})
        except ValidationError as error:
            raise ValueError(f"invalid config {path}: {error}") from error

    def engine_config(self) -> EngineConfig:
        """The engine replicas' config: the same sections, with Ray worker actors (a served engine is an actor)."""
        parallel = self.parallel.model_copy(update={"distributed_executor": "ray"})
        return EngineConfig(**{**self.engine_sections(), "parallel": parallel})


def resolve_config_path(path: str | Path) -> Path:
    """A path, or a bare preset name like `default` for configs/default.yaml."""
    path = Path(path)
    if not path.exists() and (CONFIG_DIR / f"{path.name}.yaml").exists():
        return CONFIG_DIR / f"{path.name}.yaml"
    return path


def _read_yaml(path: Path) -> dict[str, Any]:
    with open(path) as config_file:
        return yaml.safe_load(config_file) or {}


def _merge_sections(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`overrides` over `base`, section by section: a preset's other keys in a section stay."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def _field_annotation(key: str) -> Any:
    """The schema type a flat or section key of the app's args takes; None for keys the schema does not know."""
    if key == "model":
        return str  # a flat `model` is model.name
    if key in AppConfig.model_fields:
        return AppConfig.model_fields[key].annotation
    if key in VLLM_KEYWORD_ALIASES:
        return bool
    section_name = section_of_key(key)
    section = ENGINE_SECTIONS.get(section_name) if section_name else ServeConfig
    field = section.model_fields.get(key) if section is not None else None
    return field.annotation if field is not None else None


def _typed_arg(key: str, value: str) -> Any:
    """One string from `serve run ... key=value`, as its key's schema type where that takes it (`port=8000`,
    `enforce_eager=true`, `served_model_name=123`), else as YAML (`kv_cache_memory_gib=null`,
    `speculative_config={...}`, `dtype=half` for the field's own validator to map); an unknown key's value stays a
    string for validation to name."""
    annotation = _field_annotation(key)
    if annotation is None:
        return value
    try:
        return TypeAdapter(annotation).validate_python(value)
    except ValidationError:
        pass
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return value  # validation names the key and its type
    return None if parsed == "None" else parsed
