"""The Triton RMSNorm, rotary and SiLU-and-mul kernels (cuda_ext.kernels.fused_elementwise) against the torch
references in cuda_ext.fused_ops: under the Triton CPU interpreter on CPU tensors, compiled on CUDA where present.

TRITON_INTERPRET=1 must be set before anything imports triton: tests/conftest.py sets it where there is no GPU.
Tolerances: fp32 1e-5; fp16 and bf16 one output ulp (1e-3, 8e-3 relative), since both sides round the same fp32 values
but may sum a row in a different order. The interpreter truncates fp32 to bf16 where the GPU rounds to nearest, so
interpreted bf16 gets two ulps and no exact checks.
"""

from __future__ import annotations

import pytest
import torch

from cuda_ext import fused_ops
from cuda_ext.kernels import fused_elementwise
from cuda_ext.kernels import unified_attention as unified_attention_module

INTERPRETED = unified_attention_module.INTERPRETED
ON_CUDA = torch.cuda.is_available() and not INTERPRETED
# Interpreted kernels take CPU tensors; compiled ones need the GPU.
DEVICE = torch.device("cuda") if ON_CUDA else torch.device("cpu")
runs_here = pytest.mark.skipif(
    not (INTERPRETED or ON_CUDA), reason="no CUDA GPU, and TRITON_INTERPRET was set to something other than 1"
)
TOLERANCES = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1.6e-2 if INTERPRETED else 8e-3}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tolerance = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)


@runs_here
@DTYPES
@pytest.mark.parametrize("hidden", [576, 64, 100])
def test_rms_norm_matches_reference(dtype: torch.dtype, hidden: int) -> None:
    x = randn(7, hidden, dtype=dtype, seed=0) * 3
    weight = randn(hidden, dtype=dtype, seed=1)
    assert_close(fused_elementwise.rms_norm(x, weight, 1e-5), fused_ops.rms_norm_reference(x, weight, 1e-5))


@runs_here
@DTYPES
def test_fused_add_rms_norm_writes_the_sum_and_the_norm_in_place(dtype: torch.dtype) -> None:
    # Strided rows: x is every other row of a wider buffer, as a sliced activation can be.
    wide = randn(5, 2 * 576, dtype=dtype, seed=2)
    x = wide[:, :576]
    residual = randn(5, 576, dtype=dtype, seed=3)
    weight = randn(576, dtype=dtype, seed=4)
    summed = x + residual
    expected = fused_ops.rms_norm_reference(summed, weight, 1e-6)
    untouched = wide[:, 576:].clone()
    normed = fused_elementwise.rms_norm(x, weight, 1e-6, residual)
    assert normed.data_ptr() == x.data_ptr()
    if INTERPRETED and dtype == torch.bfloat16:
        assert_close(residual, summed)
    else:
        assert torch.equal(residual, summed)  # the sum rounded to the dtype, as the reference's add
    assert_close(normed, expected)
    assert torch.equal(wide[:, 576:], untouched)


@runs_here
@DTYPES
@pytest.mark.parametrize("half", [1536, 100, 2048])
def test_silu_and_mul_matches_reference(dtype: torch.dtype, half: int) -> None:
    gate_up = randn(6, 2 * half, dtype=dtype, seed=5) * 4
    expected = torch.nn.functional.silu(gate_up[:, :half]) * gate_up[:, half:]
    assert_close(fused_elementwise.silu_and_mul(gate_up), expected)


@runs_here
@DTYPES
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 128), (6, 2, 40)])
def test_rotary_matches_reference_on_strided_query_and_key(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    tokens = 11
    # Query and key are views into one fused QKV buffer, as the model slices them.
    qkv = randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=6)
    query = qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
    key = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(tokens, num_kv_heads, head_dim)
    angles = torch.rand(tokens, 1, head_dim // 2, generator=torch.Generator().manual_seed(7)).to(DEVICE) * 6.3
    cos, sin = angles.cos(), angles.sin()
    expected_query, expected_key = query.clone(), key.clone()
    fused_ops.rotary_reference(expected_query, expected_key, cos, sin, head_dim // 2)
    value_before = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()
    fused_elementwise.apply_rotary(query, key, cos, sin)
    assert_close(query, expected_query)
    assert_close(key, expected_key)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim :], value_before)


@runs_here
def test_no_rows_is_a_no_op() -> None:
    empty = torch.empty(0, 64, device=DEVICE)
    weight = torch.ones(64, device=DEVICE)
    assert fused_elementwise.rms_norm(empty, weight, 1e-5).shape == (0, 64)
    assert fused_elementwise.rms_norm(empty, weight, 1e-5, torch.empty(0, 64, device=DEVICE)).shape == (0, 64)
    assert fused_elementwise.silu_and_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)
    fused_elementwise.apply_rotary(
        torch.empty(0, 4, 64, device=DEVICE),
        torch.empty(0, 2, 64, device=DEVICE),
        torch.empty(0, 1, 32, device=DEVICE),
        torch.empty(0, 1, 32, device=DEVICE),
    )


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="the fused ops dispatch to Triton on CUDA")
def test_fused_ops_dispatch_cuda_tensors_to_the_triton_kernels() -> None:
    cuda = torch.device("cuda")
    x = torch.randn(3, 576, device=cuda, dtype=torch.bfloat16)
    residual = torch.randn(3, 576, device=cuda, dtype=torch.bfloat16)
    weight = torch.randn(576, device=cuda, dtype=torch.bfloat16)
    summed = x + residual
    normed, returned_residual = fused_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    # The Triton path writes in place (the torch reference returns new tensors).
    assert normed.data_ptr() == x.data_ptr() and returned_residual.data_ptr() == residual.data_ptr()
    assert torch.equal(returned_residual, summed)
