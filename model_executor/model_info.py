"""What the engine must know about a model before it runs it: read once from the HF directory."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import AutoConfig

from configs.engine_config import EngineConfig, check_chunked_prefill_budget
from model_executor.checkpoint_checks import check_checkpoint
from model_executor.cpu_features import cpu_has_bf16_dot_products
from model_executor.model_fetch import hub_commit_for

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelInfo:
    model_dir: Path
    hf_config: Any
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    device: str
    dtype_name: str
    hub_commit: str | None = None
    """The commit a hub id resolved to: workers load that one, wherever they run (None: an alias or a directory)."""

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def head_dim(self) -> int:
        config = self.hf_config
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def resolve_device(requested: str, cuda_available: bool | None = None) -> str:
    """auto -> cuda when available. `cuda_available` defaults to this process's view (the scheduler actor passes
    the cluster's: its workers, not it, hold the GPUs)."""
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if requested == "auto":
        return "cuda" if cuda_available else "cpu"
    if requested == "cuda" and not cuda_available:
        raise ValueError("device 'cuda' was requested but no CUDA device is available")
    return requested


class AutoDtype(NamedTuple):
    """The precision `dtype: auto` picked, and why (the load logs both)."""

    dtype_name: str
    reason: str


def checkpoint_dtype_name(hf_config: Any) -> str | None:
    """The checkpoint's own precision (config.json `dtype`, or `torch_dtype` as older transformers wrote it) as one
    of DTYPES' names; None where it names none or one we do not run."""
    value = getattr(hf_config, "dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)
    return next((name for name, dtype in DTYPES.items() if dtype == value), None)


def resolve_auto_dtype(checkpoint_dtype: str | None, device: str, cpu_has_bf16_dot: bool) -> AutoDtype:
    """What `dtype: auto` runs, as vLLM: the checkpoint's half precision on CUDA and on CPUs with bf16 dot products
    (fp16 as bf16 there: CPUs have no fast fp16 matmul); float32 checkpoints stay float32 on CPU (exact against HF
    fp32) and run bfloat16 on CUDA; float32 on CPUs without bf16 dot products (bf16 would be emulated, slower)."""
    found = f"checkpoint dtype {checkpoint_dtype or 'not given'}"
    if device == "cuda":
        if checkpoint_dtype in ("bfloat16", "float16"):
            return AutoDtype(checkpoint_dtype, f"{found}, kept on CUDA")
        return AutoDtype("bfloat16", f"{found}; CUDA runs bfloat16")
    if not cpu_has_bf16_dot:
        return AutoDtype("float32", f"{found}; this CPU has no bf16 dot products (AVX512-BF16 or AMX-BF16)")
    if checkpoint_dtype == "bfloat16":
        return AutoDtype("bfloat16", f"{found}, kept: this CPU has bf16 dot products")
    if checkpoint_dtype == "float16":
        return AutoDtype(
            "bfloat16", f"{found}, run as bfloat16: float16 matmuls are slow on CPU, this one has bf16 dot products"
        )
    return AutoDtype("float32", f"{found}; float32 stays exact against HF fp32 (dtype bfloat16 runs it in bf16)")


def auto_dtype_for(hf_config: Any, device: str) -> AutoDtype:
    """`dtype: auto` for this checkpoint on `device` ("cuda" or "cpu"), the CPU probed in this process."""
    return resolve_auto_dtype(
        checkpoint_dtype_name(hf_config), device, device != "cuda" and cpu_has_bf16_dot_products()
    )


def read_eos_token_ids(model_dir: Path, hf_config: Any) -> frozenset[int]:
    """EOS ids from generation_config.json (which may list several) and config.json."""
    eos: set[int] = set()
    candidates = [getattr(hf_config, "eos_token_id", None)]
    generation_config = model_dir / "generation_config.json"
    if generation_config.exists():
        candidates.append(json.loads(generation_config.read_text()).get("eos_token_id"))
    for candidate in candidates:
        if isinstance(candidate, int):
            eos.add(candidate)
        elif isinstance(candidate, list):
            eos.update(token_id for token_id in candidate if isinstance(token_id, int))
    return frozenset(eos)


# generation_config.json keys a request inherits when it omits them (HF name -> our sampling parameter).
GENERATION_DEFAULT_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def read_generation_defaults(model_dir: Path) -> dict[str, Any]:
    """Sampling defaults the model's authors ship in generation_config.json, as our parameter names; {} if none.
    As vLLM does, `do_sample` is not read: a shipped temperature is the default whatever it says."""
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return {}
    shipped = json.loads(path.read_text())
    present = {theirs: ours for theirs, ours in GENERATION_DEFAULT_KEYS.items() if shipped.get(theirs) is not None}
    return {ours: shipped[theirs] for theirs, ours in present.items()}


def generation_defaults(model_dir: Path, generation_config: str) -> dict[str, Any]:
    """The sampling values a request (or `LLM.generate` without SamplingParams) inherits for the fields it omits:
    under model.generation_config "auto" those of the model's file that are valid sampling values; under "vllm",
    none. Logged, as vLLM does."""
    from configs.sampling_params import SamplingParams

    if generation_config == "vllm":
        return {}
    defaults = {}
    for name, value in read_generation_defaults(model_dir).items():
        try:
            SamplingParams(**{name: value})
        except (TypeError, ValueError) as error:
            # A bad value in the model's file must not turn every request that omits the field into an error.
            logger.warning("ignoring the model's generation config %s=%r: %s", name, value, error)
            continue
        defaults[name] = value
    if defaults:
        logger.info(
            "Default sampling parameters have been overridden by the model's generation config: %s "
            "(model.generation_config: vllm ignores it)",
            defaults,
        )
    return defaults


def read_hf_config(model_dir: Path) -> Any:
    """config.json through transformers; a model_type it does not know (or code of the repo's own it would have to
    run) is a ValueError naming the type, the transformers version and what pagedserve supports."""
    try:
        return AutoConfig.from_pretrained(model_dir)
    except (ValueError, KeyError) as error:
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        from model_executor.models import supported_architectures

        try:
            model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
        except (OSError, ValueError):
            model_type = None
        if model_type is None or model_type in CONFIG_MAPPING_NAMES:
            raise  # a known type with a bad value: transformers' own message says which
        raise ValueError(
            f"model_type {model_type!r} is not known to transformers {transformers.__version__} (pagedserve runs no "
            f"code shipped with a model); supported architectures: {', '.join(supported_architectures())}"
        ) from error


def load_model_info(
    model_dir: Path, config: EngineConfig, cuda_available: bool | None = None, *, log_dtype_choice: bool = True
) -> ModelInfo:
    """What the engine needs to know of the model, read before any worker starts (by the CLI, the scheduler actor
    and `LLM`): a model pagedserve cannot run is refused here, in one line. `log_dtype_choice` False: a check whose
    device is a guess (the CLI's) does not log what `dtype: auto` picked."""
    hf_config = read_hf_config(model_dir)
    check_checkpoint(Path(model_dir), hf_config)
    model_limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    max_model_len = config.model.max_model_len or model_limit
    if max_model_len > model_limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {model_limit}")
    # Before any weights load: the model's own length may be more than an unchunked step holds.
    check_chunked_prefill_budget(
        config.scheduler.enable_chunked_prefill, config.scheduler.max_num_batched_tokens, max_model_len
    )
    device = resolve_device(config.model.device, cuda_available)
    dtype_name = config.model.dtype
    if dtype_name == "auto":
        # Probed in this process: on a cluster the scheduler actor's CPU stands for its workers' CPUs.
        choice = auto_dtype_for(hf_config, device)
        dtype_name = choice.dtype_name
        if log_dtype_choice:
            logger.info("dtype auto: %s on %s (%s)", dtype_name, device, choice.reason)
    return ModelInfo(
        model_dir=Path(model_dir),
        hf_config=hf_config,
        max_model_len=max_model_len,
        vocab_size=hf_config.vocab_size,
        eos_token_ids=read_eos_token_ids(Path(model_dir), hf_config),
        device=device,
        dtype_name=dtype_name,
        hub_commit=hub_commit_for(config.model.name, Path(model_dir)),
    )
