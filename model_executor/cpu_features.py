"""What this process's CPU computes fast, probed once: a leaf module that layers and model_info may both import."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# The x86 features that give native bf16 dot products (elsewhere oneDNN emulates bf16, slower than fp32).
BF16_DOT_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags_from_proc() -> frozenset[str]:
    """The `flags` of /proc/cpuinfo (Linux x86); empty where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    flags_line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(flags_line.partition(":")[2].split())


@functools.cache
def cpu_has_bf16_dot_products() -> bool:
    """AVX512-BF16 or AMX-BF16 on this CPU: bf16 GEMMs several times fp32's rate. torch's own probe
    (`torch.cpu.get_capabilities`) where this torch has it, else /proc/cpuinfo."""
    get_capabilities = getattr(torch.cpu, "get_capabilities", None)
    if get_capabilities is not None:
        try:
            capabilities = get_capabilities()
        except RuntimeError as error:  # a torch built without cpuinfo support
            logger.debug("torch.cpu.get_capabilities failed (%s): reading /proc/cpuinfo", error)
        else:
            return any(bool(capabilities.get(flag, False)) for flag in BF16_DOT_FLAGS)
    return bool(BF16_DOT_FLAGS & cpu_flags_from_proc())


@functools.cache
def cpu_has_amx_bf16() -> bool:
    """AMX bf16 tiles on this CPU (Intel Xeon from Sapphire Rapids on): what oneDNN's bf16 GEMM runs on there."""
    return "amx_bf16" in cpu_flags_from_proc()
