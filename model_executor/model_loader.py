"""Builds a rank's model shard: the architecture's class, its weights, and the kernels that will run it."""

from __future__ import annotations

import logging

import torch
from torch import nn

from model_executor.cpu_decode_stack import DecodeStackMixin, with_decode_stack
from model_executor.layers.linear import PackableWeight
from model_executor.model_info import ModelInfo
from model_executor.models import check_architectures
from model_executor.parallel_state import ParallelContext
from model_executor.weight_loader import load_safetensors_weights

logger = logging.getLogger(__name__)


def load_model(
    model_info: ModelInfo,
    parallel: ParallelContext,
    attention_backend: str,
    use_cpu_kernels: bool,
    show_progress: bool = True,
) -> nn.Module:
    """The model shard with its weights loaded, each linear layer's kernel chosen and its weight laid out for it.

    With `use_cpu_kernels` on a CPU, decode steps of a model family that has one run the C++ decoder stack
    (`model_executor.cpu_decode_stack`) where it applies; without, every matmul is torch's.
    """
    device = torch.device(model_info.device)
    model_class = check_architectures(model_info.hf_config)
    if use_cpu_kernels and device.type == "cpu":
        model_class = with_decode_stack(model_class)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(model_info.dtype)
    try:
        with torch.device(device):
            model = model_class(model_info.hf_config, parallel, attention_backend, device)
    finally:
        torch.set_default_dtype(previous_dtype)
    model.eval()
    load_safetensors_weights(model, model_info.model_dir, show_progress=show_progress)
    for module in model.modules():
        if isinstance(module, PackableWeight):
            module.pack_weights(use_cpu_kernels)
    if isinstance(model, DecodeStackMixin) and model.prepare_decode_stack():
        logger.info("decode steps run the decoder stack in one C++ call")
    return model
