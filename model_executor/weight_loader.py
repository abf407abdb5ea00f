"""Loads HF safetensors checkpoints tensor by tensor, each rank reading only its own slices."""

from __future__ import annotations

import enum
import json
import logging
import struct
from collections import Counter
from pathlib import Path
from typing import Any

from safetensors import safe_open
from torch import nn
from tqdm import tqdm

logger = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
# safetensors dtype names the loader accepts; anything else (FP8, integers) is a quantized or foreign tensor.
FLOAT_DTYPES = frozenset({"F32", "BF16", "F16"})


class CheckpointSkip(enum.Enum):
    """Why a model's `checkpoint_name_to_param` passes over a checkpoint tensor (None there means: not ours)."""

    OTHER_STAGE = "other_stage"
    """A tensor of another pipeline stage (its layer index or module lies outside this stage)."""
    UNUSED = "unused"
    """A known tensor the model does not use: rotary caches, an LM head tied to the embedding."""


def read_safetensors_names(path: Path) -> list[str]:
    """The tensor names in a safetensors file's header, read without mapping the file."""
    with open(path, "rb") as handle:
        (header_size,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_size))
    return [name for name in header if name != "__metadata__"]


def checkpoint_tensor_names(model_dir: Path) -> dict[Path, list[str]]:
    """Each safetensors file of the checkpoint with the tensor names it holds, in file order.

    With `model.safetensors.index.json` the files and names are its `weight_map` (a listed file that is absent is
    an error naming it); without, every `*.safetensors` file but `consolidated*` ones when others exist (Mistral
    repositories ship both layouts of the same weights), names read from each file's header.
    """
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_NAME
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        files: dict[Path, list[str]] = {model_dir / name: [] for name in sorted(set(weight_map.values()))}
        absent = [path.name for path in files if not path.is_file()]
        if absent:
            raise FileNotFoundError(f"{index_path} lists shards missing from {model_dir}: {', '.join(absent)}")
        for tensor_name, file_name in weight_map.items():
            files[model_dir / file_name].append(tensor_name)
        return files
    paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        from model_executor.checkpoint_checks import check_weight_format

        check_weight_format(model_dir)  # the clearer message for PyTorch-only weights
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    if any(not path.name.startswith("consolidated") for path in paths):
        paths = [path for path in paths if not path.name.startswith("consolidated")]
    return {path: read_safetensors_names(path) for path in paths}


def open_checkpoint(path: Path) -> Any:
    """The loader's one way to open a checkpoint file (a context manager over safetensors' lazy reader)."""
    return safe_open(path, framework="pt")


def architecture_name(model: nn.Module) -> str:
    """The HF architecture `model` was built for (its class name when the config names none)."""
    architectures = getattr(getattr(model, "config", None), "architectures", None)
    return architectures[0] if architectures else type(model).__name__


def load_safetensors_weights(model: nn.Module, model_dir: Path, show_progress: bool = True) -> None:
    """Fill every parameter of `model` from the checkpoint in `model_dir` through the layers' `load_weight`.

    The model classifies every checkpoint tensor with `checkpoint_name_to_param`: (parameter, shard id) is loaded, a
    `CheckpointSkip` is passed over, and None (or a parameter the model lacks) is a tensor this architecture does
    not know: one ValueError names them before anything loads. Only files holding a tensor this rank loads are
    opened (pipeline stages skip each other's shards). Raises on a non-float tensor and on parameters left unloaded.
    """
    files = checkpoint_tensor_names(model_dir)
    params = dict(model.named_parameters())
    plan: dict[Path, list[tuple[str, str, Any]]] = {}
    unknown: list[str] = []
    skipped: Counter[CheckpointSkip] = Counter()
    for path, tensor_names in files.items():
        for tensor_name in tensor_names:
            mapped = model.checkpoint_name_to_param(tensor_name)
            if isinstance(mapped, CheckpointSkip):
                skipped[mapped] += 1
            elif mapped is None or mapped[0] not in params:
                unknown.append(tensor_name)
            else:
                plan.setdefault(path, []).append((tensor_name, *mapped))
    if unknown:
        raise ValueError(f"{len(unknown)} checkpoint tensors are not used by {architecture_name(model)}: {unknown[:5]}")
    loaded: set[str] = set()
    with tqdm(
        total=sum(map(len, plan.values())), desc="loading weights", unit="tensor", disable=not show_progress
    ) as progress:
        for path, tensors in plan.items():
            with open_checkpoint(path) as checkpoint:
                slices = {tensor_name: checkpoint.get_slice(tensor_name) for tensor_name, _, _ in tensors}
                for tensor_name, tensor in slices.items():
                    # Loading casts to the model dtype: an FP8 or integer tensor would load as garbage, not fail.
                    if tensor.get_dtype() not in FLOAT_DTYPES:
                        raise ValueError(
                            f"checkpoint tensor {tensor_name} in {path.name} is {tensor.get_dtype()}; pagedserve "
                            f"loads {'/'.join(sorted(FLOAT_DTYPES))} tensors only (quantized checkpoints are not "
                            "supported)"
                        )
                for tensor_name, param_name, shard_id in tensors:
                    module_path, _, attribute = param_name.rpartition(".")
                    module = model.get_submodule(module_path)
                    module.load_weight(attribute, slices[tensor_name], shard_id)
                    loaded.add(param_name)
                    progress.update(1)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} has no weights for {missing[:5]} ({len(missing)} missing)")
    logger.info(
        "loaded %d parameters from %d of %d file(s) in %s (skipped: %d of other stages, %d unused)",
        len(loaded),
        len(plan),
        len(files),
        model_dir,
        skipped[CheckpointSkip.OTHER_STAGE],
        skipped[CheckpointSkip.UNUSED],
    )
