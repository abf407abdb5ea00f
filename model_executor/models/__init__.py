"""Model architectures by HF `architectures` name."""

from __future__ import annotations

from torch import nn

from model_executor.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
}


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    for architecture in architectures or ["LlamaForCausalLM"]:
        if architecture in MODEL_REGISTRY:
            return MODEL_REGISTRY[architecture]
    raise ValueError(f"model architectures {architectures} are not supported; supported: {sorted(MODEL_REGISTRY)}")
