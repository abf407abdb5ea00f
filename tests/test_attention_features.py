"""Per-layer sliding windows, logit soft caps and query scales with ONE metadata object per step, on every backend.

A model's step builds its attention metadata once, with one layer's backend, and every layer reuses it (Gemma
alternates sliding and global layers; Qwen2 mixes them). So each test builds the metadata with one layer's backend
and runs four different layers on it, each against a dense reference written here: per query token, the keys it
may see sliced out of the whole sequence (the last `window` positions up to its own, transformers'
`kv_idx > q_idx - sliding_window`), scores `q . k * scale`, then `cap * tanh(scores / cap)`, softmax, values; in
float64. Batches mix decodes, speculative decode rows of one sequence (`decodes_share_sequences`), fresh prompts and
prefill chunks over a cached prefix whose blocks another sequence shares; windows of 20 with blocks of 16.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from cuda_ext.attention import get_attention_backend
from cuda_ext.attention.base import AttentionBackend, AttentionBatch
from cuda_ext.attention.cpu_backend import PREFILL_KERNEL_MAX_KEYS
from cuda_ext.kernels import unified_attention as unified_attention_module

BLOCK_SIZE = 16
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 32


@dataclass(frozen=True)
class Layer:
    name: str
    sliding_window: int | None
    logit_soft_cap: float | None
    scale: float | None


# Gemma 2 style: a global layer, a windowed one, a capped one with query_pre_attn_scalar 24, and all three at once.
LAYERS = [
    Layer("global", None, None, None),
    Layer("window20", 20, None, None),
    Layer("capped_global", None, 3.0, 24**-0.5),
    Layer("capped_window7", 7, 5.0, 0.3),
]


def backend_device(name: str) -> torch.device:
    if name != "triton":
        if name == "cpu":
            from cuda_ext.cpu_ops import load_cpu_ops

            if load_cpu_ops() is None:
                pytest.skip("the C++ CPU kernels did not build on this machine")
        return torch.device("cpu")
    if unified_attention_module.INTERPRETED:
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")


def make_backend(name: str, layer: Layer, device: torch.device) -> AttentionBackend:
    return get_attention_backend(
        name,
        device,
        NUM_HEADS,
        NUM_KV_HEADS,
        HEAD_DIM,
        layer.sliding_window,
        scale=layer.scale,
        logit_soft_cap=layer.logit_soft_cap,
    )


@dataclass(frozen=True)
class Row:
    """One request row of the batch: query_len new tokens of a sequence, which then holds seq_len keys."""

    sequence: int
    query_len: int
    seq_len: int


@dataclass(frozen=True)
class Scenario:
    rows: list[Row]  # decodes first
    shared_prefix: dict[int, tuple[int, int]]  # sequence -> (sequence whose first blocks it shares, how many)
    decodes_share_sequences: bool = False


# Sequence 1 decodes three speculative rows at once; sequence 5 chunks a prefill over 32 cached keys (2 blocks
# that sequence 6 shares), its window of 20 spanning cache and chunk; sequence 0 and 3 sit on block edges.
MIXED = Scenario(
    rows=[
        Row(0, 1, 45),
        Row(1, 1, 30),
        Row(1, 1, 31),
        Row(1, 1, 32),
        Row(3, 1, 17),
        Row(4, 23, 23),
        Row(5, 28, 60),
        Row(6, 9, 49),
    ],
    shared_prefix={6: (5, 2)},
    decodes_share_sequences=True,
)
# A chunk past PREFILL_KERNEL_MAX_KEYS keys: the cpu backend's SDPA fallback group for its prefill.
LONG = Scenario(
    rows=[Row(0, 1, 40), Row(1, 20, PREFILL_KERNEL_MAX_KEYS + 14), Row(2, 5, 5)],
    shared_prefix={},
)
DECODES = Scenario(rows=[Row(0, 1, 45), Row(1, 1, 16), Row(2, 1, 21), Row(3, 1, 1), Row(4, 1, 33)], shared_prefix={})


@dataclass
class LayerInputs:
    """One layer's data for a scenario: the step's new q/k/v, its cache before the step and the dense sequences."""

    query: torch.Tensor  # [tokens, heads, head_dim]
    key: torch.Tensor  # [tokens, kv_heads, head_dim]
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, blocks, block_size, kv_heads, head_dim]
    dense_keys: dict[int, torch.Tensor]  # sequence -> [length, kv_heads, head_dim]
    dense_values: dict[int, torch.Tensor]


def sequence_lengths(scenario: Scenario) -> dict[int, int]:
    lengths: dict[int, int] = {}
    for row in scenario.rows:
        lengths[row.sequence] = max(lengths.get(row.sequence, 0), row.seq_len)
    return lengths


def block_tables(scenario: Scenario, seed: int) -> tuple[int, dict[int, list[int]]]:
    """(cache blocks, sequence -> block table) over shuffled blocks (block 0 never used), one spare block each."""
    lengths = sequence_lengths(scenario)
    generator = torch.Generator().manual_seed(seed)
    num_blocks = 1 + sum(-(-length // BLOCK_SIZE) + 1 for length in lengths.values())
    free = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    tables: dict[int, list[int]] = {}
    for sequence, length in lengths.items():
        shared: list[int] = []
        if sequence in scenario.shared_prefix:
            owner, num_shared = scenario.shared_prefix[sequence]
            shared = tables[owner][:num_shared]
        needed = -(-length // BLOCK_SIZE) + 1 - len(shared)
        tables[sequence], free = shared + free[:needed], free[needed:]
    return num_blocks, tables


def make_batch(scenario: Scenario, tables: dict[int, list[int]]) -> AttentionBatch:
    slot_mapping = []
    for row in scenario.rows:
        table = tables[row.sequence]
        for position in range(row.seq_len - row.query_len, row.seq_len):
            slot_mapping.append(table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
    return AttentionBatch(
        [row.query_len for row in scenario.rows],
        [row.seq_len for row in scenario.rows],
        [tables[row.sequence] for row in scenario.rows],
        slot_mapping,
        num_decodes=sum(1 for row in scenario.rows if row.query_len == 1),
        decodes_share_sequences=scenario.decodes_share_sequences,
    )


def make_layer_inputs(
    scenario: Scenario, num_blocks: int, tables: dict[int, list[int]], seed: int, query_scale: float
) -> LayerInputs:
    """Random dense sequences; the cache holds each sequence's keys that no row of the step writes."""
    generator = torch.Generator().manual_seed(seed)
    lengths = sequence_lengths(scenario)
    dense_keys, dense_values = {}, {}
    for sequence, length in lengths.items():
        dense_keys[sequence] = torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=generator)
        dense_values[sequence] = torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=generator)
        if sequence in scenario.shared_prefix:
            owner, num_shared = scenario.shared_prefix[sequence]
            dense_keys[sequence][: num_shared * BLOCK_SIZE] = dense_keys[owner][: num_shared * BLOCK_SIZE]
            dense_values[sequence][: num_shared * BLOCK_SIZE] = dense_values[owner][: num_shared * BLOCK_SIZE]
    new_positions: dict[int, set[int]] = {sequence: set() for sequence in lengths}
    for row in scenario.rows:
        new_positions[row.sequence].update(range(row.seq_len - row.query_len, row.seq_len))
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    for sequence, length in lengths.items():
        for position in range(length):
            if position not in new_positions[sequence]:
                block = tables[sequence][position // BLOCK_SIZE]
                kv_cache[0, block, position % BLOCK_SIZE] = dense_keys[sequence][position]
                kv_cache[1, block, position % BLOCK_SIZE] = dense_values[sequence][position]
    num_tokens = sum(row.query_len for row in scenario.rows)
    # Scaled queries push scores past the soft caps, where tanh bends them.
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=generator) * query_scale
    rows_key, rows_value = [], []
    for row in scenario.rows:
        rows_key.append(dense_keys[row.sequence][row.seq_len - row.query_len : row.seq_len])
        rows_value.append(dense_values[row.sequence][row.seq_len - row.query_len : row.seq_len])
    return LayerInputs(query, torch.cat(rows_key), torch.cat(rows_value), kv_cache, dense_keys, dense_values)


def reference_attention(scenario: Scenario, inputs: LayerInputs, layer: Layer) -> torch.Tensor:
    """[tokens, heads * head_dim] float64: each query token over the keys it may see, sliced from its sequence."""
    scale = HEAD_DIM**-0.5 if layer.scale is None else layer.scale
    group = NUM_HEADS // NUM_KV_HEADS
    outputs, token = [], 0
    for row in scenario.rows:
        for position in range(row.seq_len - row.query_len, row.seq_len):
            first = 0 if layer.sliding_window is None else max(0, position - layer.sliding_window + 1)
            keys = inputs.dense_keys[row.sequence][first : position + 1].double().repeat_interleave(group, dim=1)
            values = inputs.dense_values[row.sequence][first : position + 1].double().repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,khd->hk", inputs.query[token].double(), keys) * scale
            if layer.logit_soft_cap is not None:
                scores = layer.logit_soft_cap * torch.tanh(scores / layer.logit_soft_cap)
            outputs.append(torch.einsum("hk,khd->hd", torch.softmax(scores, dim=-1), values).flatten())
            token += 1
    return torch.stack(outputs)


def tolerance(device: torch.device) -> float:
    # Compiled GPU kernels sum in another order than the CPU paths.
    return 2e-4 if device.type == "cuda" else 2e-5


def run_layers_on_shared_metadata(
    backend_name: str, scenario: Scenario, builder: int, *, graph_metadata: bool = False
) -> None:
    device = backend_device(backend_name)
    num_blocks, tables = block_tables(scenario, seed=builder)
    batch = make_batch(scenario, tables)
    backends = [make_backend(backend_name, layer, device) for layer in LAYERS]
    if graph_metadata:
        # The CUDA-graph path: decode-only metadata from device tensors, tables padded to a fixed width.
        width = max(len(table) for table in batch.block_tables) + 1
        padded_tables = [table + [0] * (width - len(table)) for table in batch.block_tables]
        metadata = backends[builder].build_decode_metadata(
            torch.tensor(batch.seq_lens, dtype=torch.int32, device=device),
            torch.tensor(padded_tables, dtype=torch.int32, device=device),
            torch.tensor(batch.slot_mapping, dtype=torch.int32, device=device),
            BLOCK_SIZE,
        )
    else:
        metadata = backends[builder].build_metadata(batch, BLOCK_SIZE, device)
    # Not in LAYERS order: the layer that built the metadata is not the first to use it.
    for index in (1, 3, 0, 2):
        layer, backend = LAYERS[index], backends[index]
        inputs = make_layer_inputs(scenario, num_blocks, tables, seed=10 + index, query_scale=3.0)
        kv_cache = inputs.kv_cache.to(device)
        output = backend.forward(
            inputs.query.to(device), inputs.key.to(device), inputs.value.to(device), kv_cache, metadata
        )
        expected = reference_attention(scenario, inputs, layer)
        atol = tolerance(device)
        torch.testing.assert_close(output.cpu().double(), expected, atol=atol, rtol=atol, msg=layer.name)
        # The step's new keys and values landed in their slots.
        for row_token, slot in enumerate(batch.slot_mapping):
            block, offset = divmod(slot, BLOCK_SIZE)
            assert torch.equal(kv_cache[0, block, offset].cpu(), inputs.key[row_token])
            assert torch.equal(kv_cache[1, block, offset].cpu(), inputs.value[row_token])


BACKENDS = ["torch", "cpu", "triton"]


@pytest.mark.parametrize("builder", [0, 1, 3], ids=[LAYERS[i].name for i in (0, 1, 3)])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_mixed_batch_layers_share_one_metadata(backend_name: str, builder: int) -> None:
    run_layers_on_shared_metadata(backend_name, MIXED, builder)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_chunk_past_the_cpu_prefill_kernel_limit(backend_name: str) -> None:
    run_layers_on_shared_metadata(backend_name, LONG, builder=1)


@pytest.mark.parametrize("builder", [0, 1], ids=[LAYERS[i].name for i in (0, 1)])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_decode_metadata_from_device_tensors(backend_name: str, builder: int) -> None:
    run_layers_on_shared_metadata(backend_name, DECODES, builder, graph_metadata=True)


def test_layers_differ_so_the_checks_can_fail() -> None:
    """Each layer's window, cap and scale change the MIXED outputs: a backend ignoring one fails the tests above."""
    num_blocks, tables = block_tables(MIXED, seed=0)
    inputs = make_layer_inputs(MIXED, num_blocks, tables, seed=0, query_scale=3.0)
    outputs = [reference_attention(MIXED, inputs, layer) for layer in LAYERS]
    for first in range(len(LAYERS)):
        for second in range(first + 1, len(LAYERS)):
            assert (outputs[first] - outputs[second]).abs().max() > 0.05, (LAYERS[first], LAYERS[second])
    capped_without_cap = Layer("uncapped", None, None, LAYERS[2].scale)
    difference = reference_attention(MIXED, inputs, capped_without_cap) - outputs[2]
    assert difference.abs().max() > 0.05


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_half_precision_soft_cap(backend_name: str) -> None:
    """bf16 inputs through a capped, windowed layer: within about two output ulps of the float64 reference."""
    device = backend_device(backend_name)
    num_blocks, tables = block_tables(MIXED, seed=5)
    batch = make_batch(MIXED, tables)
    layer = LAYERS[3]
    backend = make_backend(backend_name, layer, device)
    inputs = make_layer_inputs(MIXED, num_blocks, tables, seed=5, query_scale=3.0)
    # The reference reads the same bf16-rounded inputs.
    for name in ("query", "key", "value", "kv_cache"):
        setattr(inputs, name, getattr(inputs, name).bfloat16())
    inputs.dense_keys = {sequence: keys.bfloat16() for sequence, keys in inputs.dense_keys.items()}
    inputs.dense_values = {sequence: values.bfloat16() for sequence, values in inputs.dense_values.items()}
    metadata = backend.build_metadata(batch, BLOCK_SIZE, device)
    kv_cache = inputs.kv_cache.to(device)
    output = backend.forward(
        inputs.query.to(device), inputs.key.to(device), inputs.value.to(device), kv_cache, metadata
    )
    assert output.dtype == torch.bfloat16
    atol = 3.2e-2 if device.type == "cuda" else 1.6e-2
    torch.testing.assert_close(output.cpu().double(), reference_attention(MIXED, inputs, layer), atol=atol, rtol=atol)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_backend_arguments(backend_name: str) -> None:
    device = backend_device(backend_name)
    backend = get_attention_backend(backend_name, device, 8, 4, 256, 0, scale=144**-0.5, logit_soft_cap=50.0)
    assert (backend.sliding_window, backend.scale, backend.logit_soft_cap) == (None, 144**-0.5, 50.0)
    plain = get_attention_backend(backend_name, device, 8, 4, 256)
    assert (plain.sliding_window, plain.scale, plain.logit_soft_cap) == (None, 256**-0.5, None)
    with pytest.raises(ValueError, match="sliding_window"):
        get_attention_backend(backend_name, device, 8, 4, 256, -1)
    with pytest.raises(ValueError, match="logit_soft_cap"):
        get_attention_backend(backend_name, device, 8, 4, 256, logit_soft_cap=-2.0)
