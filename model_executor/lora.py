"""LoRA adapters in PEFT's format, served beside the base model in one batch (vLLM's multi-LoRA).

The engine (`read_lora_adapter`) checks an adapter before any worker sees it: its config, its rank against
`max_lora_rank`, its target modules and every tensor's shape against the base model, from the safetensors header
alone. Each worker holds `max_loras` slots: per LoRA-targeted linear layer and per projection of it, A stacked as
[max_loras, max_lora_rank, in] and B as [max_loras, out, max_lora_rank], zero past an adapter's rank. A step's plan
names the adapters it loads into slots (name, slot, path); each worker reads its own tensor-parallel slices from
the path, as it does the base weights (`LoRASlots.load`). Each step every row carries its request's slot (-1: the
base model) and the layers add `scaling * x A^T B^T` to the rows of each slot, accumulated in fp32; base rows are
not touched.

Adapters may target q/k/v/o/gate/up/down_proj (or, where the checkpoint fuses them, as Phi-3's does, qkv_proj and
gate_up_proj); others (embeddings, the LM head, DoRA, biases, per-module rank patterns) are refused by name.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cuda_ext.lora_ops import add_lora
from model_executor.layers.linear import LoRAHook, LoRASlice
from model_executor.models.decoder import config_head_dim

logger = logging.getLogger(__name__)

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# Checkpoint projections an adapter may target, and the decoder submodule each lives in.
PROJECTION_PARENTS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "qkv_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
    "gate_up_proj": "mlp",
}
# The projections every family has unfused (the others exist only where the family's checkpoint fuses them).
UNFUSED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A linear layer's shard id -> the index of its LoRA slice (None: the fused tensor covers every slice).
SHARD_SLICES: dict[Any, int | None] = {"q": 0, "k": 1, "v": 2, 0: 0, 1: 1, "qkv": None, "gate_up": None}
_ADAPTER_KEY = re.compile(r"(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight")
# adapter_config.json keys that ask for something these layers do not do (each is falsy when it asks for nothing).
_REFUSED_SETTINGS = {
    "use_dora": "DoRA adapters are not supported",
    "lora_bias": "LoRA biases are not supported",
    "rank_pattern": "per-module ranks (rank_pattern) are not supported",
    "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
    "modules_to_save": "modules_to_save (fully trained extra modules) are not supported",
    "trainable_token_indices": "trainable token embeddings are not supported",
    "target_parameters": "target_parameters (LoRA on raw parameters) is not supported",
    "layer_replication": "layer_replication is not supported",
}


@dataclass(frozen=True)
class LoRAAdapter:
    """A checked adapter: what the engine keeps and the plan ships (path and scaling) to the workers."""

    name: str
    path: str
    rank: int
    alpha: float
    scaling: float
    target_modules: tuple[str, ...]
    adapter_id: int
    """Unique for the engine's life (never reused after an unload): the prefix cache keys blocks by it."""
    base_model_name: str | None = None

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.path,
            "rank": self.rank,
            "alpha": self.alpha,
            "target_modules": list(self.target_modules),
            "base_model_name": self.base_model_name,
            "id": self.adapter_id,
        }


def lora_target_layers(model_class: type[nn.Module]) -> dict[str, tuple[str, int | None]]:
    """Checkpoint projection an adapter may target -> (our layer's name in its decoder submodule, the LoRA slice of
    that layer it is; None: a fused checkpoint tensor covering every slice)."""
    targets: dict[str, tuple[str, int | None]] = {"o_proj": ("o_proj", 0), "down_proj": ("down_proj", 0)}
    for checkpoint_name, (layer_name, shard_id) in model_class.packed_modules_mapping.items():
        targets[checkpoint_name] = (layer_name, SHARD_SLICES[shard_id])
    return targets


def _projection_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """Checkpoint projection -> (out features, in features) of the base model's weight."""
    hidden, intermediate = hf_config.hidden_size, hf_config.intermediate_size
    head_dim = config_head_dim(hf_config)
    q_rows = hf_config.num_attention_heads * head_dim
    kv_rows = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    kv_rows *= head_dim
    return {
        "q_proj": (q_rows, hidden),
        "k_proj": (kv_rows, hidden),
        "v_proj": (kv_rows, hidden),
        "qkv_proj": (q_rows + 2 * kv_rows, hidden),
        "o_proj": (hidden, q_rows),
        "gate_proj": (intermediate, hidden),
        "up_proj": (intermediate, hidden),
        "gate_up_proj": (2 * intermediate, hidden),
        "down_proj": (hidden, intermediate),
    }


def _read_adapter_config(directory: Path) -> dict[str, Any]:
    if not directory.is_dir():
        raise ValueError(f"LoRA adapter directory {str(directory)!r} does not exist")
    config_path = directory / ADAPTER_CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"LoRA adapter {str(directory)!r} has no {ADAPTER_CONFIG_FILE} (a PEFT adapter directory)")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"LoRA adapter {str(directory)!r}: cannot read {ADAPTER_CONFIG_FILE}: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {str(directory)!r}: {ADAPTER_CONFIG_FILE} is not a JSON object")
    return config


def _check_settings(directory: Path, config: dict[str, Any]) -> tuple[int, float, float]:
    """(rank, alpha, scaling) of a LoRA adapter config; ValueError for another PEFT method or a refused setting."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"adapter {str(directory)!r} is a {peft_type} adapter; only LoRA adapters are supported")
    for key, reason in _REFUSED_SETTINGS.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {str(directory)!r}: {reason} ({key} = {config[key]!r})")
    if config.get("bias", "none") != "none":
        raise ValueError(
            f"LoRA adapter {str(directory)!r}: trained biases are not supported (bias = {config['bias']!r})"
        )
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {str(directory)!r}: r must be a positive integer, got {rank!r}")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ValueError(f"LoRA adapter {str(directory)!r}: lora_alpha must be a number, got {alpha!r}")
    # PEFT's scaling: alpha / r, or alpha / sqrt(r) for rank-stabilised LoRA.
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(alpha), scaling


def _adapter_tensor_shapes(directory: Path) -> dict[str, list[int]]:
    from safetensors import safe_open

    weights_path = directory / ADAPTER_WEIGHTS_FILE
    if not weights_path.is_file():
        other = (
            " (adapter_model.bin: save it with safe_serialization=True)"
            if (directory / "adapter_model.bin").exists()
            else ""
        )
        raise ValueError(f"LoRA adapter {str(directory)!r} has no {ADAPTER_WEIGHTS_FILE}{other}")
    with safe_open(weights_path, framework="pt") as tensors:
        return {key: list(tensors.get_slice(key).get_shape()) for key in tensors.keys()}  # noqa: SIM118


def parse_adapter_key(key: str) -> tuple[int, str, str, str] | None:
    """(layer index, decoder submodule, projection, "A" or "B") of a PEFT LoRA weight name; None for other names."""
    match = _ADAPTER_KEY.fullmatch(key)
    if match is None:
        return None
    return int(match.group(1)), match.group(2), match.group(3), match.group(4)


def read_lora_adapter(
    name: str,
    path: str,
    hf_config: Any,
    model_class: type[nn.Module],
    max_lora_rank: int,
    adapter_id: int,
    base_model_name: str | None = None,
) -> LoRAAdapter:
    """Check a PEFT LoRA adapter directory against the base model; ValueError naming the cause."""
    directory = Path(path).expanduser()
    config = _read_adapter_config(directory)
    rank, alpha, scaling = _check_settings(directory, config)
    if rank > max_lora_rank:
        raise ValueError(
            f"LoRA adapter {name!r} has rank {rank}, above max_lora_rank {max_lora_rank} (raise --max-lora-rank)"
        )
    targets = lora_target_layers(model_class)
    configured = config.get("target_modules")
    if isinstance(configured, list | tuple):
        unknown = sorted({str(module).rsplit(".", 1)[-1] for module in configured} - set(targets))
        if unknown:
            raise ValueError(
                f"LoRA adapter {name!r} targets modules {unknown}, which are not supported for "
                f"{model_class.__name__} (supported: {', '.join(sorted(targets))})"
            )
    shapes = _adapter_tensor_shapes(directory)
    expected = _projection_shapes(hf_config)
    found: dict[tuple[int, str], set[str]] = {}
    unsupported = []
    for key, shape in shapes.items():
        parsed = parse_adapter_key(key)
        if parsed is None or parsed[2] not in targets or PROJECTION_PARENTS.get(parsed[2]) != parsed[1]:
            unsupported.append(key)
            continue
        layer, _, projection, matrix = parsed
        if layer >= hf_config.num_hidden_layers:
            raise ValueError(
                f"LoRA adapter {name!r}: {key} is for layer {layer}; the base model has {hf_config.num_hidden_layers}"
            )
        out_features, in_features = expected[projection]
        want = [rank, in_features] if matrix == "A" else [out_features, rank]
        if shape != want:
            raise ValueError(
                f"LoRA adapter {name!r}: {key} has shape {shape}, the base model needs {want} (an adapter for another "
                "model?)"
            )
        found.setdefault((layer, projection), set()).add(matrix)
    if unsupported:
        shown = ", ".join(unsupported[:3]) + (f" and {len(unsupported) - 3} more" if len(unsupported) > 3 else "")
        raise ValueError(
            f"LoRA adapter {name!r} has weights for modules that are not supported: {shown} (supported: "
            f"{', '.join(sorted(targets))})"
        )
    if not found:
        raise ValueError(f"LoRA adapter {name!r} has no LoRA weights in {ADAPTER_WEIGHTS_FILE}")
    half = sorted(f"layers.{layer}.{projection}" for (layer, projection), got in found.items() if got != {"A", "B"})
    if half:
        raise ValueError(f"LoRA adapter {name!r}: {half[0]} has lora_A or lora_B but not both")
    projections = {projection for _, projection in found}
    for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        if fused in projections and projections & set(parts):
            raise ValueError(f"LoRA adapter {name!r} targets both {fused} and its parts")
    return LoRAAdapter(
        name, str(directory), rank, alpha, scaling, tuple(sorted(projections)), adapter_id, base_model_name
    )


# ----- on the workers -----


class LoRABatch:
    """The step's adapter rows, shared by every LoRA layer of a worker: the slot of each row (-1: base model), the
    same for the rows the last layer narrows to, and each slot's scaling."""

    def __init__(self, max_loras: int, device: torch.device):
        self.scalings = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.device = device
        self.row_slots: torch.Tensor | None = None
        self.output_row_slots: torch.Tensor | None = None
        self.slots_in_step: tuple[int, ...] = ()

    @property
    def active(self) -> bool:
        return bool(self.slots_in_step)

    def set_step(self, row_slots: list[int] | None, output_rows: torch.Tensor | None) -> None:
        """This step's rows (None or all -1: no adapter runs, every layer skips its LoRA)."""
        slots = tuple(sorted({slot for slot in row_slots or () if slot >= 0}))
        self.slots_in_step = slots
        if not slots:
            self.row_slots = self.output_row_slots = None
            return
        self.row_slots = torch.tensor(row_slots, dtype=torch.int64, device=self.device)
        self.output_row_slots = None if output_rows is None else self.row_slots.index_select(0, output_rows)

    def clear(self) -> None:
        self.set_step(None, None)

    def slots_for(self, num_rows: int) -> torch.Tensor:
        """Per-row slots of an input with `num_rows` rows: every row of the step, or the last layer's output rows."""
        if self.row_slots.shape[0] == num_rows:
            return self.row_slots
        if self.output_row_slots is not None and self.output_row_slots.shape[0] == num_rows:
            return self.output_row_slots
        raise RuntimeError(f"LoRA rows: {num_rows} rows match neither the step's nor its output rows")


class LinearLoRA(LoRAHook):
    """A linear layer's adapter slots: per projection (slice) of its output, A [max_loras, max_rank, in on this
    rank] and B [max_loras, out rows on this rank, max_rank]."""

    def __init__(self, layer: nn.Module, batch: LoRABatch, max_loras: int, max_rank: int):
        weight = layer.weight
        self.batch = batch
        self.slices: list[LoRASlice] = layer.lora_slices()
        self.input_range: tuple[int, int] | None = layer.lora_input_range()
        in_features = weight.shape[1]
        options = {"dtype": weight.dtype, "device": weight.device}
        self.lora_a = [torch.zeros(max_loras, max_rank, in_features, **options) for _ in self.slices]
        self.lora_b = [torch.zeros(max_loras, piece.rows, max_rank, **options) for piece in self.slices]
        # Which slots hold weights for this layer (an adapter may leave it out): others cost nothing here.
        self.slot_loaded = [False] * max_loras

    def apply(self, out: torch.Tensor, x: torch.Tensor) -> None:
        if not any(self.slot_loaded[slot] for slot in self.batch.slots_in_step):
            return
        row_slots = self.batch.slots_for(x.shape[0])
        whole = len(self.slices) == 1 and self.slices[0].rows == out.shape[1]
        for piece, lora_a, lora_b in zip(self.slices, self.lora_a, self.lora_b, strict=True):
            target = out if whole else out.narrow(1, piece.offset, piece.rows)
            add_lora(target, x, lora_a, lora_b, row_slots, self.batch.scalings)

    def clear_slot(self, slot: int) -> None:
        for lora_a, lora_b in zip(self.lora_a, self.lora_b, strict=True):
            lora_a[slot].zero_()
            lora_b[slot].zero_()
        self.slot_loaded[slot] = False

    def load_slot(self, slot: int, slice_index: int | None, lora_a: Any, lora_b: Any) -> None:
        """This rank's part of one projection's A [r, in] and B [out, r] (tensors or lazy safetensors slices):
        `slice_index` names the slice they are; None: B is a fused tensor over every slice, sharing one A."""
        if self.input_range is not None:
            start, size = self.input_range
            a = lora_a[:, start : start + size]
        else:
            a = lora_a[:]
        rank = a.shape[0]
        indices = range(len(self.slices)) if slice_index is None else [slice_index]
        for index in indices:
            piece = self.slices[index]
            first = piece.source_start + (piece.fused_start if slice_index is None else 0)
            self.lora_a[index][slot, :rank].copy_(a)
            self.lora_b[index][slot, :, :rank].copy_(lora_b[first : first + piece.rows])
        self.slot_loaded[slot] = True


class LoRASlots:
    """A worker's adapter slots over its model shard: attaches a `LinearLoRA` to every targetable layer, loads an
    adapter's slices into a slot, and sets each step's rows (`batch`)."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int):
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.model = model
        self.targets = lora_target_layers(type(model))
        device = next(model.parameters()).device
        self.batch = LoRABatch(max_loras, device)
        self.layers: dict[str, LinearLoRA] = {}
        layer_names = {layer_name for layer_name, _ in self.targets.values()}
        for index, decoder_layer in model.layers.items():
            for parent in ("self_attn", "mlp"):
                submodule = getattr(decoder_layer, parent, None)
                for layer_name in sorted(layer_names):
                    linear = getattr(submodule, layer_name, None)
                    if linear is not None and hasattr(linear, "lora_slices"):
                        linear.lora = LinearLoRA(linear, self.batch, max_loras, max_rank)
                        self.layers[f"layers.{index}.{parent}.{layer_name}"] = linear.lora
        self.slot_names: list[str | None] = [None] * max_loras
        model.lora_batch = self.batch

    def load(self, slot: int, name: str, path: str, scaling: float) -> None:
        """Replace whatever slot `slot` held with the adapter at `path` (checked by the engine already)."""
        from safetensors import safe_open

        for layer in self.layers.values():
            layer.clear_slot(slot)
        with safe_open(Path(path) / ADAPTER_WEIGHTS_FILE, framework="pt", device="cpu") as tensors:
            for key in sorted(tensors.keys()):
                parsed = parse_adapter_key(key)
                if parsed is None or parsed[3] != "A":
                    continue
                layer_index, parent, projection, _ = parsed
                layer_name, slice_index = self.targets[projection]
                layer = self.layers.get(f"layers.{layer_index}.{parent}.{layer_name}")
                if layer is None:
                    continue  # another pipeline stage's layer
                b_key = key[: -len("lora_A.weight")] + "lora_B.weight"
                layer.load_slot(slot, slice_index, tensors.get_slice(key), tensors.get_slice(b_key))
        self.batch.scalings[slot] = scaling
        self.slot_names[slot] = name
        logger.info("LoRA adapter %s loaded into slot %d from %s", name, slot, path)
