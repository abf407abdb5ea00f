"""Checkpoints the engine cannot run are refused in one line, and the ones it can are found through their index.

Each case copies the tiny random Llama to a temporary directory, breaks it the way real checkpoints are broken
(PyTorch pickles only, a quantization method, quantized tensors, a lost shard, an architecture we lack), and asserts
the message a user gets from `LLM` or the CLI.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from configs.engine_config import EngineConfig
from configs.sampling_params import SamplingParams
from model_executor import weight_loader
from model_executor.models import get_model_class, supported_architectures
from model_executor.parallel_state import ParallelContext
from tests.test_cli import assert_one_line_error, run_cli

PROMPTS = [[1, 450, 7483, 310, 3444, 338], [1, 9038, 2501, 263, 931, 29892, 727, 471], [5, 6, 7]]
QUANTIZED_TENSOR = "model.layers.0.self_attn.q_proj.qweight"


@pytest.fixture
def checkpoint(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny Llama (untied head, 2 layers, one model.safetensors) to break."""
    target = tmp_path / "tiny-llama"
    shutil.copytree(tiny_model_dir, target)
    return target


def edit_config(model_dir: Path, **changes: Any) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def rewrite_tensors(model_dir: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def shard(model_dir: Path, shard_of: Callable[[str], int]) -> list[str]:
    """Split model.safetensors into shards with an index, as transformers' save_pretrained lays out big models."""
    tensors = load_file(model_dir / "model.safetensors")
    count = 1 + max(shard_of(name) for name in tensors)
    names = [f"model-{index + 1:05d}-of-{count:05d}.safetensors" for index in range(count)]
    for index, file_name in enumerate(names):
        part = {name: tensor for name, tensor in tensors.items() if shard_of(name) == index}
        save_file(part, model_dir / file_name, metadata={"format": "pt"})
    weight_map = {name: names[shard_of(name)] for name in sorted(tensors)}
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}}
    (model_dir / weight_loader.INDEX_NAME).write_text(json.dumps({**index, "weight_map": weight_map}))
    (model_dir / "model.safetensors").unlink()
    return names


def stage_of(name: str) -> int:
    """Layer 0 and the embedding in shard 0; layer 1, the final norm and the head in shard 1 (PP=2's split)."""
    return 0 if name.startswith(("model.embed_tokens.", "model.layers.0.")) else 1


def build_llm(model_dir: Path) -> Any:
    from executor import LLM

    return LLM(model=str(model_dir), show_progress=False, num_kv_blocks=64)


def greedy_tokens(llm: Any) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


def test_pytorch_only_weights_are_refused(checkpoint):
    state = load_file(checkpoint / "model.safetensors")
    torch.save(state, checkpoint / "pytorch_model.bin")
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"has only PyTorch \.bin weights; pagedserve loads safetensors only"):
        build_llm(checkpoint)
    from transformers import AutoConfig

    from model_executor.checkpoint_checks import check_checkpoint

    with pytest.raises(ValueError, match=r"save_pretrained\(safe_serialization=True\)"):
        check_checkpoint(checkpoint, AutoConfig.from_pretrained(checkpoint))


@pytest.mark.parametrize(
    "quantization",
    [
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False},
        {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True},
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    ],
    ids=lambda quantization: quantization["quant_method"],
)
def test_quantization_config_is_refused_naming_the_method(checkpoint, quantization):
    edit_config(checkpoint, quantization_config=quantization)
    method = quantization["quant_method"]
    with pytest.raises(ValueError, match=rf"quantized with '{method}'; pagedserve runs unquantized float32/bfloat16"):
        build_llm(checkpoint)


def test_a_tensor_the_architecture_does_not_know_is_an_error(checkpoint):
    def add_gptq_tensors(tensors: dict[str, torch.Tensor]) -> None:
        tensors[QUANTIZED_TENSOR] = torch.zeros(8, 64, dtype=torch.int32)

    rewrite_tensors(checkpoint, add_gptq_tensors)
    message = f"1 checkpoint tensors are not used by LlamaForCausalLM: ['{QUANTIZED_TENSOR}']"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        build_llm(checkpoint)


@pytest.mark.parametrize(("dtype", "safetensors_name"), [(torch.float8_e4m3fn, "F8_E4M3"), (torch.int8, "I8")])
def test_a_non_float_tensor_is_refused_naming_it(checkpoint, dtype, safetensors_name):
    name = "model.layers.1.mlp.down_proj.weight"

    def quantize(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name].to(dtype)

    rewrite_tensors(checkpoint, quantize)
    with pytest.raises(ValueError, match=rf"checkpoint tensor {name} in model.safetensors is {safetensors_name}; "):
        build_llm(checkpoint)


def test_an_index_naming_a_missing_shard_is_an_error(checkpoint):
    names = shard(checkpoint, stage_of)
    (checkpoint / names[1]).unlink()
    with pytest.raises(FileNotFoundError, match=rf"index\.json lists shards missing from .*: {names[1]}$"):
        build_llm(checkpoint)


def test_an_unknown_architecture_lists_the_supported_ones(checkpoint):
    edit_config(checkpoint, architectures=["FalconForCausalLM"])
    with pytest.raises(ValueError, match="architecture FalconForCausalLM is not supported") as refused:
        build_llm(checkpoint)
    supported = supported_architectures()
    assert {"LlamaForCausalLM", "MistralForCausalLM"} <= set(supported)
    assert f"supported architectures: {', '.join(supported)}" in str(refused.value)


@pytest.mark.subprocess
def test_the_cli_refuses_an_unknown_architecture_in_one_line(checkpoint):
    edit_config(checkpoint, architectures=["FalconForCausalLM"])
    result = run_cli("serve", str(checkpoint), "--dry-run")
    line = assert_one_line_error(result, "architecture FalconForCausalLM is not supported", "LlamaForCausalLM")
    assert ", ".join(supported_architectures()) in line


def test_multimodal_gemma3_gets_its_own_message(checkpoint):
    edit_config(checkpoint, architectures=["Gemma3ForConditionalGeneration"])
    with pytest.raises(ValueError, match=r"multimodal Gemma 3: use a text-only checkpoint \(gemma-3-1b/270m\)"):
        build_llm(checkpoint)


def test_no_architectures_means_the_model_types_causal_lm_and_nothing_else():
    """A config without `architectures` (GGUF conversions) is what transformers maps its model_type to; an empty
    list is an error, never a silent Llama."""
    from transformers import LlamaConfig

    from model_executor.checkpoint_checks import check_checkpoint
    from model_executor.models.llama import LlamaForCausalLM

    config = LlamaConfig()
    assert not config.architectures
    assert check_checkpoint(Path("/nonexistent"), config) is LlamaForCausalLM
    assert config.architectures == ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match=r"config\.json names no architectures"):
        get_model_class([])


def test_a_sharded_checkpoint_gives_the_one_file_tokens(checkpoint, tiny_model_dir, hf_reference):
    # Shards that cut through a layer: the index, not the file order, says where each tensor is.
    shard(checkpoint, lambda name: 0 if name < "model.layers.1.self_attn" else 1)
    sharded = greedy_tokens(build_llm(checkpoint))
    assert sharded == greedy_tokens(build_llm(tiny_model_dir))
    assert sharded[0] == hf_reference.greedy(tiny_model_dir, PROMPTS[0], 12)


def test_consolidated_weights_beside_the_transformers_layout_are_not_read(checkpoint, tiny_model_dir):
    """Mistral repositories ship both layouts; the consolidated one uses names we do not map."""
    tensors = load_file(checkpoint / "model.safetensors")
    consolidated = {"layers.0.attention.wq.weight": tensors["model.layers.0.self_attn.q_proj.weight"]}
    save_file(consolidated, checkpoint / "consolidated.safetensors")
    assert greedy_tokens(build_llm(checkpoint)) == greedy_tokens(build_llm(tiny_model_dir))


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_a_pipeline_stage_opens_only_the_shards_it_loads(checkpoint, tiny_model_dir, monkeypatch, pp_rank):
    from model_executor.model_info import load_model_info
    from model_executor.model_loader import load_model

    names = shard(checkpoint, stage_of)
    opened: list[str] = []
    open_checkpoint = weight_loader.open_checkpoint

    def counting_open(path: Path) -> Any:
        opened.append(Path(path).name)
        return open_checkpoint(path)

    monkeypatch.setattr(weight_loader, "open_checkpoint", counting_open)
    model_info = load_model_info(checkpoint, EngineConfig(model=str(checkpoint), device="cpu"))
    stage = load_model(model_info, ParallelContext(pp_rank=pp_rank, pp_size=2), "torch", False, show_progress=False)
    assert opened == [names[pp_rank]]
    whole = load_model(
        load_model_info(tiny_model_dir, EngineConfig(model=str(tiny_model_dir), device="cpu")),
        ParallelContext(),
        "torch",
        False,
        show_progress=False,
    )
    whole_params = dict(whole.named_parameters())
    for name, param in stage.named_parameters():
        torch.testing.assert_close(param, whole_params[name], rtol=0, atol=0, msg=name)
