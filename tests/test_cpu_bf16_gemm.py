"""Our bf16 panel GEMM (cuda_ext.cpu_ops pack_bf16_panels / bf16_panel_linear) and the linear method on it.

The kernel multiplies bf16 values exactly (a product of two bf16 values fits an fp32) and sums them in fp32, so
against the exact product of the same bf16 values (float64) every output is within the fp32 summation bound
K * 2^-24 * sum_k |x_k w_k|, plus, for a bf16 output, one rounding to bf16 (2^-8 of the value).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from cuda_ext.cpu_ops import load_cpu_ops

OPS = load_cpu_ops()
pytestmark = pytest.mark.skipif(
    OPS is None or not OPS.has_bf16_panels,
    reason="the bf16 panel kernel needs the C++ CPU kernels built for a CPU with AVX512-BF16",
)

FP32_UNIT = 2.0**-24
BF16_UNIT = 2.0**-8


def bf16_bound(x_bf16: torch.Tensor, weight_bf16: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Per output, how far fp32 sums of the bf16 products (rounded to `out_dtype`) may lie from the exact value."""
    columns = x_bf16.shape[1]
    exact = x_bf16.double() @ weight_bf16.double().T
    sums_bound = (columns + 1) * FP32_UNIT * (x_bf16.double().abs() @ weight_bf16.double().abs().T)
    if out_dtype == torch.float32:
        return sums_bound
    return sums_bound + BF16_UNIT * (exact.abs() + sums_bound)


def assert_within_bound(out: torch.Tensor, x_bf16: torch.Tensor, weight_bf16: torch.Tensor) -> None:
    exact = x_bf16.double() @ weight_bf16.double().T
    error = (out.double() - exact).abs()
    bound = bf16_bound(x_bf16, weight_bf16, out.dtype)
    assert out.dtype in (torch.float32, torch.bfloat16)
    assert not out.isnan().any()
    worst = (error - bound).max().item() if error.numel() else 0.0
    assert worst <= 0.0, f"an output is {worst:.3g} past its bound"


@pytest.mark.parametrize(
    ("rows", "columns"),
    # SmolLM2's projections; rows not a multiple of the 48-row panel; odd columns; one column; one row.
    [(576, 576), (192, 576), (576, 1536), (49, 7), (100, 577), (5, 1), (1, 2), (3, 1535)],
)
# 8: a full tile; 1 a decode token; 0 a step whose rows all skip the projection; 13 and 97 leave a short tile.
@pytest.mark.parametrize("num_tokens", [0, 1, 3, 8, 13, 97])
def test_bf16_panels_match_exact_products_at_any_shape(rows: int, columns: int, num_tokens: int) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + columns)
    # A column slice of a wider matrix (rows further apart than their length), x's rows strided too.
    weight = torch.randn(rows, columns + 5, generator=generator).bfloat16()[:, 2 : 2 + columns]
    x = torch.randn(num_tokens, columns + 3, generator=generator)[:, :columns]
    x_bf16 = x.bfloat16()
    panels = OPS.pack_bf16_panels(weight)
    for x_in in (x_bf16, x):  # fp32 x is rounded to bf16 as torch rounds it
        results = {}
        for out_dtype in (torch.float32, torch.bfloat16):
            # A wider output: the kernel writes its own columns only (as into a slice of a fused output).
            out = torch.full((num_tokens, rows + 4), float("nan"), dtype=out_dtype)
            OPS.bf16_panel_linear(out[:, :rows], x_in, panels)
            assert out[:, rows:].isnan().all()
            assert_within_bound(out[:, :rows], x_bf16, weight)
            results[out_dtype] = out[:, :rows]
        # The bf16 output is the fp32 sums rounded once, to nearest even.
        assert torch.equal(results[torch.bfloat16], results[torch.float32].bfloat16())


def test_pack_bf16_panels_layout() -> None:
    """packed[p, c, j, h] = weight[48 p + j, 2 c + h], zero past the last row and column; fp32 weights are rounded
    to bf16 first."""
    generator = torch.Generator().manual_seed(3)
    rows, columns, width = 50, 7, OPS.bf16_panel_width
    weight = torch.randn(rows, columns, generator=generator)
    packed = OPS.pack_bf16_panels(weight.bfloat16())
    assert packed.dtype == torch.bfloat16 and packed.shape == (-(-rows // width), -(-columns // 2), width, 2)
    padded = torch.zeros(packed.shape[0] * width, packed.shape[1] * 2, dtype=torch.bfloat16)
    padded[:rows, :columns] = weight.bfloat16()
    expected = padded.view(packed.shape[0], width, packed.shape[1], 2).transpose(1, 2)
    assert torch.equal(packed, expected)
    assert torch.equal(OPS.pack_bf16_panels(weight), packed)


def test_bf16_panel_linear_refuses_what_it_cannot_take() -> None:
    weight = torch.randn(96, 64).bfloat16()
    panels = OPS.pack_bf16_panels(weight)
    x = torch.randn(4, 64).bfloat16()
    with pytest.raises(RuntimeError, match="pack_bf16_panels of a"):
        OPS.bf16_panel_linear(torch.empty(4, 96, dtype=torch.bfloat16), torch.randn(4, 66).bfloat16(), panels)
    with pytest.raises(RuntimeError, match="pack_bf16_panels of a"):
        OPS.bf16_panel_linear(torch.empty(4, 144, dtype=torch.bfloat16), x, panels)
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        OPS.bf16_panel_linear(torch.empty(4, 96, dtype=torch.float64), x, panels)
    with pytest.raises(RuntimeError, match="from pack_bf16_panels"):
        OPS.bf16_panel_linear(torch.empty(4, 96), x, OPS.pack_panels(weight.float()))
    with pytest.raises(RuntimeError, match="one row per token"):
        OPS.bf16_panel_linear(torch.empty(5, 96), x, panels)


def assert_same_bits_on_any_number_of_threads(pack: Any, linear: Any) -> None:
    """`linear(out, x, pack(weight))` on 1, 2 and 3 threads at 1 and 64 tokens: the same bits each time, within the
    bound (threads split the outputs; each output's sum is one thread's, in one order, whatever the split)."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(3072, 576, generator=generator).bfloat16()
    packed = pack(weight)
    previous = torch.get_num_threads()
    try:
        for num_tokens in (1, 64):
            x = torch.randn(num_tokens, 576, generator=generator).bfloat16()
            results = []
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                out = torch.empty(num_tokens, 3072, dtype=torch.bfloat16)
                linear(out, x, packed)
                results.append(out)
            assert_within_bound(results[0], x, weight)
            assert all(torch.equal(result, results[0]) for result in results[1:])
    finally:
        torch.set_num_threads(previous)


def test_bf16_panels_give_the_same_bits_on_any_number_of_threads() -> None:
    assert_same_bits_on_any_number_of_threads(OPS.pack_bf16_panels, OPS.bf16_panel_linear)


def assert_bf16_model_runs_its_linears_on(
    model_dir: Path, method_class: type, kernel_sums: Any, beyond_tokens: int
) -> torch.nn.Module:
    """A tiny bf16 Qwen 2 on CPU: every projection and the LM head on `method_class`'s kernel, each within the bound
    of the exact product (biases included: q/k/v of Qwen 2 have them) on both sides of the oneDNN crossover (up to
    `beyond_tokens`), the kernel's output the fp32 sums `kernel_sums(qkv, x)` (bias added) rounded once; it
    generates. Returns the model."""
    from configs.sampling_params import SamplingParams
    from executor import LLM
    from model_executor.layers.linear import PackableWeight

    llm = LLM(model=str(model_dir), device="cpu", dtype="bfloat16", num_kv_blocks=16, show_progress=False)
    model = llm.engine.core.executor.worker.runner.model
    modules = [module for module in model.modules() if isinstance(module, PackableWeight)]
    assert len(modules) == 4 * llm.engine.model_info.hf_config.num_hidden_layers + 1
    assert all(isinstance(module.linear_method, method_class) for module in modules)

    generator = torch.Generator().manual_seed(9)
    qkv = next(module for name, module in model.named_modules() if name.endswith("qkv_proj"))
    method = qkv.linear_method
    assert qkv.bias is not None
    for num_tokens in (1, method.max_tokens, method.max_tokens + 1, beyond_tokens):
        x = torch.randn(num_tokens, qkv.weight.shape[1], generator=generator).bfloat16()
        out = method.apply(qkv, x, qkv.bias)
        assert out.dtype == torch.bfloat16 and out.shape == (num_tokens, qkv.weight.shape[0])
        # The bias joins the sums before the one rounding: the bound of [x, 1] @ [W, b]^T.
        x_one = torch.cat([x, torch.ones(num_tokens, 1, dtype=torch.bfloat16)], dim=1)
        assert_within_bound(out, x_one, torch.cat([qkv.weight, qkv.bias[:, None]], dim=1))
        if num_tokens <= method.max_tokens:
            assert torch.equal(out, kernel_sums(qkv, x).bfloat16())

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate(["one two three"], params, use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 6
    return model


@pytest.mark.skipif(
    OPS is not None and getattr(OPS, "has_amx", False) and OPS.amx_usable(),
    reason="on a CPU with AMX a bf16 model's linears run on AMX tiles (tests/test_cpu_amx.py)",
)
def test_bf16_model_runs_its_linears_on_bf16_panels(tiny_qwen2_dir: Path) -> None:
    from model_executor.layers.linear import CpuBf16PanelLinearMethod, PackableWeight

    def panel_sums(qkv: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        sums = torch.empty(x.shape[0], qkv.weight.shape[0])
        OPS.bf16_panel_linear(sums, x, qkv.bf16_panel_weight)
        return sums.add_(qkv.bias)

    model = assert_bf16_model_runs_its_linears_on(tiny_qwen2_dir, CpuBf16PanelLinearMethod, panel_sums, 70)
    modules = [module for module in model.modules() if isinstance(module, PackableWeight)]
    assert all(module.bf16_panel_weight.dtype == torch.bfloat16 for module in modules)
