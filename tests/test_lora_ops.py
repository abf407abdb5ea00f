"""Batched LoRA (cuda_ext.lora_ops): the torch path and the Triton shrink/expand kernels against a naive per-row
reference in float64. The kernels run under the Triton CPU interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1 where there is no GPU) and compiled where CUDA is present.

Interpreter tests keep shapes to a few programs and use fp32 (the interpreter's bf16 dot is unreliable; its casts
to bf16 truncate), except one bf16 case with bf16 tolerances.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cuda_ext import lora_ops
from cuda_ext.kernels import lora as lora_kernels
from cuda_ext.lora_ops import LoraRowGroups, add_lora, add_lora_sliced

REPO_ROOT = Path(__file__).resolve().parents[1]
INTERPRETED = lora_kernels.INTERPRETED
ON_CUDA = torch.cuda.is_available() and not INTERPRETED
# Interpreted kernels take CPU tensors; compiled ones need the GPU.
KERNEL_DEVICE = torch.device("cuda") if ON_CUDA else torch.device("cpu")
kernels_run_here = pytest.mark.skipif(
    not (INTERPRETED or ON_CUDA), reason="no CUDA GPU, and TRITON_INTERPRET was set to something other than 1"
)
# (atol, rtol): fp32 differs from float64 only by summation order; bf16 by a few roundings of values of order 1.
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (6e-2, 3e-2)}


@pytest.fixture(params=["masked", "grouped"])
def torch_form(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a torch-path test in both of its forms, whatever the batch size: all slots masked, or rows grouped."""
    monkeypatch.setattr(lora_ops, "DENSE_MAX_MACS", 10**15 if request.param == "masked" else 0)
    return request.param


def randn(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    values = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale
    return values.to(device or "cpu", dtype)


def random_slots(num_rows: int, num_slots: int, seed: int) -> torch.Tensor:
    """Slots in [-1, num_slots), shuffled (rows of one slot are not adjacent)."""
    return torch.randint(-1, num_slots, (num_rows,), generator=torch.Generator().manual_seed(seed))


def adapter_weights(
    num_slots: int, ranks: list[int], hidden: int, out_features: int, seed: int, dtype: torch.dtype, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked A [L, R, K] and B [L, N, R] with R = max(ranks): slot i's ranks past ranks[i] are zeros."""
    max_rank = max(ranks)
    lora_a = randn(num_slots, max_rank, hidden, seed=seed, scale=hidden**-0.5)
    lora_b = randn(num_slots, out_features, max_rank, seed=seed + 1, scale=0.5)
    for slot, rank in enumerate(ranks):
        lora_a[slot, rank:] = 0
        lora_b[slot, :, rank:] = 0
    return lora_a.to(device or "cpu", dtype), lora_b.to(device or "cpu", dtype)


def reference_add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    row_slots: torch.Tensor,
    scalings: torch.Tensor,
    offset: int = 0,
) -> torch.Tensor:
    """out with scaling * B (A x) added row by row in float64 (a new tensor)."""
    expected = out.double().cpu().clone()
    for row, slot in enumerate(row_slots.tolist()):
        if slot < 0:
            continue
        low_rank = lora_a[slot].double().cpu() @ x[row].double().cpu()
        delta = float(scalings[slot]) * (lora_b[slot].double().cpu() @ low_rank)
        expected[row, offset : offset + delta.shape[0]] += delta
    return expected


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOLERANCES[actual.dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_rows", [1, 7, 300])
def test_torch_path_matches_per_row_reference_with_mixed_slots(
    dtype: torch.dtype, num_rows: int, torch_form: str
) -> None:
    num_slots, hidden, out_features = 4, 96, 80
    lora_a, lora_b = adapter_weights(num_slots, [8, 16, 4, 16], hidden, out_features, seed=1, dtype=dtype)
    x = randn(num_rows, hidden, seed=2, dtype=dtype)
    out = randn(num_rows, out_features, seed=3, dtype=dtype)
    row_slots = random_slots(num_rows, num_slots, seed=num_rows)
    scalings = torch.tensor([2.0, 0.5, 1.0, 4.0])
    expected = reference_add_lora(out, x, lora_a, lora_b, row_slots, scalings)
    base_rows = out[row_slots < 0].clone()
    add_lora(out, x, lora_a, lora_b, row_slots, scalings)
    assert_close(out, expected)
    # Rows without an adapter keep the base output bit for bit.
    assert torch.equal(out[row_slots < 0], base_rows)


def test_torch_path_with_one_slot_for_every_row(torch_form: str) -> None:
    lora_a, lora_b = adapter_weights(3, [8, 8, 8], 64, 48, seed=4, dtype=torch.float32)
    x = randn(10, 64, seed=5)
    out = randn(10, 48, seed=6)
    row_slots = torch.full((10,), 2)
    scalings = torch.tensor([1.0, 1.0, 3.0])
    expected = reference_add_lora(out, x, lora_a, lora_b, row_slots, scalings)
    add_lora(out, x, lora_a, lora_b, row_slots, scalings)
    assert_close(out, expected)


@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=kernels_run_here)], ids=["torch", "triton"])
def test_no_rows_and_no_adapted_rows_leave_out_unchanged(use_triton: bool) -> None:
    device = KERNEL_DEVICE if use_triton else torch.device("cpu")
    lora_a, lora_b = adapter_weights(2, [16, 16], 32, 24, seed=7, dtype=torch.float32, device=device)
    scalings = torch.ones(2, device=device)
    empty_out = torch.empty(0, 24, device=device)
    add_lora(empty_out, torch.empty(0, 32, device=device), lora_a, lora_b, torch.empty(0, dtype=torch.int64), scalings)
    assert empty_out.shape == (0, 24)
    out = randn(5, 24, seed=8, device=device)
    before = out.clone()
    no_adapter = torch.full((5,), -1, device=device)
    add_lora(out, randn(5, 32, seed=9, device=device), lora_a, lora_b, no_adapter, scalings, use_triton=use_triton)
    assert torch.equal(out, before)


def test_slot_out_of_range_is_refused() -> None:
    lora_a, lora_b = adapter_weights(2, [4, 4], 16, 8, seed=10, dtype=torch.float32)
    with pytest.raises(ValueError, match="row_slots"):
        add_lora(torch.zeros(3, 8), randn(3, 16, seed=11), lora_a, lora_b, torch.tensor([0, 2, -1]), torch.ones(2))


def test_shape_mismatch_is_refused() -> None:
    lora_a, lora_b = adapter_weights(2, [4, 4], 16, 8, seed=12, dtype=torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        add_lora(torch.zeros(3, 8), randn(3, 20, seed=13), lora_a, lora_b, torch.tensor([0, 1, -1]), torch.ones(2))
    with pytest.raises(ValueError, match="overruns"):
        add_lora(torch.zeros(3, 6), randn(3, 16, seed=13), lora_a, lora_b, torch.tensor([0, 1, -1]), torch.ones(2))


def qkv_slices(num_slots: int, hidden: int, widths: list[int], ranks: list[int], dtype: torch.dtype, device=None):
    """Per-slice (A, B) for a merged projection; slice widths differ (K/V narrower than Q)."""
    return [
        adapter_weights(num_slots, [rank] * num_slots, hidden, width, seed=20 + 2 * index, dtype=dtype, device=device)
        for index, (width, rank) in enumerate(zip(widths, ranks, strict=True))
    ]


def check_sliced(use_triton: bool, device: torch.device, num_rows: int) -> None:
    num_slots, hidden = 3, 64
    widths, ranks, offsets = [64, 16, 16], [8, 16, 8], [0, 64, 80]
    slices = qkv_slices(num_slots, hidden, widths, ranks, torch.float32, device)
    # The K slice is adapted by no slot: it is passed as None.
    lora_a_slices = [slices[0][0], None, slices[2][0]]
    lora_b_slices = [slices[0][1], None, slices[2][1]]
    # A wider buffer: out is a column view with a row stride larger than its width, as a sliced activation can be.
    wide = randn(num_rows, 128, seed=30, device=device)
    out = wide[:, :96]
    x = randn(num_rows, hidden, seed=31, device=device)
    row_slots = random_slots(num_rows, num_slots, seed=32).to(device)
    scalings = torch.tensor([[1.0, 2.0, 0.5], [9.0, 9.0, 9.0], [0.25, 1.0, 3.0]], device=device)
    base = out.double().cpu()
    expected = base
    for index in (0, 2):
        lora_a, lora_b = slices[index]
        expected = reference_add_lora(expected, x, lora_a, lora_b, row_slots.cpu(), scalings[index], offsets[index])
    untouched = wide[:, 96:].clone()
    groups = LoraRowGroups(row_slots, num_slots)
    add_lora_sliced(out, x, lora_a_slices, lora_b_slices, groups, scalings, offsets, use_triton=use_triton)
    assert_close(out, expected)
    assert torch.equal(wide[:, 96:], untouched)
    # The grouping is reused by a second layer of the same step (here the same layer again: the delta doubles).
    add_lora_sliced(out, x, lora_a_slices, lora_b_slices, groups, scalings, offsets, use_triton=use_triton)
    assert_close(out, 2 * expected - base)


def test_sliced_torch_path_matches_reference(torch_form: str) -> None:
    check_sliced(use_triton=False, device=torch.device("cpu"), num_rows=40)


def add_lora_with_kernels(out, x, lora_a, lora_b, row_slots, scalings) -> torch.Tensor:
    """`out` plus the LoRA rows, computed by the Triton kernels on KERNEL_DEVICE (a copy of out comes back)."""
    out_device = out.to(KERNEL_DEVICE)
    tensors = (x, lora_a, lora_b, row_slots, scalings)
    add_lora(out_device, *(tensor.to(KERNEL_DEVICE) for tensor in tensors), use_triton=True)
    return out_device


@kernels_run_here
def test_sliced_triton_kernels_match_reference() -> None:
    check_sliced(use_triton=True, device=KERNEL_DEVICE, num_rows=20)


@kernels_run_here
@pytest.mark.parametrize(("num_rows", "num_slots"), [(5, 3), (300, 2)], ids=["decode-tile", "several-row-tiles"])
def test_triton_kernels_match_reference(num_rows: int, num_slots: int) -> None:
    hidden, out_features = 96, 80
    ranks = [8, 16, 4][:num_slots]
    lora_a, lora_b = adapter_weights(num_slots, ranks, hidden, out_features, seed=40, dtype=torch.float32)
    x = randn(num_rows, hidden, seed=41)
    out = randn(num_rows, out_features, seed=42)
    row_slots = random_slots(num_rows, num_slots, seed=43)
    scalings = torch.tensor([2.0, 0.5, 1.5][:num_slots])
    expected = reference_add_lora(out, x, lora_a, lora_b, row_slots, scalings)
    out_device = add_lora_with_kernels(out, x, lora_a, lora_b, row_slots, scalings)
    assert_close(out_device, expected)
    assert torch.equal(out_device.cpu()[row_slots < 0], out[row_slots < 0])


@kernels_run_here
def test_triton_kernels_in_bf16_match_reference() -> None:
    num_rows, num_slots, hidden, out_features = 9, 2, 64, 48
    lora_a, lora_b = adapter_weights(num_slots, [16, 8], hidden, out_features, seed=50, dtype=torch.bfloat16)
    x = randn(num_rows, hidden, seed=51, dtype=torch.bfloat16)
    out = randn(num_rows, out_features, seed=52, dtype=torch.bfloat16)
    row_slots = random_slots(num_rows, num_slots, seed=53)
    scalings = torch.tensor([2.0, 0.5])
    expected = reference_add_lora(out, x, lora_a, lora_b, row_slots, scalings)
    assert_close(add_lora_with_kernels(out, x, lora_a, lora_b, row_slots, scalings), expected)


def test_row_grouping_sorts_rows_by_slot_with_unadapted_rows_last() -> None:
    row_slots = torch.tensor([2, -1, 0, 2, 1, -1, 0])
    sorted_rows, starts, counts = lora_kernels.sort_rows_by_slot(row_slots, 3)
    assert sorted_rows.tolist() == [2, 6, 4, 0, 3, 1, 5]
    assert starts.tolist() == [0, 2, 3] and counts.tolist() == [2, 1, 2]
    groups = LoraRowGroups(row_slots, 3).torch_groups
    assert [(slot, rows.tolist()) for slot, rows in groups] == [(0, [2, 6]), (1, [4]), (2, [0, 3])]


@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA GPU")
def test_cuda_tensors_take_the_kernels_and_match_the_cpu_path() -> None:
    num_rows, num_slots, hidden, out_features = 257, 4, 512, 384
    lora_a, lora_b = adapter_weights(num_slots, [16, 64, 8, 32], hidden, out_features, seed=60, dtype=torch.bfloat16)
    x = randn(num_rows, hidden, seed=61, dtype=torch.bfloat16)
    out = randn(num_rows, out_features, seed=62, dtype=torch.bfloat16)
    row_slots = random_slots(num_rows, num_slots, seed=63)
    scalings = torch.tensor([2.0, 0.5, 1.0, 0.25])
    expected = reference_add_lora(out, x, lora_a, lora_b, row_slots, scalings)
    cuda = torch.device("cuda")
    out_cuda = out.to(cuda)
    add_lora(out_cuda, x.to(cuda), lora_a.to(cuda), lora_b.to(cuda), row_slots.to(cuda), scalings.to(cuda))
    assert_close(out_cuda, expected)


@pytest.mark.subprocess
def test_lora_kernels_compile_for_an_nvidia_gpu_without_one() -> None:
    """The interpreter does not check what the GPU compiler accepts: compile shrink and expand for sm_90 and sm_80."""
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend to compile with")
    script = (
        "from cuda_ext.kernels.offline_compile import QUICK_SHAPES, compile_lora\n"
        "for arch in (90, 80):\n"
        "    print(arch, [kernel.metadata.shared for kernel in compile_lora(QUICK_SHAPES[0], arch)])\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("[") == 2
