"""Our AMX bf16 GEMM (cuda_ext.cpu_ops pack_amx_weight / amx_linear) and the linear method on it (the C++ decoder
stack in bf16 on it: tests/test_cpu_bf16_decode_stack.py). Run where the CPU has AMX tiles (Intel Xeon from
Sapphire Rapids on); elsewhere bf16 runs on the bf16 panels (tests/test_cpu_bf16_gemm.py).

TDPBF16PS multiplies bf16 values exactly and sums them in fp32, so against the exact product of the same bf16
values every output is within the fp32 summation bound, plus one rounding to bf16 for a bf16 output (the bound of
tests/test_cpu_bf16_gemm.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cuda_ext.cpu_ops import load_cpu_ops
from tests.test_cpu_bf16_gemm import (
    assert_bf16_model_runs_its_linears_on,
    assert_same_bits_on_any_number_of_threads,
    assert_within_bound,
)

OPS = load_cpu_ops()
pytestmark = pytest.mark.skipif(
    OPS is None or not getattr(OPS, "has_amx", False) or not OPS.amx_usable(),
    reason="the AMX kernel needs the C++ CPU kernels built for, and run on, a CPU with AMX-BF16",
)


@pytest.mark.parametrize(
    ("rows", "columns"),
    # SmolLM2's projections; rows not a multiple of 16 (a partial output block, an odd block count); columns not
    # a multiple of 32 (zero-padded depth); one column; one row.
    [(576, 576), (192, 576), (576, 1536), (49, 7), (100, 577), (5, 1), (1, 2), (40, 1535)],
)
# 16 and 32: whole token blocks; 0: nothing to do; 1 a decode token; 13, 33 and 97 leave partial blocks.
@pytest.mark.parametrize("num_tokens", [0, 1, 13, 16, 32, 33, 97])
def test_amx_linear_matches_exact_products_at_any_shape(rows: int, columns: int, num_tokens: int) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + columns)
    # A column slice of a wider matrix (rows further apart than their length), x's rows strided too.
    weight = torch.randn(rows, columns + 5, generator=generator).bfloat16()[:, 2 : 2 + columns]
    x = torch.randn(num_tokens, columns + 3, generator=generator)[:, :columns]
    bias = torch.randn(rows, generator=generator).bfloat16().float()
    x_bf16 = x.bfloat16()
    packed = OPS.pack_amx_weight(weight)
    for x_in in (x_bf16, x):  # fp32 x is rounded to bf16 as torch rounds it
        results = {}
        for out_dtype in (torch.float32, torch.bfloat16):
            # A wider output: the kernel writes its own columns only (as into a slice of a fused output), whole
            # blocks of fp32 sums stored straight from the tiles included.
            out = torch.full((num_tokens, rows + 6), float("nan"), dtype=out_dtype)
            own = out[:, 2 : 2 + rows]
            OPS.amx_linear(own, x_in, packed)
            assert out[:, :2].isnan().all() and out[:, 2 + rows :].isnan().all()
            assert_within_bound(own, x_bf16, weight)
            results[out_dtype] = own.clone()
            # The bias joins the fp32 sums before the one rounding: the bound of [x, 1] @ [W, b]^T.
            OPS.amx_linear(own, x_in, packed, bias)
            assert out[:, :2].isnan().all() and out[:, 2 + rows :].isnan().all()
            x_one = torch.cat([x_bf16, torch.ones(num_tokens, 1, dtype=torch.bfloat16)], dim=1)
            assert_within_bound(own, x_one, torch.cat([weight, bias.bfloat16()[:, None]], dim=1))
        assert torch.equal(results[torch.bfloat16], results[torch.float32].bfloat16())


def test_pack_amx_weight_layout() -> None:
    """packed[n, k, r, j, h] = weight[16 n + j, 32 k + 2 r + h], zero past the last row and column; fp32 weights
    are rounded to bf16 first."""
    generator = torch.Generator().manual_seed(3)
    rows, columns = 35, 40
    weight = torch.randn(rows, columns, generator=generator)
    packed = OPS.pack_amx_weight(weight.bfloat16())
    assert packed.dtype == torch.bfloat16 and packed.shape == (3, 2, 16, 16, 2)
    padded = torch.zeros(3 * 16, 2 * 32, dtype=torch.bfloat16)
    padded[:rows, :columns] = weight.bfloat16()
    expected = padded.view(3, 16, 2, 16, 2).permute(0, 2, 3, 1, 4)
    assert torch.equal(packed, expected)
    assert torch.equal(OPS.pack_amx_weight(weight), packed)


def test_amx_linear_refuses_what_it_cannot_take() -> None:
    weight = torch.randn(96, 64).bfloat16()
    packed = OPS.pack_amx_weight(weight)
    x = torch.randn(4, 64).bfloat16()
    with pytest.raises(RuntimeError, match="pack_amx_weight of a"):
        OPS.amx_linear(torch.empty(4, 96), torch.randn(4, 66).bfloat16(), packed)
    with pytest.raises(RuntimeError, match="pack_amx_weight of a"):
        OPS.amx_linear(torch.empty(4, 112), x, packed)
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        OPS.amx_linear(torch.empty(4, 96, dtype=torch.float64), x, packed)
    with pytest.raises(RuntimeError, match="from pack_amx_weight"):
        OPS.amx_linear(torch.empty(4, 96), x, OPS.pack_bf16_panels(weight))
    with pytest.raises(RuntimeError, match="one row per token"):
        OPS.amx_linear(torch.empty(5, 96), x, packed)
    with pytest.raises(RuntimeError, match="bias must be"):
        OPS.amx_linear(torch.empty(4, 96), x, packed, torch.zeros(95))


def test_amx_linear_gives_the_same_bits_on_any_number_of_threads() -> None:
    assert_same_bits_on_any_number_of_threads(OPS.pack_amx_weight, OPS.amx_linear)


@pytest.mark.parametrize(("rows", "columns", "num_tokens"), [(576, 1536, 489), (96, 577, 512)])
def test_amx_linear_of_a_prefill_chunk_is_the_same_on_any_number_of_threads(
    rows: int, columns: int, num_tokens: int
) -> None:
    """A prefill chunk's x is rounded into tile order on the pool threads (token blocks split among them; a partial
    last block zero-padded): fp32 and bf16 x give the one-thread bits, within the bound. 489 tokens of 1536 columns
    run as two panels of x (the second partial), 512 of 577 as one."""
    generator = torch.Generator().manual_seed(num_tokens)
    weight = torch.randn(rows, columns, generator=generator).bfloat16()
    packed = OPS.pack_amx_weight(weight)
    x = torch.randn(num_tokens, columns + 3, generator=generator)[:, :columns]
    previous = torch.get_num_threads()
    try:
        for x_in in (x, x.bfloat16()):
            results = []
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                out = torch.empty(num_tokens, rows)
                OPS.amx_linear(out, x_in, packed)
                results.append(out)
            assert_within_bound(results[0], x.bfloat16(), weight)
            assert all(torch.equal(result, results[0]) for result in results[1:])
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize(
    ("num_tokens", "inter", "columns", "with_bias", "x_dtype"),
    # One token; a partial last token block with an odd number of gate blocks (the last depth tile half filled);
    # SmolLM2's MLP; a prefill chunk past one panel; a single gate block.
    [
        (1, 64, 40, False, torch.float32),
        (50, 48, 577, True, torch.float32),
        (64, 1536, 576, False, torch.bfloat16),
        (513, 96, 64, True, torch.bfloat16),
        (33, 16, 32, False, torch.float32),
    ],
)
def test_gate_up_silu_gives_the_down_projections_tiles_of_silu_and_mul(
    num_tokens: int, inter: int, columns: int, with_bias: bool, x_dtype: torch.dtype
) -> None:
    """SiLU-and-mul in the fused gate_up projection's epilogue: the down projection's input tiles hold exactly the
    bits of amx_linear, then silu_and_mul, then a rounding to bf16 (what the stack computed in three passes), and
    zeros in every padded row and column (the tiles start as NaN: everything is written)."""
    generator = torch.Generator().manual_seed(num_tokens)
    weight = torch.randn(2 * inter, columns, generator=generator).bfloat16()
    x = torch.randn(num_tokens, columns, generator=generator).to(x_dtype)
    bias = torch.randn(2 * inter, generator=generator) if with_bias else None
    packed = OPS.pack_amx_weight(weight)
    tiles = OPS.amx_gate_up_silu(x, packed, inter, bias)
    token_blocks, depth_blocks = -(-num_tokens // 16), -(-inter // 32)
    assert tiles.shape == (token_blocks, depth_blocks, 16, 32) and tiles.dtype == torch.bfloat16
    rows = tiles.permute(0, 2, 1, 3).reshape(token_blocks * 16, depth_blocks * 32)
    gate_up = torch.empty(num_tokens, 2 * inter)
    OPS.amx_linear(gate_up, x, packed, bias)
    activated = torch.empty(num_tokens, inter)
    OPS.silu_and_mul(activated, gate_up)
    assert torch.equal(rows[:num_tokens, :inter], activated.bfloat16())
    assert (rows[num_tokens:] == 0).all() and (rows[:, inter:] == 0).all()
    with pytest.raises(RuntimeError, match="multiple of 16"):
        OPS.amx_gate_up_silu(x, OPS.pack_amx_weight(weight[: 2 * 36]), 36)


def test_bf16_model_runs_its_linears_on_amx_tiles(tiny_qwen2_dir: Path) -> None:
    """On an AMX CPU: our AMX kernel up to its token limit, oneDNN's beyond; decode steps take the stack."""
    from model_executor.layers.linear import CpuAmxLinearMethod

    def amx_sums(qkv: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        sums = torch.empty(x.shape[0], qkv.weight.shape[0])
        OPS.amx_linear(sums, x, qkv.amx_weight, qkv.bias.float())
        return sums

    model = assert_bf16_model_runs_its_linears_on(tiny_qwen2_dir, CpuAmxLinearMethod, amx_sums, 150)
    assert model.decode_stack is not None
