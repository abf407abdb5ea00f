"""Our C++ CPU kernels against their torch references: paged decode attention, KV write, fused layer ops."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cuda_ext import fused_ops
from cuda_ext.attention import get_attention_backend
from cuda_ext.attention.base import AttentionBatch
from cuda_ext.attention.cpu_backend import CpuAttentionBackend
from cuda_ext.attention.torch_backend import TorchAttentionBackend
from cuda_ext.cpu_ops import build_directory, load_cpu_ops

CPU = torch.device("cpu")
TOLERANCE = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}


def shuffled_block_tables(
    generator: torch.Generator, tables_needed: list[int], spare: int
) -> tuple[int, list[list[int]]]:
    """(cache size in blocks, one table per request) with every request's blocks scattered over the cache."""
    num_blocks = sum(tables_needed) + spare
    order = torch.randperm(num_blocks, generator=generator).tolist()
    block_tables, start = [], 0
    for needed in tables_needed:
        block_tables.append(order[start : start + needed])
        start += needed
    return num_blocks, block_tables


def random_decode_case(
    generator: torch.Generator,
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
):
    """A decode batch over shuffled, non-contiguous blocks, with spare blocks at the end of some tables."""
    num_blocks, block_tables = shuffled_block_tables(
        generator, [-(-seq_len // block_size) + 1 for seq_len in seq_lens], spare=3
    )
    slot_mapping = [
        table[(seq_len - 1) // block_size] * block_size + (seq_len - 1) % block_size
        for table, seq_len in zip(block_tables, seq_lens, strict=True)
    ]
    batch = AttentionBatch([1] * len(seq_lens), seq_lens, block_tables, slot_mapping, len(seq_lens))
    shape = (len(seq_lens),)
    query = torch.randn(*shape, num_heads, head_dim, generator=generator).to(dtype)
    key = torch.randn(*shape, num_kv_heads, head_dim, generator=generator).to(dtype)
    value = torch.randn(*shape, num_kv_heads, head_dim, generator=generator).to(dtype)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    return batch, query, key, value, kv_cache


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "sliding_window", "dtype"),
    [
        (4, 4, 64, 16, None, torch.float32),
        (9, 3, 64, 16, None, torch.float32),
        (8, 2, 128, 32, None, torch.float32),
        (6, 2, 40, 16, None, torch.float32),  # 5 chunks of 8 lanes: no register-resident path on any target
        (6, 2, 18, 16, None, torch.float32),  # head_dim not a multiple of any vector width
        (4, 2, 32, 5, None, torch.float32),  # key tiles of 8 cross blocks of 5
        (4, 2, 128, 16, 13, torch.float32),  # a window starting inside a block and a tile
        (8, 2, 64, 16, 20, torch.float32),
        (4, 1, 64, 16, None, torch.bfloat16),
    ],
)
def test_decode_attention_matches_torch_backend(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, sliding_window: int | None, dtype: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(num_heads * 1000 + head_dim)
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 100]
    batch, query, key, value, kv_cache = random_decode_case(
        generator, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    reference = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, sliding_window)
    ours = CpuAttentionBackend(num_heads, num_kv_heads, head_dim, sliding_window)
    reference_cache, our_cache = kv_cache.clone(), kv_cache.clone()
    expected = reference.forward(query, key, value, reference_cache, reference.build_metadata(batch, block_size, CPU))
    actual = ours.forward(query, key, value, our_cache, ours.build_metadata(batch, block_size, CPU))
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])
    assert torch.equal(our_cache, reference_cache)  # the new keys and values landed in the same slots


def test_mixed_batch_and_padding_rows_match_torch_backend() -> None:
    """Decodes plus prefill chunks in one step, and padding rows (slot -1) that must write nothing."""
    generator = torch.Generator().manual_seed(7)
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 64, 16
    query_lens, seq_lens = [1, 1, 5, 20], [9, 33, 5, 37]
    block_tables = [[3], [4, 5, 6], [7], [8, 9, 10]]
    slot_mapping = [
        table[pos // block_size] * block_size + pos % block_size
        for table, query_len, seq_len in zip(block_tables, query_lens, seq_lens, strict=True)
        for pos in range(seq_len - query_len, seq_len)
    ]
    decodes_first = AttentionBatch(query_lens, seq_lens, block_tables, slot_mapping, num_decodes=2)
    num_tokens = sum(decodes_first.query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=generator)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)
    kv_cache = torch.randn(2, 12, block_size, num_kv_heads, head_dim, generator=generator)
    reference, ours = (
        TorchAttentionBackend(num_heads, num_kv_heads, head_dim),
        CpuAttentionBackend(num_heads, num_kv_heads, head_dim),
    )
    reference_cache, our_cache = kv_cache.clone(), kv_cache.clone()
    expected = reference.forward(
        query, key, value, reference_cache, reference.build_metadata(decodes_first, block_size, CPU)
    )
    actual = ours.forward(query, key, value, our_cache, ours.build_metadata(decodes_first, block_size, CPU))
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)
    assert torch.equal(our_cache, reference_cache)
    # A padded decode step (the CUDA-graph layout) writes nothing for slot -1 and leaves real rows alone.
    padded = ours.build_decode_metadata(
        torch.tensor([9, 1], dtype=torch.int32),
        torch.tensor([[3, 0, 0], [0, 0, 0]], dtype=torch.int32),
        torch.tensor([3 * 16 + 8, -1], dtype=torch.int32),
        block_size,
    )
    before = our_cache.clone()
    new_key = torch.randn(2, num_kv_heads, head_dim, generator=generator)
    out = ours.forward(query[:2], new_key, new_key, our_cache, padded)
    changed = (our_cache != before).nonzero()[:, 1:3].unique(dim=0).tolist()
    assert changed == [[3, 8]]  # only block 3, offset 8: the real row's slot
    assert torch.isfinite(out).all()


def random_prefill_case(
    generator: torch.Generator,
    decode_seq_lens: list[int],
    query_lens: list[int],
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
):
    """Decodes, then prefill chunks whose earlier tokens (a cached prefix, or the chunks before) are already in
    the cache, all over shuffled blocks."""
    seq_lens = decode_seq_lens + [context + query for context, query in zip(context_lens, query_lens, strict=True)]
    all_query_lens = [1] * len(decode_seq_lens) + query_lens
    num_blocks, block_tables = shuffled_block_tables(
        generator, [-(-seq_len // block_size) for seq_len in seq_lens], spare=2
    )
    slot_mapping = [
        table[position // block_size] * block_size + position % block_size
        for table, query_len, seq_len in zip(block_tables, all_query_lens, seq_lens, strict=True)
        for position in range(seq_len - query_len, seq_len)
    ]
    batch = AttentionBatch(all_query_lens, seq_lens, block_tables, slot_mapping, len(decode_seq_lens))
    num_tokens = sum(all_query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    return batch, query, key, value, kv_cache


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "sliding_window", "dtype"),
    [
        (9, 3, 64, 16, None, torch.float32),  # SmolLM2's shape
        (4, 4, 64, 16, None, torch.float32),
        (8, 2, 128, 32, None, torch.float32),
        (4, 1, 32, 5, None, torch.float32),  # key tiles cross blocks of 5
        (4, 2, 64, 16, 13, torch.float32),  # windows starting inside a block, a key tile and a query tile
        (6, 2, 48, 16, 40, torch.float32),
        (6, 2, 18, 16, None, torch.float32),  # no vector path: the SDPA fallback
        (4, 1, 64, 16, None, torch.bfloat16),
    ],
)
def test_prefill_attention_matches_torch_backend(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, sliding_window: int | None, dtype: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(num_heads * 100 + head_dim + block_size)
    # Query tiles of 16 tokens: chunks of 1, 15, 16, 17 and 40 tokens, fresh or after a cached prefix.
    query_lens = [1, 15, 16, 17, 40, 3, 33]
    context_lens = [0, 0, 7, 0, 50, block_size, 100]
    batch, query, key, value, kv_cache = random_prefill_case(
        generator, [9, 30], query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    reference = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, sliding_window)
    ours = CpuAttentionBackend(num_heads, num_kv_heads, head_dim, sliding_window)
    reference_cache, our_cache = kv_cache.clone(), kv_cache.clone()
    metadata = ours.build_metadata(batch, block_size, CPU)
    assert metadata.prefill.fits_kernel  # every chunk here is short enough for the kernel
    expected = reference.forward(query, key, value, reference_cache, reference.build_metadata(batch, block_size, CPU))
    actual = ours.forward(query, key, value, our_cache, metadata)
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])
    assert torch.equal(our_cache, reference_cache)


def test_prefill_chunks_past_the_kernel_key_limit_take_sdpa_and_match() -> None:
    """A chunk after a long cached prefix sends the whole step's prefill to SDPA, short chunks included."""
    from cuda_ext.attention.cpu_backend import PREFILL_KERNEL_MAX_KEYS

    generator = torch.Generator().manual_seed(11)
    batch, query, key, value, kv_cache = random_prefill_case(
        generator, [40], [20, 5], [PREFILL_KERNEL_MAX_KEYS, 3], 9, 3, 64, 16, torch.float32
    )
    reference, ours = TorchAttentionBackend(9, 3, 64), CpuAttentionBackend(9, 3, 64)
    metadata = ours.build_metadata(batch, 16, CPU)
    assert not metadata.prefill.fits_kernel
    expected = reference.forward(query, key, value, kv_cache.clone(), reference.build_metadata(batch, 16, CPU))
    actual = ours.forward(query, key, value, kv_cache.clone(), metadata)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)


def test_prefill_attention_rejects_what_it_cannot_read() -> None:
    ops = load_cpu_ops()
    cache = torch.zeros(2, 4, 16, 1, 16)
    query, output = torch.zeros(5, 2, 16), torch.zeros(5, 2, 16)
    tables = torch.zeros(1, 1, dtype=torch.int32)
    starts = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block table is too short"):
        ops.paged_prefill_attention(
            output, query, cache[0], cache[1], tables, starts, torch.tensor([17], dtype=torch.int32), 1.0, 0
        )
    with pytest.raises(RuntimeError, match=r"1 \.\. seq_len query tokens"):
        ops.paged_prefill_attention(
            output, query, cache[0], cache[1], tables, starts, torch.tensor([4], dtype=torch.int32), 1.0, 0
        )


def paged_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: list[list[int]],
    seq_lens: list[int],
    query_lens: list[int],
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
) -> torch.Tensor:
    """Attention in fp64 straight from the definition: request i's query_lens[i] tokens are its last positions,
    each attends to the keys at or before it (the last `sliding_window` of them), scores scaled and then capped to
    soft_cap * tanh(score / soft_cap) before the softmax."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = query.shape[1] // num_kv_heads
    keys_by_slot, values_by_slot = (kv_cache[i].flatten(0, 1).double() for i in (0, 1))
    outputs, start = [], 0
    for table, seq_len, query_len in zip(block_tables, seq_lens, query_lens, strict=True):
        slots = [table[pos // block_size] * block_size + pos % block_size for pos in range(seq_len)]
        keys = keys_by_slot[slots].repeat_interleave(group, dim=1)
        values = values_by_slot[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[start : start + query_len].double(), keys) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        positions = torch.arange(seq_len - query_len, seq_len)[:, None]
        key_positions = torch.arange(seq_len)[None, :]
        allowed = key_positions <= positions
        if sliding_window is not None:
            allowed &= key_positions > positions - sliding_window
        probabilities = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        outputs.append(torch.einsum("hqk,khd->qhd", probabilities, values))
        start += query_len
    return torch.cat(outputs)


def padded_tables(block_tables: list[list[int]]) -> torch.Tensor:
    width = max(len(table) for table in block_tables)
    return torch.tensor([table + [0] * (width - len(table)) for table in block_tables], dtype=torch.int32)


# Scores around +-1 (most below a quarter of the cap, where tanh is its polynomial), around +-30 (capped hard),
# and around +-3000 (tanh saturated at +-1).
QUERY_SCALES = [0.3, 8.0, 800.0]
SOFT_CAPPED_DECODE_CASES = [
    (8, 4, 64, 16, None, torch.float32),  # a KV head's two query heads in one pass (vector lanes)
    (8, 2, 128, 16, 20, torch.float32),  # one query head at a time (vector lanes), a window
    (6, 2, 18, 16, 13, torch.float32),  # the general loop: head_dim not a multiple of any vector width
    (4, 2, 32, 5, None, torch.float32),  # key tiles across blocks of 5
    (4, 1, 64, 16, None, torch.bfloat16),
]


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "sliding_window", "dtype", "query_scale"),
    [
        (*case, query_scale)
        for case in SOFT_CAPPED_DECODE_CASES
        for query_scale in QUERY_SCALES
        # bf16 output rounds away what so gentle a cap changes.
        if case[-1] == torch.float32 or query_scale > 1
    ],
)
def test_soft_capped_decode_attention_matches_reference(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    sliding_window: int | None,
    dtype: torch.dtype,
    query_scale: float,
) -> None:
    ops = load_cpu_ops()
    soft_cap = 4.0
    generator = torch.Generator().manual_seed(num_heads * 1000 + head_dim)
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 100]
    batch, query, _, _, kv_cache = random_decode_case(
        generator, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    query = (query.float() * query_scale).to(dtype)
    scale = head_dim**-0.5
    tables = padded_tables(batch.block_tables)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    outputs = {}
    for cap in (soft_cap, 0.0):
        outputs[cap] = torch.full_like(query, float("nan"))
        ops.paged_decode_attention(
            outputs[cap], query, kv_cache[0], kv_cache[1], tables, lens, scale, sliding_window or 0, soft_cap=cap
        )
    expected = paged_attention_reference(
        query, kv_cache, batch.block_tables, seq_lens, [1] * len(seq_lens), scale, sliding_window, soft_cap
    )
    torch.testing.assert_close(outputs[soft_cap].double(), expected, **TOLERANCE[dtype])
    # A kernel that ignored the cap would fail the check above.
    assert not torch.allclose(outputs[0.0].double(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "sliding_window"),
    [
        (9, 3, 64, 16, None),
        (4, 1, 32, 5, 13),  # windows starting inside a block, a key tile and a query tile
        (6, 2, 48, 16, 40),
    ],
)
@pytest.mark.parametrize("query_scale", QUERY_SCALES)
def test_soft_capped_prefill_attention_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, sliding_window: int | None, query_scale: float
) -> None:
    ops = load_cpu_ops()
    soft_cap = 4.0
    generator = torch.Generator().manual_seed(num_heads * 100 + head_dim + block_size)
    query_lens, context_lens = [1, 15, 17, 40, 3, 33], [0, 0, 0, 50, block_size, 100]
    batch, query, _, _, kv_cache = random_prefill_case(
        generator, [], query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32
    )
    query = query * query_scale
    scale = head_dim**-0.5
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int32)
    outputs = {}
    for cap in (soft_cap, 0.0):
        outputs[cap] = torch.full_like(query, float("nan"))
        ops.paged_prefill_attention(
            outputs[cap],
            query,
            kv_cache[0],
            kv_cache[1],
            padded_tables(batch.block_tables),
            starts,
            seq_lens,
            scale,
            sliding_window or 0,
            soft_cap=cap,
        )
    expected = paged_attention_reference(
        query, kv_cache, batch.block_tables, batch.seq_lens, query_lens, scale, sliding_window, soft_cap
    )
    torch.testing.assert_close(outputs[soft_cap].double(), expected, atol=2e-5, rtol=2e-5)
    assert not torch.allclose(outputs[0.0].double(), expected, atol=2e-5, rtol=2e-5)  # the cap matters here


def test_each_capped_score_equals_cap_tanh_of_the_score() -> None:
    """One score per request, read back exactly: key 0 is e_0 with value e_0, key 1 is zero with value zero, so with
    scale 1 a query s * e_0 outputs sigmoid(capped s) in dimension 0. Scores from -60 to 60 (saturated), fine around
    zero and around a quarter of the cap (where tanh changes method), through the decode and the prefill kernel."""
    ops = load_cpu_ops()
    soft_cap, head_dim, block_size = 4.0, 64, 16
    scores = torch.cat(
        [torch.linspace(-60, 60, 241), torch.linspace(-1.5, 1.5, 301), torch.linspace(-1e-3, 1e-3, 21)]
    ).double()
    num_seqs = scores.numel()
    kv_cache = torch.zeros(2, num_seqs, block_size, 1, head_dim)
    kv_cache[:, :, 0, 0, 0] = 1.0
    query = torch.zeros(num_seqs, 1, head_dim)
    query[:, 0, 0] = scores.float()
    tables = torch.arange(num_seqs, dtype=torch.int32)[:, None]
    lens = torch.full((num_seqs,), 2, dtype=torch.int32)
    expected = torch.sigmoid(soft_cap * torch.tanh(scores / soft_cap))
    decoded, prefilled = torch.zeros_like(query), torch.zeros_like(query)
    ops.paged_decode_attention(decoded, query, kv_cache[0], kv_cache[1], tables, lens, 1.0, 0, soft_cap=soft_cap)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32)
    ops.paged_prefill_attention(
        prefilled, query, kv_cache[0], kv_cache[1], tables, starts, lens, 1.0, 0, soft_cap=soft_cap
    )
    # 1e-6 in probability: about 5e-6 of score at the steepest, a few ulp of the output's rounding.
    for output in (decoded, prefilled):
        torch.testing.assert_close(output[:, 0, 0].double(), expected, atol=1e-6, rtol=0)


def test_attention_kernels_refuse_a_negative_soft_cap() -> None:
    ops = load_cpu_ops()
    cache = torch.zeros(2, 4, 16, 1, 16)
    query, output = torch.zeros(1, 2, 16), torch.zeros(1, 2, 16)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="soft_cap must be 0"):
        ops.paged_decode_attention(output, query, cache[0], cache[1], tables, lens, 1.0, 0, soft_cap=-1.0)
    with pytest.raises(RuntimeError, match="soft_cap must be 0"):
        ops.paged_prefill_attention(
            output, query, cache[0], cache[1], tables, torch.tensor([0, 1], dtype=torch.int32), lens, 1.0, 0, -1.0
        )


def test_kv_write_rejects_a_slot_outside_the_cache() -> None:
    ops = load_cpu_ops()
    cache = torch.zeros(2, 2, 4, 1, 16)
    key = torch.ones(1, 1, 16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.reshape_and_cache(key, key, cache[0], cache[1], torch.tensor([8]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_matches_reference(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(37, 576, generator=generator).to(dtype)
    residual = torch.randn(37, 576, generator=generator).to(dtype)
    weight = torch.randn(576, generator=generator).to(dtype)
    summed = x + residual
    expected = fused_ops.rms_norm_reference(summed, weight, 1e-5)
    out, new_residual = fused_ops.fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    torch.testing.assert_close(new_residual, summed, **TOLERANCE[dtype])
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def test_rotary_on_strided_views_matches_reference() -> None:
    """Query and key are views into the fused qkv rows, rotated in place without a contiguous copy."""
    generator = torch.Generator().manual_seed(4)
    tokens, heads, kv_heads, head_dim = 11, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator)
    angles = torch.rand(tokens, 1, head_dim // 2, generator=generator) * 100
    cos, sin = angles.cos(), angles.sin()
    expected = qkv.clone()
    q_ref = expected[:, : heads * head_dim].view(tokens, heads, head_dim)
    k_ref = expected[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    fused_ops.rotary_reference(q_ref, k_ref, cos, sin, head_dim // 2)
    query = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    key = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    fused_ops.apply_rotary(query, key, cos, sin)
    torch.testing.assert_close(qkv, expected, atol=1e-5, rtol=1e-5)  # values (the last third) untouched too


def test_silu_and_mul_matches_torch_including_extremes() -> None:
    generator = torch.Generator().manual_seed(5)
    gate_up = torch.randn(9, 2 * 1537, generator=generator) * 8  # 1537: a scalar tail after the vector lanes
    gate_up[0, :6] = torch.tensor([-200.0, -90.0, -20.0, 0.0, 90.0, 200.0])
    expected = torch.nn.functional.silu(gate_up[:, :1537]) * gate_up[:, 1537:]
    torch.testing.assert_close(fused_ops.silu_and_mul(gate_up), expected, atol=1e-5, rtol=1e-5)


def test_engine_greedy_tokens_equal_with_cpu_and_torch_backends() -> None:
    from executor import LLM, SamplingParams

    prompts = [[1, *range(200 + i, 200 + i + length)] for i, length in enumerate([2, 15, 16, 17, 40])]
    outputs = {}
    for backend in ("torch", "cpu"):
        llm = LLM(
            model="tiny-random-llama", attention_backend=backend, device="cpu", num_kv_blocks=64, show_progress=False
        )
        results = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
        outputs[backend] = [result.outputs[0].token_ids for result in results]
    assert outputs["cpu"] == outputs["torch"]


@pytest.mark.subprocess
def test_auto_picks_the_cpu_kernels_and_falls_back_without_them() -> None:
    assert get_attention_backend("auto", CPU, 4, 2, 16).name == "cpu"
    script = (
        "import torch\n"
        "from configs.sections import RuntimeConfig\n"
        "from cuda_ext.cpu_ops import select_cpu_kernels\n"
        "assert select_cpu_kernels(RuntimeConfig().cpu_kernels) is None\n"
        "from cuda_ext.attention import get_attention_backend\n"
        "from cuda_ext import fused_ops\n"
        "assert get_attention_backend('auto', torch.device('cpu'), 4, 2, 16).name == 'torch'\n"
        "x = torch.randn(2, 8)\n"
        "out = fused_ops.silu_and_mul(x)\n"
        "assert torch.allclose(out, torch.nn.functional.silu(x[:, :4]) * x[:, 4:])\n"
    )
    env = {**os.environ, "PAGEDSERVE_DISABLE_CPU_KERNELS": "1"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


LOAD_SCRIPT = "from cuda_ext.cpu_ops import load_cpu_ops\nassert load_cpu_ops() is not None\n"


@pytest.mark.subprocess
def test_a_lock_left_by_a_killed_build_does_not_block_loading() -> None:
    """torch's lock file outlives a killed build, and torch alone would wait on it forever."""
    load_cpu_ops()  # built and cached, so the loader below only has to get past the lock
    torch_lock = build_directory() / "lock"
    torch_lock.touch()  # as fresh as a build killed a moment ago
    result = subprocess.run([sys.executable, "-c", LOAD_SCRIPT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert not torch_lock.exists()


@pytest.mark.subprocess
def test_a_second_loader_waits_for_a_running_build_then_loads() -> None:
    load_cpu_ops()
    with open(build_directory().with_suffix(".flock"), "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # a build in another process holds the lock
        loader = subprocess.Popen([sys.executable, "-c", LOAD_SCRIPT], stderr=subprocess.PIPE, text=True)
        try:
            with pytest.raises(subprocess.TimeoutExpired):
                loader.wait(timeout=5)
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
    _, stderr = loader.communicate(timeout=300)
    assert loader.returncode == 0, stderr


@pytest.mark.subprocess
def test_a_second_checkout_loads_the_built_kernels_without_rebuilding(tmp_path: Path) -> None:
    """A `ray job submit` working dir is a copy of the project at another path; it must not rebuild."""
    load_cpu_ops()
    built = build_directory() / f"{build_directory().name}.so"
    built_at = built.stat().st_mtime_ns
    shutil.copytree(Path(fused_ops.__file__).parent, tmp_path / "cuda_ext")
    script = LOAD_SCRIPT + "import cuda_ext\nprint(cuda_ext.__file__)\n"
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(str(tmp_path))  # the copy's loader ran
    assert built.stat().st_mtime_ns == built_at


@pytest.mark.parametrize(("rows", "columns"), [(960, 576), (7, 13), (5, 40), (1, 8), (3, 1536)])
# 6 and 13 tokens: full register blocks (6 tokens with AVX-512, 2 with AVX2) and remainders; 96 the largest it takes.
@pytest.mark.parametrize("num_tokens", [1, 3, 5, 6, 8, 13, 64, 96])
def test_linear_kernel_matches_torch_at_any_shape(rows: int, columns: int, num_tokens: int) -> None:
    ops = load_cpu_ops()
    generator = torch.Generator().manual_seed(rows * 1000 + columns)
    # A column slice of a wider matrix: rows further apart than their length, as a tensor-parallel shard could be.
    weight = torch.randn(rows, columns + 5, generator=generator)[:, 2 : 2 + columns]
    x = torch.randn(num_tokens, columns + 3, generator=generator)[:, :columns]  # strided rows too
    out = torch.full((num_tokens, rows), float("nan"))
    ops.linear_tokens(out, x, weight)
    torch.testing.assert_close(out, x @ weight.T, atol=1e-4, rtol=1e-5)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        ops.linear_tokens(out, torch.randn(num_tokens, columns + 1), weight)
    with pytest.raises(RuntimeError, match="fp32"):
        ops.linear_tokens(out.double(), x.double(), weight.double())


@pytest.mark.parametrize(("rows", "columns"), [(960, 576), (7, 13), (49, 5), (1, 8), (3, 1536), (3072, 576)])
# 8 and 6 tokens: full tiles (8 with AVX-512, 6 with AVX2) and remainders; 512 a prefill chunk; 0 a step whose
# rows all skip a projection.
@pytest.mark.parametrize("num_tokens", [0, 1, 3, 5, 6, 8, 13, 64, 97, 512])
def test_panel_kernel_matches_torch_at_any_shape(rows: int, columns: int, num_tokens: int) -> None:
    ops = load_cpu_ops()
    generator = torch.Generator().manual_seed(rows * 1000 + columns)
    # A column slice of a wider matrix: rows further apart than their length, as a tensor-parallel shard could be.
    weight = torch.randn(rows, columns + 5, generator=generator)[:, 2 : 2 + columns]
    panels = ops.pack_panels(weight)
    # Zero past the last row: the last panel's padding adds nothing to any output.
    assert panels.shape == (-(-rows // ops.panel_width), columns, ops.panel_width)
    assert not panels[-1, :, rows - (panels.shape[0] - 1) * ops.panel_width :].any()
    x = torch.randn(num_tokens, columns + 3, generator=generator)[:, :columns]  # strided rows too
    # A wider output: the kernel must write its own columns only (as a slice of a fused output would be).
    out = torch.full((num_tokens, rows + 4), float("nan"))
    ops.panel_linear(out[:, :rows], x, panels)
    torch.testing.assert_close(out[:, :rows], x @ weight.T, atol=1e-4, rtol=1e-5)
    assert out[:, rows:].isnan().all()
    with pytest.raises(RuntimeError, match="pack_panels of a"):
        ops.panel_linear(out[:, :rows], torch.randn(num_tokens, columns + 1), panels)
    with pytest.raises(RuntimeError, match="pack_panels of a"):
        ops.panel_linear(torch.empty(num_tokens, rows + ops.panel_width), x, panels)
    with pytest.raises(RuntimeError, match="fp32"):
        ops.panel_linear(out.double(), x.double(), panels)


@pytest.mark.subprocess
def test_linear_results_do_not_depend_on_which_thread_takes_which_claim() -> None:
    """Each pool thread takes claims of its share and then of the others': with a core kept busy by another process
    the threads fall out of step and take each other's claims, and every output must still come out bit for bit."""
    ops = load_cpu_ops()
    generator = torch.Generator().manual_seed(11)
    weight = torch.randn(3072, 576, generator=generator)
    x = torch.randn(64, 576, generator=generator)
    panels = ops.pack_panels(weight)
    kernels = {
        "dot": lambda out: ops.linear_tokens(out, x, weight),
        "panel": lambda out: ops.panel_linear(out, x, panels),
    }
    references = {}
    for name, kernel in kernels.items():
        references[name] = torch.empty(64, 3072)
        kernel(references[name])
        torch.testing.assert_close(references[name], x @ weight.T, atol=1e-4, rtol=1e-5)
    spin = "import time\nend = time.time() + 30\nwhile time.time() < end: pass"
    busy = subprocess.Popen([sys.executable, "-c", spin])
    try:
        for _ in range(40):
            for name, kernel in kernels.items():
                out = torch.full((64, 3072), float("nan"))
                kernel(out)
                assert torch.equal(out, references[name]), name
    finally:
        busy.kill()
        busy.wait(timeout=10)


def test_packed_cpu_linears_match_torch_and_every_projection_is_packed() -> None:
    from executor import LLM
    from model_executor.layers.linear import CpuPanelLinearMethod, OneDnnLinearMethod, PackableWeight

    generator = torch.Generator().manual_seed(6)
    weight, bias = torch.randn(960, 576, generator=generator), torch.randn(960, generator=generator)
    # oneDNN's packed weight (bf16 models, or fp32 where our kernels cannot be built), then our panels.
    methods = {"packed_weight": OneDnnLinearMethod(), "panel_weight": CpuPanelLinearMethod(load_cpu_ops())}
    for layout, method in methods.items():
        layer = PackableWeight()
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        method.process_weights_after_loading(layer)
        assert getattr(layer, layout) is not None, layout
        for rows in (1, 7, 8, 9, 64, 96, 97, 128, 513):
            x = torch.randn(rows, 576, generator=generator)
            expected = torch.nn.functional.linear(x, weight, bias)
            torch.testing.assert_close(method.apply(layer, x, bias), expected, atol=1e-4, rtol=1e-5)
    llm = LLM(model="tiny-random-llama", device="cpu", num_kv_blocks=16, show_progress=False)
    modules = [m for m in llm.engine.core.executor.worker.runner.model.modules() if isinstance(m, PackableWeight)]
    # q/k/v, o, gate/up and down per layer, plus the LM head: all fp32, all on panels, no oneDNN copy beside them.
    assert len(modules) == 4 * llm.engine.model_info.hf_config.num_hidden_layers + 1
    assert all(module.panel_weight is not None and module.packed_weight is None for module in modules)
    assert all(module.linear_method.ops is not None for module in modules)


# --- bf16: rows widened to fp32 lanes, fp32 math, each output rounded once ------------------------------------------

# Round-to-nearest on bf16's 8 significant bits: at most half a unit in the last place, 2^-8 of the value.
BF16_UNIT_ROUNDOFF = 2.0**-8
FP32_MATH_SLACK = 2.0**-20  # fp32 products, sums and exp_lanes, relative: far below one bf16 unit


def assert_rounded_once_from(actual: torch.Tensor, exact: torch.Tensor, accumulation_atol: float) -> None:
    """bf16 `actual` is `exact` (fp64 over the same bf16 inputs) rounded once: within half a bf16 ulp of it, plus
    what fp32 math can add (relative, and absolute where sums cancel)."""
    assert actual.dtype == torch.bfloat16
    error = (actual.double() - exact).abs()
    allowed = (BF16_UNIT_ROUNDOFF + FP32_MATH_SLACK) * exact.abs() + accumulation_atol
    assert (error <= allowed).all(), f"worst excess {(error - allowed).max().item():.3g}"


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "sliding_window"),
    [
        (9, 3, 64, 16, None),  # SmolLM2: a KV head's three query heads in one pass
        (8, 2, 64, 16, None),  # four query heads in one pass, one set of accumulators (two would not fit)
        (8, 2, 128, 32, None),  # one query head at a time
        (4, 4, 64, 16, 20),  # a window starting inside a block
        (6, 2, 48, 16, None),  # 3 vectors of 16 lanes (or 6 of 8): the general loop's vector rows
        (6, 2, 18, 16, None),  # head_dim not a multiple of any vector width: scalar
    ],
)
def test_bf16_decode_attention_is_the_exact_result_rounded_once(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, sliding_window: int | None
) -> None:
    generator = torch.Generator().manual_seed(num_heads * 10 + head_dim)
    seq_lens = [1, block_size - 1, block_size + 1, 3 * block_size + 5, 100, 300]
    batch, query, key, value, kv_cache = random_decode_case(
        generator, seq_lens, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16
    )
    ours = CpuAttentionBackend(num_heads, num_kv_heads, head_dim, sliding_window)
    actual = ours.forward(query, key, value, kv_cache, ours.build_metadata(batch, block_size, CPU))
    assert actual.dtype == torch.bfloat16
    exact = paged_attention_reference(
        query, kv_cache, batch.block_tables, seq_lens, [1] * len(seq_lens), ours.scale, sliding_window, None
    )
    assert_rounded_once_from(actual.view_as(query), exact, accumulation_atol=1e-5)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "sliding_window"),
    [(9, 3, 64, 16, None), (8, 2, 128, 32, None), (4, 1, 32, 5, None), (4, 2, 64, 16, 13)],
)
def test_bf16_prefill_kernel_is_the_exact_result_rounded_once(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, sliding_window: int | None
) -> None:
    """The kernel's bf16 path, called directly: the backend sends bf16 chunks to SDPA (PREFILL_KERNEL_DTYPES)."""
    generator = torch.Generator().manual_seed(num_heads * 100 + head_dim + block_size)
    query_lens, context_lens = [1, 15, 16, 17, 40, 3], [0, 0, 7, 0, 50, block_size]
    batch, query, key, value, kv_cache = random_prefill_case(
        generator, [], query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16
    )
    ops, backend = load_cpu_ops(), CpuAttentionBackend(num_heads, num_kv_heads, head_dim, sliding_window)
    chunks = backend.build_metadata(batch, block_size, CPU).prefill
    ops.reshape_and_cache(key, value, kv_cache[0], kv_cache[1], torch.tensor(batch.slot_mapping))
    actual = torch.empty_like(query)
    ops.paged_prefill_attention(
        actual,
        query,
        kv_cache[0],
        kv_cache[1],
        chunks.block_tables,
        chunks.query_starts,
        chunks.seq_lens,
        backend.scale,
        sliding_window or 0,
    )
    seq_lens = [context + length for context, length in zip(context_lens, query_lens, strict=True)]
    exact = paged_attention_reference(
        query, kv_cache, batch.block_tables, seq_lens, query_lens, backend.scale, sliding_window, None
    )
    assert_rounded_once_from(actual, exact, accumulation_atol=1e-5)


def test_bf16_rounding_is_torchs_to_nearest_even_including_specials() -> None:
    """The residual sum of fused_add_rms_norm is one bf16 rounding of an exact fp32 sum: torch's value exactly (NaN
    where torch's is, whatever its payload), overflow to infinity included."""
    generator = torch.Generator().manual_seed(8)
    x = torch.randn(33, 576, generator=generator).to(torch.bfloat16)
    residual = (torch.randn(33, 576, generator=generator) * 300).to(torch.bfloat16)
    # Specials and huge values in one row (its norm is NaN, checked only for the residual).
    x[0, :5] = torch.tensor([float("inf"), float("-inf"), float("nan"), 3.0e38, -3.0e38])
    residual[0, :5] = torch.tensor([1.0, 1.0, 1.0, 3.0e38, -3.0e38])
    expected = x + residual
    out, summed = fused_ops.fused_add_rms_norm(x.clone(), residual.clone(), torch.ones(576, dtype=torch.bfloat16), 1e-5)
    torch.testing.assert_close(summed, expected, atol=0, rtol=0, equal_nan=True)
    assert torch.isfinite(out[1:]).all()


def test_bf16_rotary_and_silu_round_the_fp32_result_once() -> None:
    generator = torch.Generator().manual_seed(9)
    tokens, heads, kv_heads, head_dim = 13, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(torch.bfloat16)
    angles = torch.rand(tokens, 1, head_dim // 2, generator=generator) * 100
    cos, sin = angles.cos(), angles.sin()
    views = (
        lambda rows: rows[:, : heads * head_dim].view(tokens, heads, head_dim),
        lambda rows: rows[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim),
    )
    exact = qkv.double()
    half = head_dim // 2
    for view in views:
        x = view(exact)
        x1, x2 = x[..., :half].clone(), x[..., half:].clone()
        x[..., :half], x[..., half:] = x1 * cos.double() - x2 * sin.double(), x2 * cos.double() + x1 * sin.double()
    fused_ops.apply_rotary(views[0](qkv), views[1](qkv), cos, sin)
    assert_rounded_once_from(qkv, exact, accumulation_atol=1e-6)

    gate_up = (torch.randn(7, 2 * 1537, generator=generator) * 8).to(torch.bfloat16)  # 1537: a scalar tail
    gate_up[0, :6] = torch.tensor([-200.0, -90.0, -20.0, 0.0, 90.0, 200.0])
    gate, up = gate_up[:, :1537].double(), gate_up[:, 1537:].double()
    assert_rounded_once_from(fused_ops.silu_and_mul(gate_up), gate * torch.sigmoid(gate) * up, accumulation_atol=1e-6)
