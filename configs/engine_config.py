"""The engine's configuration: the sections of `configs/sections.py` composed into one frozen object, the way
vLLM's VllmConfig composes its parts. Built from YAML (nested) or from keyword arguments (flat, like `LLM(...)`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, model_validator

from configs.sections import (
    DEFAULT_MODEL,
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    RuntimeConfig,
    SchedulerConfig,
    Section,
    SpeculativeConfig,
)

__all__ = ["DEFAULT_MODEL", "EngineConfig", "LoRAConfig", "SpeculativeConfig", "section_of_key"]

ENGINE_SECTIONS: dict[str, type[Section]] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "runtime": RuntimeConfig,
    "lora": LoRAConfig,
}


# vLLM's keyword arguments that are a value of one of our keys: LLM(enforce_eager=True) == runtime.cuda_graphs "off".
VLLM_KEYWORD_ALIASES: dict[str, tuple[str, str, dict[Any, Any]]] = {
    "enforce_eager": ("runtime", "cuda_graphs", {True: "off", False: "auto"}),
}


def check_chunked_prefill_budget(enable_chunked_prefill: bool, max_num_batched_tokens: int, max_model_len: int) -> None:
    """Without chunked prefill a prompt (or a preempted request's tokens) runs whole in one step: the step must hold
    the longest context. Raises ValueError naming both numbers (vLLM's check)."""
    if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens {max_num_batched_tokens} is smaller than max_model_len {max_model_len}: with "
            "enable_chunked_prefill off a prompt is prefilled whole in one step, so a longer one could never run; "
            f"raise max_num_batched_tokens to at least {max_model_len}, lower max_model_len, or turn "
            "enable_chunked_prefill on."
        )


def section_of_key(key: str) -> str | None:
    """The engine section that declares a flat key (`block_size` -> `cache`; `model` means `model.name`)."""
    if key == "model":
        return "model"
    for section_name, section in ENGINE_SECTIONS.items():
        if key in section.model_fields:
            return section_name
    return None


class EngineConfig(Section):
    """Everything that shapes one engine replica. Accepts its sections nested (`cache={"block_size": 16}`) or any
    section's key flat (`block_size=16`, `model="dir"`), as vLLM's `LLM(...)` keyword arguments do."""

    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    lora: LoRAConfig = LoRAConfig()

    @model_validator(mode="before")
    @classmethod
    def _nest_flat_keys(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        nested: dict[str, Any] = {}
        flat: dict[str, dict[str, Any]] = {}
        for key, value in values.items():
            if key == "model" and isinstance(value, str | Path):
                flat.setdefault("model", {})["name"] = str(value)
            elif key in VLLM_KEYWORD_ALIASES:
                section_name, our_key, values_by_theirs = VLLM_KEYWORD_ALIASES[key]
                if value not in values_by_theirs:
                    raise ValueError(f"{key} must be one of {sorted(values_by_theirs, key=str)}, got {value!r}")
                flat.setdefault(section_name, {})[our_key] = values_by_theirs[value]
            elif key in cls.model_fields:
                nested[key] = value
            elif (section_name := section_of_key(key)) is not None:
                flat.setdefault(section_name, {})[key] = value
            else:
                nested[key] = value  # unknown: rejected by extra="forbid", naming the key
        for section_name, section_values in flat.items():
            base = nested.get(section_name, {})
            if isinstance(base, BaseModel):
                base = base.model_dump(exclude_unset=True)
            nested[section_name] = {**base, **section_values}
        return nested

    @model_validator(mode="after")
    def _check_async_scheduling(self) -> EngineConfig:
        if self.scheduler.async_scheduling and self.world_size > 1:
            # Other ranks learn sampled tokens from the plans, which async scheduling makes before they exist.
            raise ValueError("async_scheduling needs tensor_parallel_size = pipeline_parallel_size = 1")
        return self

    @model_validator(mode="after")
    def _check_unchunked_prefill_budget(self) -> EngineConfig:
        scheduler = self.scheduler
        if self.model.max_model_len:  # else the model's own length, checked by load_model_info
            check_chunked_prefill_budget(
                scheduler.enable_chunked_prefill, scheduler.max_num_batched_tokens, self.model.max_model_len
            )
        return self

    def uses_async_scheduling(self) -> bool:
        """Whether the scheduler actor plans the next step while the workers run this one."""
        if self.scheduler.async_scheduling is not None:
            return self.scheduler.async_scheduling
        return self.world_size == 1

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def model_name(self) -> str:
        """The id clients see."""
        return self.model.served_model_name or self.model.name

    def engine_sections(self) -> dict[str, Section]:
        return {name: getattr(self, name) for name in ENGINE_SECTIONS}

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> EngineConfig:
        """Load a preset's engine sections (a `serve` section is ignored); keyword overrides (flat) win."""
        with open(path) as config_file:
            values = yaml.safe_load(config_file) or {}
        values.pop("serve", None)
        return cls.model_validate(cls._nest_flat_keys({**values, **overrides}))
