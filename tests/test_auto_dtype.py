"""`dtype: auto` (issue 38): the checkpoint's own half precision on CUDA and on CPUs with bf16 dot products (AVX512-BF16
or AMX-BF16), float32 elsewhere; a float32 checkpoint stays float32 on CPU (exact against HF fp32)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from configs.engine_config import EngineConfig
from configs.sampling_params import SamplingParams
from model_executor.cpu_features import BF16_DOT_FLAGS, cpu_flags_from_proc, cpu_has_bf16_dot_products
from model_executor.model_info import checkpoint_dtype_name, load_model_info, read_hf_config, resolve_auto_dtype

MODEL_INFO_LOGGER = "model_executor.model_info"
# What auto runs on this machine's CPU for a half-precision checkpoint.
CPU_HALF_DTYPE = torch.bfloat16 if cpu_has_bf16_dot_products() else torch.float32


@pytest.mark.parametrize(
    ("checkpoint_dtype", "device", "cpu_has_bf16_dot", "expected"),
    [
        # CPU with bf16 dot products: bf16 kept, fp16 as bf16, fp32 (or none) exact.
        ("bfloat16", "cpu", True, "bfloat16"),
        ("float16", "cpu", True, "bfloat16"),
        ("float32", "cpu", True, "float32"),
        (None, "cpu", True, "float32"),
        # CPU without them: bf16 would be emulated, so float32 whatever the checkpoint says.
        ("bfloat16", "cpu", False, "float32"),
        ("float16", "cpu", False, "float32"),
        ("float32", "cpu", False, "float32"),
        (None, "cpu", False, "float32"),
        # CUDA: the checkpoint's half precision, else bf16; the CPU's features do not matter.
        ("bfloat16", "cuda", False, "bfloat16"),
        ("float16", "cuda", True, "float16"),
        ("float16", "cuda", False, "float16"),
        ("float32", "cuda", True, "bfloat16"),
        (None, "cuda", False, "bfloat16"),
    ],
)
def test_auto_dtype_table(checkpoint_dtype, device, cpu_has_bf16_dot, expected):
    choice = resolve_auto_dtype(checkpoint_dtype, device, cpu_has_bf16_dot)
    assert choice.dtype_name == expected
    assert f"checkpoint dtype {checkpoint_dtype or 'not given'}" in choice.reason


def test_fp16_on_a_bf16_cpu_says_why_it_runs_bf16():
    assert "float16 matmuls are slow on CPU" in resolve_auto_dtype("float16", "cpu", True).reason


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="needs /proc/cpuinfo to cross-check torch's probe")
def test_the_probe_agrees_with_proc_cpuinfo():
    assert cpu_has_bf16_dot_products() == bool(BF16_DOT_FLAGS & cpu_flags_from_proc())


def copy_with_config_dtype(source: Path, target: Path, key: str, value: str | None) -> Path:
    """A copy of `source` whose config.json names `value` under `key` and no other dtype (None: names none)."""
    shutil.copytree(source, target)
    path = target / "config.json"
    config = json.loads(path.read_text())
    for name in ("dtype", "torch_dtype"):
        config.pop(name, None)
    if value is not None:
        config[key] = value
    path.write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("dtype", "bfloat16", "bfloat16"),
        ("torch_dtype", "float16", "float16"),  # the key older transformers wrote
        ("dtype", "float32", "float32"),
        ("dtype", None, None),
    ],
)
def test_the_checkpoint_dtype_is_read_from_either_key(tiny_model_dir, tmp_path, key, value, expected):
    model_dir = copy_with_config_dtype(tiny_model_dir, tmp_path / "model", key, value)
    assert checkpoint_dtype_name(read_hf_config(model_dir)) == expected


def test_an_fp16_checkpoint_on_cpu_loads_as_this_cpus_half_dtype_and_logs_why(tiny_model_dir, tmp_path, caplog):
    model_dir = copy_with_config_dtype(tiny_model_dir, tmp_path / "fp16", "dtype", "float16")
    caplog.set_level(logging.INFO, logger=MODEL_INFO_LOGGER)
    info = load_model_info(model_dir, EngineConfig(model=str(model_dir), device="cpu"))
    assert info.dtype == CPU_HALF_DTYPE
    lines = [record.getMessage() for record in caplog.records if record.name == MODEL_INFO_LOGGER]
    assert len(lines) == 1 and lines[0].startswith(f"dtype auto: {info.dtype_name} on cpu (checkpoint dtype float16")


def test_an_explicit_dtype_wins_and_logs_no_choice(tiny_model_dir, tmp_path, caplog):
    model_dir = copy_with_config_dtype(tiny_model_dir, tmp_path / "bf16-config", "dtype", "bfloat16")
    caplog.set_level(logging.INFO, logger=MODEL_INFO_LOGGER)
    info = load_model_info(model_dir, EngineConfig(model=str(model_dir), device="cpu", dtype="float32"))
    assert info.dtype == torch.float32
    assert not [record for record in caplog.records if record.getMessage().startswith("dtype auto")]


@pytest.fixture
def tiny_bf16_dir(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny Llama saved in bf16 by transformers (bf16 tensors, config.json `dtype: bfloat16`), tokenizer beside."""
    from transformers import AutoModelForCausalLM

    target = tmp_path / "tiny-bf16"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(target)
    for path in tiny_model_dir.iterdir():
        if path.is_file() and not (target / path.name).exists():
            shutil.copy(path, target / path.name)
    return target


def test_a_bf16_checkpoint_serves_bf16_on_a_cpu_with_bf16_dot_products(tiny_bf16_dir, make_llm):
    assert json.loads((tiny_bf16_dir / "config.json").read_text())["dtype"] == "bfloat16"
    llm = make_llm(tiny_bf16_dir, device="cpu", max_model_len=64, num_kv_blocks=16)
    assert llm.engine.model_info.dtype == CPU_HALF_DTYPE
    output = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 4


def test_an_fp32_checkpoint_stays_float32(tiny_model_dir, make_llm):
    assert json.loads((tiny_model_dir / "config.json").read_text())["dtype"] == "float32"
    llm = make_llm(tiny_model_dir, device="cpu", max_model_len=64, num_kv_blocks=16)
    assert llm.engine.model_info.dtype == torch.float32
