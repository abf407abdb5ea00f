"""vLLM's `LoRARequest`: which adapter serves an offline request, loaded by `LLM.generate` on first use."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name` is the adapter's name in the engine; `lora_path` its PEFT directory. `lora_int_id` is vLLM's
    caller-chosen id, kept for its API (here the name identifies the adapter)."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must name the adapter's directory, got {self.lora_path!r}")
