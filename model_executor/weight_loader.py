"""Loads HF safetensors checkpoints tensor by tensor, each rank reading only its own slices."""

from __future__ import annotations

import enum
import logging
from pathlib import Path

from safetensors import safe_open
from torch import nn
from tqdm import tqdm

logger = logging.getLogger(__name__)


class CheckpointSkip(enum.Enum):
    """Why a model's `checkpoint_name_to_param` passes over a checkpoint tensor (None there means: not ours)."""

    OTHER_STAGE = "other_stage"
    """A tensor of another pipeline stage (its layer index or module lies outside this stage)."""
    UNUSED = "unused"
    """A known tensor the model does not use: rotary caches, an LM head tied to the embedding."""


def load_safetensors_weights(model: nn.Module, model_dir: Path, show_progress: bool = True) -> None:
    """Fill every parameter of `model` from `model_dir/*.safetensors` through the layers' `load_weight`.

    The model maps checkpoint names with `checkpoint_name_to_param`; tensors it owns no parameter for (other
    pipeline stages, rotary caches) are skipped. Raises if a parameter is left unloaded.
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with tqdm(desc="loading weights", unit="tensor", disable=not show_progress) as progress:
        for file in files:
            with safe_open(file, framework="pt") as checkpoint:
                for checkpoint_name in checkpoint.keys():  # noqa: SIM118 (safe_open is not a dict)
                    progress.update(1)
                    mapped = model.checkpoint_name_to_param(checkpoint_name)
                    if mapped is None or mapped[0] not in params:
                        continue
                    param_name, shard_id = mapped
                    module_path, _, attribute = param_name.rpartition(".")
                    module = model.get_submodule(module_path)
                    module.load_weight(attribute, checkpoint.get_slice(checkpoint_name), shard_id)
                    loaded.add(param_name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} has no weights for {missing[:5]} ({len(missing)} missing)")
    logger.info("loaded %d parameters from %d file(s) in %s", len(loaded), len(files), model_dir)
