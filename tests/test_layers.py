"""The shared layers against transformers' own: rope tables per rope type, fused checkpoint loading, Gemma's norm,
GeGLU, and how the decoder base classifies checkpoint tensor names for the loader."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cuda_ext.fused_ops import gelu_tanh_and_mul
from model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from model_executor.layers.norm import GemmaRMSNorm
from model_executor.layers.rotary import get_rope, rope_parameters
from model_executor.parallel_state import ParallelContext
from model_executor.weight_loader import CheckpointSkip

CPU = torch.device("cpu")
MAX_POSITIONS = 256


def llama_config(**overrides: Any) -> Any:
    # Imported here: transformers' config import loads triton, which the Triton tests must import first.
    from transformers import LlamaConfig

    settings = {
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        **overrides,
    }
    return LlamaConfig(**settings)


def phi3_config(**overrides: Any) -> Any:
    from transformers import Phi3Config

    settings = {
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": MAX_POSITIONS,
        **overrides,
    }
    return Phi3Config(**settings)


def hf_cos_sin(rotary_module: Any, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos/sin rows [positions, rotary_dim] in fp32 for these positions (one forward call)."""
    probe = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary_module(probe, positions[None, :])
    return cos[0], sin[0]


def assert_tables_match(ours: Any, hf_cos: torch.Tensor, hf_sin: torch.Tensor, rows: slice) -> None:
    half = ours.rotary_dim // 2
    # transformers repeats the angles over both halves; our table holds one half.
    assert torch.equal(hf_cos[:, :half], hf_cos[:, half:])
    assert torch.equal(ours.cos_table[rows], hf_cos[:, :half])
    assert torch.equal(ours.sin_table[rows], hf_sin[:, :half])


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 500000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
    ids=lambda rope: rope["rope_type"],
)
def test_rope_tables_equal_transformers(rope: dict[str, Any]) -> None:
    """fp32 cos/sin rows equal transformers' (inv_freq from its ROPE_INIT_FUNCTIONS / default) bit for bit."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = llama_config(rope_parameters=dict(rope))
    params = rope_parameters(config)
    assert params["rope_type"] == rope["rope_type"]
    ours = get_rope(16, MAX_POSITIONS, params)
    if rope["rope_type"] != "default":
        # The table really is the scaled one: transformers' init function for this type gives its frequencies.
        inv_freq, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, CPU)
        assert torch.equal(ours.cos_table[1], torch.cos(inv_freq))
    positions = torch.arange(MAX_POSITIONS)
    assert_tables_match(ours, *hf_cos_sin(LlamaRotaryEmbedding(config), positions), slice(None))


def longrope_settings(rotary_half: int, original: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": (1 + 3 * torch.rand(rotary_half, generator=generator)).tolist(),
        "long_factor": (1 + 3 * torch.rand(rotary_half, generator=generator)).tolist(),
        "original_max_position_embeddings": original,
    }


@pytest.mark.parametrize("partial_rotary_factor", [1.0, 0.5])
@pytest.mark.parametrize("attention_factor", [None, 1.25])
def test_longrope_tables_equal_transformers_short_and_long(
    partial_rotary_factor: float, attention_factor: float | None
) -> None:
    """Positions before original_max use the short factors (transformers' table for a short sequence), positions
    from it on the long ones (its table once the sequence is longer); attention_factor scales both."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    original = 64
    rope = longrope_settings(int(16 * partial_rotary_factor) // 2, original)
    if attention_factor is not None:
        rope["attention_factor"] = attention_factor
    config = phi3_config(
        rope_parameters=rope, partial_rotary_factor=partial_rotary_factor, original_max_position_embeddings=original
    )
    ours = get_rope(16, MAX_POSITIONS, rope_parameters(config))
    assert ours.rotary_dim == int(16 * partial_rotary_factor)
    short = torch.arange(original)
    assert_tables_match(ours, *hf_cos_sin(Phi3RotaryEmbedding(config), short), slice(0, original))
    long = torch.arange(original, MAX_POSITIONS)
    assert_tables_match(ours, *hf_cos_sin(Phi3RotaryEmbedding(config), long), slice(original, MAX_POSITIONS))
    # The multiplier is really there: sqrt(1 + ln(256 / 64) / ln(64)) by default.
    expected_factor = attention_factor or (1 + torch.log(torch.tensor(4.0)) / torch.log(torch.tensor(64.0))).sqrt()
    assert ours.cos_table[0, 0].item() == pytest.approx(float(expected_factor))


def test_partial_rotary_rotates_the_first_dims_as_transformers() -> None:
    """partial_rotary_factor 0.5: the first half of each head rotates as transformers' Phi-3 does, the rest is
    untouched."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    config = phi3_config(partial_rotary_factor=0.5)
    ours = get_rope(16, MAX_POSITIONS, rope_parameters(config))
    assert ours.is_partial and ours.rotary_dim == 8
    torch.manual_seed(0)
    positions = torch.tensor([0, 3, 17, 200])
    query, key = torch.randn(4, 4, 16), torch.randn(4, 2, 16)
    cos, sin = hf_cos_sin(Phi3RotaryEmbedding(config), positions)
    # transformers' layout is [batch, heads, tokens, head_dim].
    hf_query, hf_key = apply_rotary_pos_emb(
        query.transpose(0, 1)[None], key.transpose(0, 1)[None], cos[None], sin[None]
    )
    rotated_query, rotated_key = query.clone(), key.clone()
    ours.apply(rotated_query, rotated_key, ours.cos_sin(positions))
    assert torch.equal(rotated_query[..., 8:], query[..., 8:])
    assert not torch.allclose(rotated_query[1:, :, :8], query[1:, :, :8])
    torch.testing.assert_close(rotated_query, hf_query[0].transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(rotated_key, hf_key[0].transpose(0, 1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("rope_type", ["dynamic", "yarn"])
def test_unsupported_rope_types_are_refused_by_name(rope_type: str) -> None:
    from model_executor.models.llama import LlamaForCausalLM

    config = llama_config(
        rope_parameters={"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0, "beta_fast": 32.0}
    )
    with pytest.raises(ValueError, match=f"rope type '{rope_type}' is not supported"):
        LlamaForCausalLM.check_config(config)
    with pytest.raises(ValueError, match=f"rope type '{rope_type}' is not supported"):
        get_rope(16, MAX_POSITIONS, rope_parameters(config))


def test_nested_rope_parameters_by_layer_type() -> None:
    """Gemma 3 style: one rope dict per layer type, each picked by name."""
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        },
    )
    assert rope_parameters(config, "sliding_attention")["rope_theta"] == 10000.0
    full = rope_parameters(config, "full_attention")
    assert (full["rope_type"], full["rope_theta"], full["factor"]) == ("linear", 1000000.0, 8.0)
    with pytest.raises(ValueError, match="differ by layer type"):
        rope_parameters(config)


# ----- fused checkpoint tensors -----


def load_qkv(tp_rank: int, tp_size: int, num_kv_heads: int, tensors: dict[str, torch.Tensor], fused: bool) -> Any:
    layer = QKVParallelLinear(32, 8, 4, num_kv_heads, ParallelContext(tp_rank=tp_rank, tp_size=tp_size), bias=True)
    for param_name in ("weight", "bias"):
        parts = [tensors[f"{part}_{param_name}"] for part in "qkv"]
        if fused:
            layer.load_weight(param_name, torch.cat(parts), "qkv")
        else:
            for part, tensor in zip("qkv", parts, strict=True):
                layer.load_weight(param_name, tensor, part)
    return layer


@pytest.mark.parametrize(("tp_size", "num_kv_heads"), [(1, 2), (2, 2), (2, 1)])
def test_fused_qkv_loads_as_separate_q_k_v(tp_size: int, num_kv_heads: int) -> None:
    """A fused [q|k|v] checkpoint tensor (Phi-3) loads each rank exactly as the three separate tensors do; at TP 2
    each rank holds its heads' rows (KV heads replicated when there are fewer than ranks)."""
    torch.manual_seed(0)
    tensors = {
        "q_weight": torch.randn(32, 32),
        "k_weight": torch.randn(8 * num_kv_heads, 32),
        "v_weight": torch.randn(8 * num_kv_heads, 32),
        "q_bias": torch.randn(32),
        "k_bias": torch.randn(8 * num_kv_heads),
        "v_bias": torch.randn(8 * num_kv_heads),
    }
    for rank in range(tp_size):
        separate = load_qkv(rank, tp_size, num_kv_heads, tensors, fused=False)
        fused = load_qkv(rank, tp_size, num_kv_heads, tensors, fused=True)
        assert torch.equal(fused.weight, separate.weight)
        assert torch.equal(fused.bias, separate.bias)
        # This rank's rows, by slicing the originals.
        kv_heads = max(num_kv_heads // tp_size, 1)
        kv_head = rank * num_kv_heads // tp_size if tp_size >= num_kv_heads else rank * kv_heads
        q_rows = slice(rank * 32 // tp_size, (rank + 1) * 32 // tp_size)
        kv_rows = slice(kv_head * 8, (kv_head + kv_heads) * 8)
        expected = torch.cat([tensors["q_weight"][q_rows], tensors["k_weight"][kv_rows], tensors["v_weight"][kv_rows]])
        assert torch.equal(fused.weight, expected)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_fused_gate_up_loads_as_separate_gate_and_up(tp_size: int) -> None:
    torch.manual_seed(0)
    gate, up = torch.randn(48, 32), torch.randn(48, 32)
    for rank in range(tp_size):
        parallel = ParallelContext(tp_rank=rank, tp_size=tp_size)
        separate = MergedColumnParallelLinear(32, [48, 48], parallel)
        separate.load_weight("weight", gate, 0)
        separate.load_weight("weight", up, 1)
        fused = MergedColumnParallelLinear(32, [48, 48], parallel)
        fused.load_weight("weight", torch.cat([gate, up]), "gate_up")
        assert torch.equal(fused.weight, separate.weight)
        rows = slice(rank * 48 // tp_size, (rank + 1) * 48 // tp_size)
        assert torch.equal(fused.weight, torch.cat([gate[rows], up[rows]]))


def test_fused_loading_reads_lazy_safetensors_slices(tmp_path: Any) -> None:
    """The loader hands layers lazy safetensors slices: the fused split reads only row ranges of them."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    torch.manual_seed(0)
    qkv = torch.randn(64, 32)
    save_file({"qkv": qkv}, tmp_path / "fused.safetensors")
    direct = QKVParallelLinear(32, 8, 4, 2, ParallelContext(tp_rank=1, tp_size=2))
    direct.load_weight("weight", qkv, "qkv")
    lazy = QKVParallelLinear(32, 8, 4, 2, ParallelContext(tp_rank=1, tp_size=2))
    with safe_open(tmp_path / "fused.safetensors", framework="pt") as checkpoint:
        lazy.load_weight("weight", checkpoint.get_slice("qkv"), "qkv")
    assert torch.equal(lazy.weight, direct.weight)


# ----- Gemma's norm and GeGLU -----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norm_equals_transformers(dtype: torch.dtype) -> None:
    """(1 + w) scaling in fp32 with one cast at the end, as transformers' Gemma2RMSNorm; fused residual add as
    transformers adds before the norm. fp32 bit-exact; bf16 within one bf16 rounding."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    torch.manual_seed(0)
    weight = (torch.rand(64) - 0.5).to(dtype)
    reference = Gemma2RMSNorm(64, eps=1e-6).to(dtype)
    ours = GemmaRMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        reference.weight.copy_(weight)
    ours.load_weight("weight", weight)
    x, residual = (3 * torch.randn(5, 64)).to(dtype), torch.randn(5, 64).to(dtype)
    expected_plain = reference(x)
    expected_summed = x + residual
    expected_normed = reference(expected_summed)
    # A zero-centred weight really scales by 1 + w: the norm differs from one with plain w.
    assert not torch.allclose(expected_plain.float(), (weight.float() * F.rms_norm(x.float(), (64,), eps=1e-6)))
    plain = ours(x.clone())
    normed, summed = ours(x.clone(), residual.clone())
    assert plain.dtype == normed.dtype == dtype
    assert torch.equal(summed, expected_summed)
    if dtype == torch.float32:
        assert torch.equal(plain, expected_plain)
        torch.testing.assert_close(normed, expected_normed, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(plain, expected_plain)
        torch.testing.assert_close(normed, expected_normed, rtol=2**-8, atol=2**-8)


def test_gemma_rms_norm_per_head() -> None:
    """As a q/k norm over [tokens, heads, head_dim]."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    torch.manual_seed(0)
    reference, ours = Gemma2RMSNorm(16), GemmaRMSNorm(16)
    weight = torch.rand(16) - 0.5
    with torch.no_grad():
        reference.weight.copy_(weight)
    ours.load_weight("weight", weight)
    heads = torch.randn(3, 4, 32)[..., :16]
    assert torch.equal(ours(heads), reference(heads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul_is_transformers_geglu(dtype: torch.dtype) -> None:
    from transformers.activations import ACT2FN

    torch.manual_seed(0)
    gate, up = torch.randn(7, 24).to(dtype), torch.randn(7, 24).to(dtype)
    expected = ACT2FN["gelu_pytorch_tanh"](gate) * up
    assert torch.equal(gelu_tanh_and_mul(torch.cat([gate, up], dim=-1)), expected)
    assert not torch.equal(expected, F.gelu(gate) * up) or dtype == torch.bfloat16


# ----- checkpoint names -----


def llama_stage(pp_rank: int, pp_size: int, **overrides: Any) -> Any:
    from model_executor.models.llama import LlamaForCausalLM

    parallel = ParallelContext(pp_rank=pp_rank, pp_size=pp_size)
    return LlamaForCausalLM(llama_config(**overrides), parallel, "torch", CPU)


def hf_checkpoint_names(**overrides: Any) -> list[str]:
    """The tensor names transformers saves for this config (its state dict, tied head left out as it saves)."""
    from transformers import LlamaForCausalLM as HFLlama

    model = HFLlama(llama_config(**overrides))
    names = list(model.state_dict())
    if model.config.tie_word_embeddings:
        names.remove("lm_head.weight")
    return names


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("pp_size", [1, 2, 3])
def test_every_checkpoint_tensor_classifies_and_the_stages_cover_all_parameters(tied: bool, pp_size: int) -> None:
    """On every stage each of transformers' tensor names maps or is skipped (never None), and each stage's
    parameters are all loaded by the mapped names."""
    overrides = {"tie_word_embeddings": tied, "attention_bias": True, "mlp_bias": True}
    names = hf_checkpoint_names(**overrides)
    for pp_rank in range(pp_size):
        stage = llama_stage(pp_rank, pp_size, **overrides)
        results = {name: stage.checkpoint_name_to_param(name) for name in names}
        assert None not in results.values(), [name for name, result in results.items() if result is None]
        mapped = {result[0] for result in results.values() if isinstance(result, tuple)}
        assert mapped == {name for name, _ in stage.named_parameters()}
        skipped = {name for name, result in results.items() if result is CheckpointSkip.OTHER_STAGE}
        if pp_size == 1:
            assert not skipped


def test_checkpoint_classification_cases() -> None:
    first, last = llama_stage(0, 2), llama_stage(1, 2)
    tied_first, tied_last = llama_stage(0, 2, tie_word_embeddings=True), llama_stage(1, 2, tie_word_embeddings=True)
    assert first.checkpoint_name_to_param("model.layers.1.self_attn.k_proj.weight") == (
        "layers.1.self_attn.qkv_proj.weight",
        "k",
    )
    assert first.checkpoint_name_to_param("model.layers.0.mlp.up_proj.weight") == (
        "layers.0.mlp.gate_up_proj.weight",
        1,
    )
    # Another stage's layer, embedding, norm and head.
    assert first.checkpoint_name_to_param("model.layers.3.mlp.down_proj.weight") is CheckpointSkip.OTHER_STAGE
    assert last.checkpoint_name_to_param("model.layers.0.input_layernorm.weight") is CheckpointSkip.OTHER_STAGE
    assert first.checkpoint_name_to_param("model.norm.weight") is CheckpointSkip.OTHER_STAGE
    assert first.checkpoint_name_to_param("lm_head.weight") is CheckpointSkip.OTHER_STAGE
    assert last.checkpoint_name_to_param("model.embed_tokens.weight") is CheckpointSkip.OTHER_STAGE
    assert last.checkpoint_name_to_param("lm_head.weight") == ("lm_head.weight", None)
    # Tied head: never loaded from lm_head.weight; a last stage without the embedding loads it from the embedding.
    assert tied_first.checkpoint_name_to_param("lm_head.weight") is CheckpointSkip.UNUSED
    assert tied_last.checkpoint_name_to_param("lm_head.weight") is CheckpointSkip.UNUSED
    assert tied_last.checkpoint_name_to_param("model.embed_tokens.weight") == ("lm_head.weight", None)
    assert tied_first.checkpoint_name_to_param("model.embed_tokens.weight") == ("embed_tokens.weight", None)
    for name in ("model.layers.0.self_attn.rotary_emb.inv_freq", "model.layers.3.self_attn.rotary_emb.cos_cached"):
        assert first.checkpoint_name_to_param(name) is CheckpointSkip.UNUSED
    # Names that are no tensor of this architecture on any stage.
    for name in (
        "model.layers.0.self_attn.q_proj.qweight",
        "model.layers.3.self_attn.q_proj.scales",
        "model.layers.0.self_attn.q_proj.bias",  # attention_bias is off
        "model.layers.4.mlp.down_proj.weight",  # 4 layers: 0-3
        "model.norm.bias",
        "model.vision_tower.weight",
    ):
        assert first.checkpoint_name_to_param(name) is None, name
        assert last.checkpoint_name_to_param(name) is None, name


# ----- which models the C++ decode stack runs -----


def test_decode_stack_reasons_are_logged_per_model(caplog: pytest.LogCaptureFixture) -> None:
    """A family with the flag gets the stack where the built model allows it, else one INFO line saying why."""
    from cuda_ext.cpu_ops import load_cpu_ops
    from model_executor.cpu_decode_stack import (
        decode_stack_unsupported_reason,
        runs_decode_stack,
        stack_takes_keyword,
        with_decode_stack,
    )
    from model_executor.models.llama import LlamaForCausalLM

    if load_cpu_ops() is None:
        pytest.skip("the C++ kernels do not build here")
    stack_class = with_decode_stack(LlamaForCausalLM)
    assert issubclass(stack_class, LlamaForCausalLM) and stack_class.__name__ == "LlamaForCausalLM"
    config = llama_config()
    runnable = stack_class(config, ParallelContext(), "cpu", CPU)
    assert decode_stack_unsupported_reason(runnable) is None
    assert runnable.prepare_decode_stack() and runs_decode_stack(runnable)

    def reason_of(model: Any) -> str:
        with caplog.at_level(logging.INFO, logger="model_executor.cpu_decode_stack"):
            caplog.clear()
            assert not model.prepare_decode_stack() and not runs_decode_stack(model)
        (line,) = [record.getMessage() for record in caplog.records]
        assert line.startswith("decode steps run layer by layer: ")
        return line

    assert "tensor parallel size 2" in reason_of(stack_class(config, ParallelContext(tp_size=2), "cpu", CPU))
    torch_backend = stack_class(config, ParallelContext(), "torch", CPU)
    assert "attention backend ['TorchAttentionBackend']" in reason_of(torch_backend)
    bf16_unpacked = stack_class(config, ParallelContext(), "cpu", CPU).to(torch.bfloat16)
    assert "dtype bfloat16 with weights packed for neither" in reason_of(bf16_unpacked)
    mixed_windows = stack_class(llama_config(sliding_window=20), ParallelContext(), "cpu", CPU)
    mixed_windows.layers["1"].self_attn.sliding_window = None
    if stack_takes_keyword(load_cpu_ops(), "sliding_window"):
        assert decode_stack_unsupported_reason(mixed_windows) is None
    else:
        assert "sliding windows differ across layers ([20, None])" in reason_of(mixed_windows)


def test_families_without_the_flag_say_at_each_load_that_the_stack_is_not_implemented(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every engine built in a process says why its decode steps run layer by layer, not only the first one."""
    from model_executor.cpu_decode_stack import with_decode_stack
    from model_executor.models.llama import LlamaForCausalLM

    class UnstackedLlamaForCausalLM(LlamaForCausalLM):
        supports_decode_stack = False

    with caplog.at_level(logging.INFO, logger="model_executor.cpu_decode_stack"):
        assert with_decode_stack(UnstackedLlamaForCausalLM) is UnstackedLlamaForCausalLM
        assert with_decode_stack(UnstackedLlamaForCausalLM) is UnstackedLlamaForCausalLM
    messages = [record.getMessage() for record in caplog.records]
    assert messages == ["decode stack: not implemented for UnstackedLlamaForCausalLM"] * 2


def windowed_qk_norm_llama_class() -> type:
    """Llama layers with what Qwen2 / Qwen3 add for the stack: sliding windows on even layers only and per-head q/k
    RMSNorms."""
    from model_executor.layers.attention import DecoderAttention
    from model_executor.layers.norm import RMSNorm
    from model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

    class WindowedQKNormLlamaForCausalLM(LlamaForCausalLM):
        def make_layer(self, index: int) -> torch.nn.Module:
            config, head_dim = self.config, 16
            attention = DecoderAttention(
                config.hidden_size,
                config.num_attention_heads,
                config.num_key_value_heads,
                head_dim,
                self.parallel,
                self.attention_backend_name,
                self.device,
                qkv_bias=True,
                sliding_window=5 if index % 2 == 0 else None,
                q_norm=RMSNorm(head_dim, config.rms_norm_eps),
                k_norm=RMSNorm(head_dim, config.rms_norm_eps),
            )
            mlp = LlamaMLP(config.hidden_size, config.intermediate_size, self.parallel)
            return LlamaDecoderLayer(attention, mlp, config.hidden_size, config.rms_norm_eps)

    return WindowedQKNormLlamaForCausalLM


def test_decode_stack_runs_per_layer_windows_and_qk_norms_as_the_layers_do() -> None:
    """Where the built stack takes per-layer windows and q/k norms, a decode step through it equals the layer-by-layer
    step (outputs and caches), with windows shorter than the cached sequences."""
    from cuda_ext.attention.base import AttentionBatch
    from cuda_ext.cpu_ops import load_cpu_ops
    from model_executor.cpu_decode_stack import stack_takes_keyword, with_decode_stack

    ops = load_cpu_ops()
    if ops is None or not stack_takes_keyword(ops, "q_norm_weight"):
        pytest.skip("this build's decoder stack takes no per-layer windows or q/k norms")
    model = with_decode_stack(windowed_qk_norm_llama_class())(llama_config(), ParallelContext(), "cpu", CPU)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.3 * torch.randn_like(param) if "norm" in name else 0.2 * torch.randn_like(param))
    assert model.prepare_decode_stack()
    block_size, num_blocks = 4, 64
    caches = [model.attention_backend.allocate_kv_cache(num_blocks, block_size, torch.float32, CPU) for _ in range(4)]
    num_cached = [3, 11, 19]
    tables = [list(range(i * 8, (i + 1) * 8)) for i in range(len(num_cached))]

    def step(new: list[int], cached: list[int], step_tables: list[list[int]], step_caches: list[torch.Tensor]) -> Any:
        slots, positions = [], []
        for count, done, table in zip(new, cached, step_tables, strict=True):
            positions += list(range(done, done + count))
            slots += [table[pos // block_size] * block_size + pos % block_size for pos in range(done, done + count)]
        seq_lens = [done + count for count, done in zip(new, cached, strict=True)]
        batch = AttentionBatch(new, seq_lens, step_tables, slots, sum(1 for count in new if count == 1))
        metadata = model.attention_backend.build_metadata(batch, block_size, CPU)
        position_tensor = torch.tensor(positions)
        with torch.inference_mode():
            return model(position_tensor * 7 % 300, position_tensor, step_caches, metadata)

    for cached, table in zip(num_cached, tables, strict=True):
        step([cached], [0], [table], caches)
    results = {}
    stack = model.decode_stack
    for name, decode_stack in (("stack", stack), ("layers", None)):
        model.decode_stack = decode_stack
        step_caches = [cache.clone() for cache in caches]
        results[name] = (step([1] * len(num_cached), num_cached, tables, step_caches), step_caches)
    model.decode_stack = stack
    torch.testing.assert_close(results["stack"][0], results["layers"][0], atol=1e-4, rtol=1e-4)
    for stack_cache, layer_cache in zip(results["stack"][1], results["layers"][1], strict=True):
        torch.testing.assert_close(stack_cache, layer_cache, atol=1e-4, rtol=1e-4)
