"""The C++ decoder stack against the layer-by-layer forward it replaces on CPU decode steps."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
import torch

from cuda_ext.attention.base import AttentionBatch
from cuda_ext.attention.cpu_backend import PREFILL_KERNEL_MAX_KEYS
from cuda_ext.cpu_ops import load_cpu_ops
from model_executor.cpu_decode_stack import CpuDecodeStackLlama as LlamaForCausalLM
from model_executor.parallel_state import ParallelContext

CPU = torch.device("cpu")
BLOCK_SIZE = 4
NUM_BLOCKS = 320
# How long the handoff test steps on, waiting for two threads to overlap on a busy machine.
HANDOFF_WAIT_S = 30.0


def random_llama(pp_rank: int = 0, pp_size: int = 1, panels: bool = False, **overrides: Any) -> LlamaForCausalLM:
    """With `panels`, the layers' weights are packed into panels (as the engine loads them) and both paths run the
    panel kernel; without, the stack runs the dot-product kernel on the plain weights and the layers torch's."""
    # Imported here: transformers' config import loads triton, which the Triton tests must import first.
    from transformers import LlamaConfig

    from model_executor.layers.linear import PackableWeight

    settings = {
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        **overrides,
    }
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**settings), ParallelContext(pp_rank=pp_rank, pp_size=pp_size), "cpu", CPU)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.2 * torch.randn_like(param))
    if panels:
        for module in model.modules():
            if isinstance(module, PackableWeight):
                module.pack_weights(use_cpu_kernels=True)
        assert next(iter(model.layers.values())).mlp.gate_up_proj.panel_weight is not None
    assert model.prepare_decode_stack()
    return model


def new_caches(model: LlamaForCausalLM, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [
        model.attention_backend.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE, dtype, CPU)
        for _ in range(model.num_local_layers)
    ]


def prefilled_decode(
    model: LlamaForCausalLM, num_cached: list[int], seed: int, dtype: torch.dtype = torch.float32
) -> tuple[list[torch.Tensor], AttentionBatch]:
    """Each request's num_cached tokens prefilled into new caches (blocks shuffled by `seed`, one spare block
    each), and the decode step of one new token per request after them."""
    blocks = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, start = [], 0
    for cached in num_cached:
        needed = cached // BLOCK_SIZE + 1
        tables.append(blocks[start : start + needed])
        start += needed
    caches = new_caches(model, dtype)
    for cached, table in zip(num_cached, tables, strict=True):
        run(model, caches, attention_batch([cached], [0], [table]), None)
    return caches, attention_batch([1] * len(num_cached), num_cached, tables)


def attention_batch(num_new: list[int], num_cached: list[int], block_tables: list[list[int]]) -> AttentionBatch:
    """One step: request i adds num_new[i] tokens after num_cached[i] cached ones."""
    slots = []
    for new, cached, table in zip(num_new, num_cached, block_tables, strict=True):
        slots += [table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE for pos in range(cached, cached + new)]
    seq_lens = [cached + new for new, cached in zip(num_new, num_cached, strict=True)]
    return AttentionBatch(list(num_new), seq_lens, block_tables, slots, sum(1 for new in num_new if new == 1))


def run(model: LlamaForCausalLM, caches: list[torch.Tensor], batch: AttentionBatch, intermediate: Any) -> Any:
    metadata = model.attention_backend.build_metadata(batch, BLOCK_SIZE, CPU)
    positions = torch.tensor(
        [pos for new, end in zip(batch.query_lens, batch.seq_lens, strict=True) for pos in range(end - new, end)]
    )
    input_ids = (positions * 7 + 3) % model.config.vocab_size
    with torch.inference_mode():
        return model(input_ids, positions, caches, metadata, intermediate)


def as_tuple(output: Any) -> tuple[torch.Tensor, ...]:
    return output if isinstance(output, tuple) else (output,)


@pytest.mark.parametrize(
    ("overrides", "pp_rank", "pp_size"),
    [
        ({}, 0, 1),
        # The panel kernel on panel weights (the engine's path), with and without biases, and in a first pipeline
        # stage (which hands hidden and residual on); odd sizes leave a partial last panel.
        ({"panels": True}, 0, 1),
        ({"panels": True, "attention_bias": True, "mlp_bias": True}, 0, 1),
        ({"panels": True}, 0, 2),
        ({"panels": True, "hidden_size": 40, "intermediate_size": 36, "num_key_value_heads": 1}, 0, 1),
        ({"attention_bias": True, "mlp_bias": True}, 0, 1),
        ({"sliding_window": 6}, 0, 1),
        # hidden 40 and head_dim 10: the scalar tails of every vector loop; one KV head for all four.
        ({"hidden_size": 40, "intermediate_size": 36, "num_key_value_heads": 1}, 0, 1),
        ({"num_attention_heads": 8, "num_key_value_heads": 8, "hidden_size": 128}, 0, 1),
        ({}, 0, 2),  # a first pipeline stage hands (hidden, residual) on
        ({}, 1, 2),  # a later one starts from them
    ],
)
# 13 and 40 requests: full register blocks of both linear kernels (6 and 8 tokens with AVX-512, 2 and 6 with AVX2)
# and a remainder.
@pytest.mark.parametrize(
    "num_cached",
    [
        [1],
        [9],
        [23],
        [5, 17, 2],
        [3, 8, 1, 12, 4, 6, 20, 2],
        [4, 11, 1, 27, 6, 9, 2, 14, 3, 21, 8, 5, 17],
        [(7 * i) % 27 + 1 for i in range(40)],
    ],
)
def test_decode_tokens_through_the_stack_match_layer_by_layer(
    overrides: dict[str, Any], pp_rank: int, pp_size: int, num_cached: list[int]
) -> None:
    model = random_llama(pp_rank, pp_size, **overrides)
    hidden_size = model.config.hidden_size
    # Shuffled blocks, disjoint per request: the stack must follow each block table.
    blocks = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(sum(num_cached))).tolist()
    tables = [blocks[i * 7 : (i + 1) * 7] for i in range(len(num_cached))]
    caches = new_caches(model)
    generator = torch.Generator().manual_seed(7)

    def stage_input(num_tokens: int) -> Any:
        if pp_rank == 0:
            return None
        return tuple(torch.randn(num_tokens, hidden_size, generator=generator) for _ in range(2))

    for cached, table in zip(num_cached, tables, strict=True):
        run(model, caches, attention_batch([cached], [0], [table]), stage_input(cached))
    decode = attention_batch([1] * len(num_cached), num_cached, tables)
    decode_input = stage_input(len(num_cached))

    results = {}
    stack = model.decode_stack
    for name, decode_stack in (("stack", stack), ("layers", None)):
        model.decode_stack = decode_stack
        step_caches = [cache.clone() for cache in caches]
        step_input = None if decode_input is None else tuple(t.clone() for t in decode_input)
        results[name] = (as_tuple(run(model, step_caches, decode, step_input)), step_caches)

    (stack_outputs, stack_caches), (layer_outputs, layer_caches) = results["stack"], results["layers"]
    assert len(stack_outputs) == (1 if pp_rank == pp_size - 1 else 2)
    for stack_output, layer_output in zip(stack_outputs, layer_outputs, strict=True):
        assert stack_output.shape == (len(num_cached), hidden_size)
        torch.testing.assert_close(stack_output, layer_output, atol=1e-4, rtol=1e-4)
    for stack_cache, layer_cache in zip(stack_caches, layer_caches, strict=True):
        torch.testing.assert_close(stack_cache, layer_cache, atol=1e-4, rtol=1e-4)
    # Each new token's keys landed in its slot (the prefill alone leaves those rows zero).
    key_rows = stack_caches[0][0].view(-1, *stack_caches[0].shape[3:])
    assert all(key_rows[slot].abs().sum() > 0 for slot in decode.slot_mapping)


@pytest.mark.parametrize("panels", [False, True])
def test_threads_taking_their_own_tokens_through_the_stack_match_one_thread_bit_for_bit(panels: bool) -> None:
    """With 16 tokens or more per thread, each thread takes its own tokens through every layer, and a thread done
    early is handed half of another's rest between two stages. Long contexts in the first half, one to three
    tokens in the second: the second thread finishes first and gets rows handed over. Output and cache equal the
    one-thread stack's exactly."""
    model = random_llama(panels=panels)
    caches, decode = prefilled_decode(model, [56 - i for i in range(16)] + [1 + i % 3 for i in range(24)], 3)

    def step(num_threads: int) -> tuple[torch.Tensor, list[torch.Tensor], int]:
        step_caches = [cache.clone() for cache in caches]
        previous = torch.get_num_threads()
        torch.set_num_threads(num_threads)
        try:
            output = run(model, step_caches, decode, None)
        finally:
            torch.set_num_threads(previous)
        return output, step_caches, model.decode_stack.last_step_handoffs

    one_output, one_caches, one_handoffs = step(1)
    assert one_handoffs == 0  # one thread: every kernel on it, nothing to hand over
    handoffs = 0
    # A handoff needs both threads on a core at once: on a machine busy with other work (parallel test workers)
    # that can take many more steps than five, so steps go on until one is seen or HANDOFF_WAIT_S has passed.
    deadline = time.monotonic() + HANDOFF_WAIT_S
    for attempt in itertools.count():
        output, step_caches, step_handoffs = step(2)
        handoffs += step_handoffs
        torch.testing.assert_close(output, one_output, rtol=0, atol=0)
        for cache, one_cache in zip(step_caches, one_caches, strict=True):
            torch.testing.assert_close(cache, one_cache, rtol=0, atol=0)
        if attempt >= 4 and (handoffs > 0 or time.monotonic() > deadline):
            break
    assert handoffs > 0


def test_draft_rows_of_one_sequence_through_the_stack_match_a_prefill_chunk_of_them() -> None:
    """Speculative drafts: each of 7 sequences runs 5 consecutive tokens as decode rows (35 rows, enough for the
    per-thread path on 2 threads), each row attending up to itself, so to keys rows before it write in the same
    step. With the rows marked as sharing sequences, 2 threads give what a prefill chunk of the same tokens gives
    layer by layer."""
    model = random_llama(panels=True)
    num_cached = [3, 17, 9, 30, 1, 12, 22]
    num_rows = 5
    tables = [list(range(i * 10, (i + 1) * 10)) for i in range(len(num_cached))]
    caches = new_caches(model)
    for cached, table in zip(num_cached, tables, strict=True):
        run(model, caches, attention_batch([cached], [0], [table]), None)
    chunks = attention_batch([num_rows] * len(num_cached), num_cached, tables)
    rows = AttentionBatch(
        [1] * num_rows * len(num_cached),
        [cached + row + 1 for cached in num_cached for row in range(num_rows)],
        [table for table in tables for _ in range(num_rows)],
        chunks.slot_mapping,
        num_rows * len(num_cached),
        decodes_share_sequences=True,  # without it, this test fails: a thread's rows read keys not yet written
    )
    stack = model.decode_stack
    model.decode_stack = None
    chunk_caches = [cache.clone() for cache in caches]
    expected = run(model, chunk_caches, chunks, None)
    model.decode_stack = stack
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        row_caches = [cache.clone() for cache in caches]
        output = run(model, row_caches, rows, None)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(output, expected, atol=1e-4, rtol=1e-4)
    for row_cache, chunk_cache in zip(row_caches, chunk_caches, strict=True):
        torch.testing.assert_close(row_cache, chunk_cache, atol=1e-4, rtol=1e-4)


def step_with_and_without_stack(
    model: LlamaForCausalLM, num_new: list[int], num_cached: list[int], stage_input: Any = None
) -> dict[str, tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]]:
    """One step (request i adds num_new[i] tokens after num_cached[i] cached ones, decodes first) run by the stack
    and layer by layer from the same caches: name -> (outputs, caches after the step). The cached prefixes are
    written layer by layer, so both paths start from the same bits."""
    blocks = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(sum(num_new) + sum(num_cached)))
    width = -(-max(new + cached for new, cached in zip(num_new, num_cached, strict=True)) // BLOCK_SIZE)
    tables = [blocks[i * width : (i + 1) * width].tolist() for i in range(len(num_new))]
    stack = model.decode_stack
    model.decode_stack = None
    caches = new_caches(model)
    hidden_size = model.config.hidden_size
    generator = torch.Generator().manual_seed(5)
    for cached, table in zip(num_cached, tables, strict=True):
        if cached:
            prefix = None if stage_input is None else tuple(torch.randn(cached, hidden_size) for _ in range(2))
            run(model, caches, attention_batch([cached], [0], [table]), prefix)
    step = attention_batch(num_new, num_cached, tables)
    step_input = None
    if stage_input is not None:
        step_input = tuple(torch.randn(sum(num_new), hidden_size, generator=generator) for _ in range(2))
    results = {}
    for name, decode_stack in (("stack", stack), ("layers", None)):
        model.decode_stack = decode_stack
        step_caches = [cache.clone() for cache in caches]
        inputs = None if step_input is None else tuple(t.clone() for t in step_input)
        results[name] = (as_tuple(run(model, step_caches, step, inputs)), step_caches)
    model.decode_stack = stack
    return results


def stack_takes_step(model: LlamaForCausalLM, num_new: list[int], num_cached: list[int]) -> bool:
    """Whether `model` runs such a step through its stack."""
    tables = [list(range(NUM_BLOCKS))] * len(num_new)
    metadata = model.attention_backend.build_metadata(attention_batch(num_new, num_cached, tables), BLOCK_SIZE, CPU)
    return model.stack_runs_step(metadata, new_caches(model))


@pytest.mark.parametrize(
    ("overrides", "pp_rank", "pp_size"),
    [
        ({}, 0, 1),
        ({"panels": True}, 0, 1),
        ({"panels": True, "attention_bias": True, "mlp_bias": True}, 0, 1),
        ({"panels": True, "sliding_window": 6}, 0, 1),
        ({"panels": True, "num_key_value_heads": 1}, 0, 1),
        ({"panels": True}, 0, 2),  # a first pipeline stage hands (hidden, residual) on
        ({"panels": True}, 1, 2),  # a later one starts from them
    ],
)
# (new tokens, cached tokens) per request, decodes first: decodes with a fresh prompt, with a chunk after a cached
# prefix, several chunks, chunks alone (a fresh prompt of 70 tokens: more than one prefill tile and register block).
@pytest.mark.parametrize(
    ("num_new", "num_cached"),
    [
        ([1, 1, 7], [3, 6, 0]),
        ([1, 1, 1, 5], [9, 2, 14, 11]),
        ([1, 4, 9, 2], [20, 0, 5, 30]),
        ([70], [0]),
        ([13, 33], [19, 0]),
    ],
)
def test_steps_with_prefill_chunks_through_the_stack_match_layer_by_layer(
    overrides: dict[str, Any], pp_rank: int, pp_size: int, num_new: list[int], num_cached: list[int]
) -> None:
    model = random_llama(pp_rank, pp_size, **overrides)
    assert stack_takes_step(model, num_new, num_cached)
    results = step_with_and_without_stack(model, num_new, num_cached, stage_input=pp_rank > 0 or None)
    (stack_outputs, stack_caches), (layer_outputs, layer_caches) = results["stack"], results["layers"]
    assert len(stack_outputs) == (1 if pp_rank == pp_size - 1 else 2)
    for stack_output, layer_output in zip(stack_outputs, layer_outputs, strict=True):
        assert stack_output.shape == (sum(num_new), model.config.hidden_size)
        torch.testing.assert_close(stack_output, layer_output, atol=1e-4, rtol=1e-4)
    for stack_cache, layer_cache in zip(stack_caches, layer_caches, strict=True):
        torch.testing.assert_close(stack_cache, layer_cache, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("overrides", "num_new", "num_cached"),
    [
        # A chunk past the prefill kernel's keys: SDPA's GEMM tiles win over long key runs.
        ({"max_position_embeddings": 512}, [1, 1, 40], [3, 6, PREFILL_KERNEL_MAX_KEYS - 20]),
        # head_dim 10: the prefill kernel's vector path holds whole head rows of 16 lanes.
        ({"hidden_size": 40, "intermediate_size": 36}, [1, 6], [3, 0]),
        # Short chunks, but more tokens in the step than STACK_MAX_PREFILL_STEP_TOKENS: oneDNN's GEMM wins there.
        ({}, [1, 1, 1] + [110] * 5, [4, 9, 2] + [0] * 5),
    ],
)
def test_steps_the_prefill_kernel_cannot_take_run_layer_by_layer(
    overrides: dict[str, Any], num_new: list[int], num_cached: list[int]
) -> None:
    model = random_llama(**overrides)
    assert not stack_takes_step(model, num_new, num_cached)
    stack = model.decode_stack
    model.decode_stack = "not a stack"  # calling it would raise
    try:
        results = step_with_and_without_stack(model, num_new, num_cached)
    finally:
        model.decode_stack = stack
    assert results["stack"][0][0].shape == (sum(num_new), model.config.hidden_size)


def test_a_slot_outside_the_cache_is_refused_not_written() -> None:
    model = random_llama()
    batch = attention_batch([1], [4], [list(range(NUM_BLOCKS))])
    batch.slot_mapping[0] = NUM_BLOCKS * BLOCK_SIZE
    with pytest.raises(RuntimeError, match="outside the cache"):
        run(model, new_caches(model), batch, None)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"prefill_query_starts": torch.tensor([0, 3], dtype=torch.int32)}, "must cover the rows after the decodes"),
        ({"prefill_seq_lens": torch.tensor([2], dtype=torch.int32)}, "1 .. seq_len query tokens"),
        ({"prefill_seq_lens": None}, "go together"),
        ({"prefill_block_tables": torch.zeros(1, 1, dtype=torch.int32)}, "needs more blocks than its table holds"),
    ],
)
def test_the_stack_refuses_prefill_chunks_that_do_not_describe_the_step(change: dict[str, Any], message: str) -> None:
    """Two decodes and a 5-token chunk, with one of the chunk's descriptions made inconsistent: refused before any
    row runs, with the reason."""
    model = random_llama()
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    batch = attention_batch([1, 1, 5], [3, 6, 2], tables)
    metadata = model.attention_backend.build_metadata(batch, BLOCK_SIZE, CPU)
    prefill = metadata.prefill
    chunks = {
        "prefill_block_tables": prefill.block_tables,
        "prefill_query_starts": prefill.query_starts,
        "prefill_seq_lens": prefill.seq_lens,
        **change,
    }
    positions = torch.tensor([3, 6, 2, 3, 4, 5, 6])
    cos, sin = model.rotary.cos_sin(positions)
    hidden = torch.randn(7, model.config.hidden_size)
    caches = new_caches(model)
    with pytest.raises(RuntimeError, match=message):
        model.decode_stack.forward(
            hidden,
            torch.zeros_like(hidden),
            False,
            caches,
            metadata.decode_block_tables,
            metadata.decode_seq_lens,
            metadata.slot_mapping,
            cos.view(7, -1),
            sin.view(7, -1),
            False,
            **chunks,
        )
    assert all(cache.abs().sum() == 0 for cache in caches)  # nothing written


@pytest.mark.parametrize("num_streams", [1, 3])
def test_the_engine_decodes_a_few_streams_through_the_stack_with_the_same_tokens(
    make_llm, tiny_model_dir, num_streams: int
) -> None:
    from configs.sampling_params import SamplingParams

    llm = make_llm(tiny_model_dir)
    model = llm.engine.core.executor.worker.runner.model
    assert model.decode_stack is not None  # the default CPU engine takes the stack
    prompts = [[1, *range(300 + 50 * i, 340 + 50 * i + 3 * i)] for i in range(num_streams)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def generate() -> list[list[int]]:
        return [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]

    with_stack = generate()
    stack, model.decode_stack = model.decode_stack, None
    try:
        layer_by_layer = generate()
    finally:
        model.decode_stack = stack
    assert with_stack == layer_by_layer
    assert [len(tokens) for tokens in with_stack] == [24] * num_streams


def test_no_stack_for_bf16_weights_without_amx_tiles() -> None:
    """The stack runs bf16 weights on their AMX tiles only: a bf16 model without them (weights not packed for AMX,
    or a CPU without AMX) keeps the layer-by-layer path."""
    model = random_llama()
    model.to(torch.bfloat16)
    model.decode_stack = None
    assert not model.prepare_decode_stack()


@pytest.mark.parametrize(
    ("panels", "pp_rank", "pp_size", "window"),
    [(False, 0, 1, 0), (True, 0, 1, 0), (True, 0, 1, 4), (True, 1, 2, 0), (True, 0, 2, 0)],
)
@pytest.mark.parametrize("output_rows", [[2, 9, 10], [0, 1, 8, 13], [9], []])
def test_output_rows_skip_the_last_layer_for_the_others_and_cache_every_row(
    panels: bool, pp_rank: int, pp_size: int, window: int, output_rows: list[int]
) -> None:
    """A mixed step (two decodes, a 7-token prompt and a 5-token chunk of another) through the C++ stack, asked for
    the rows that sample (or rows inside a chunk, whose last layer attends as a decode at their position, within
    the sliding window if there is one): those rows' hidden states equal the full step's, every row's keys and
    values are cached all the same, and a first pipeline stage hands every row on."""
    model = random_llama(
        pp_rank=pp_rank, pp_size=pp_size, panels=panels, **({"sliding_window": window} if window else {})
    )
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(4)]
    num_new, num_cached = [1, 1, 7, 5], [3, 6, 0, 2]
    assert stack_takes_step(model, num_new, num_cached)
    hidden = torch.randn(sum(num_new), model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    outputs, caches = [], []
    for rows in (None, torch.tensor(output_rows, dtype=torch.int64)):
        # A fresh copy each time: the first norm works in place on (hidden, residual).
        intermediate = (hidden.clone(), hidden * 0.5) if pp_rank > 0 else None
        step_caches = new_caches(model)
        for cached, table in zip(num_cached, tables, strict=True):
            if cached:
                prefix = (torch.zeros(cached, model.config.hidden_size),) * 2 if pp_rank > 0 else None
                run(model, step_caches, attention_batch([cached], [0], [table]), prefix)
        batch = attention_batch(num_new, num_cached, tables)
        metadata = model.attention_backend.build_metadata(batch, BLOCK_SIZE, CPU)
        positions = torch.tensor([p for n, c in zip(num_new, num_cached, strict=True) for p in range(c, c + n)])
        with torch.inference_mode():
            output = model(
                (positions * 7 + 3) % model.config.vocab_size, positions, step_caches, metadata, intermediate, rows
            )
        outputs.append(as_tuple(output))
        caches.append(step_caches)
    full, selected = outputs
    for full_cache, selected_cache in zip(*caches, strict=True):
        torch.testing.assert_close(selected_cache, full_cache, rtol=0, atol=0)
    if not model.parallel.is_last_stage:
        assert [t.shape[0] for t in selected] == [sum(num_new)] * 2
        for full_part, selected_part in zip(full, selected, strict=True):
            torch.testing.assert_close(selected_part, full_part, rtol=0, atol=0)
        return
    assert selected[0].shape == (len(output_rows), model.config.hidden_size)
    torch.testing.assert_close(selected[0], full[0][output_rows], rtol=1e-6, atol=1e-6)


# The stack alone, against a decoder step written out in torch (fp64): per-layer windows, q/k head norms, q/k/v
# biases without an output bias (Qwen 2 and 3's layer shapes).
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER = 4, 2, 32, 64, 96  # 4 heads of 32: q is wider than hidden
EPS = 1e-6
STACK_WINDOW = 6
# What add_layer is given per layer: -1 takes the stack's window, 0 none; 3 and 5 start inside a block of 4.
LAYER_WINDOWS = [5, 0, 3, -1]


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def rotate_half_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotary of [tokens, heads, head_dim] by cos/sin [tokens, head_dim / 2]."""
    first, second = x.chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def random_stack_layers(generator: torch.Generator, qk_norm_layers: set[int]) -> list[dict[str, Any]]:
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM

    def weight(*shape: int) -> torch.Tensor:
        return 0.2 * torch.randn(*shape, generator=generator)

    def norm(size: int) -> torch.Tensor:
        return 0.5 + torch.rand(size, generator=generator)

    return [
        {
            "input_norm": norm(HIDDEN),
            "qkv": weight(q_size + 2 * kv_size, HIDDEN),
            "qkv_bias": weight(q_size + 2 * kv_size),
            "o": weight(HIDDEN, q_size),
            "post_norm": norm(HIDDEN),
            "gate_up": weight(2 * INTER, HIDDEN),
            "down": weight(HIDDEN, INTER),
            "q_norm": norm(HEAD_DIM) if index in qk_norm_layers else None,
            "k_norm": norm(HEAD_DIM) if index in qk_norm_layers else None,
        }
        for index in range(len(LAYER_WINDOWS))
    ]


def build_stack(layers: list[dict[str, Any]], panels: bool) -> Any:
    ops = load_cpu_ops()
    stack = ops.DecodeStack(
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        eps=EPS,
        scale=HEAD_DIM**-0.5,
        sliding_window=STACK_WINDOW,
    )
    for layer, window in zip(layers, LAYER_WINDOWS, strict=True):
        linears = [layer[name] for name in ("qkv", "o", "gate_up", "down")]
        stack.add_layer(
            layer["input_norm"],
            layer["qkv"],
            layer["qkv_bias"],
            layer["o"],
            None,
            layer["post_norm"],
            layer["gate_up"],
            None,
            layer["down"],
            None,
            *(ops.pack_panels(linear) if panels else None for linear in linears),
            sliding_window=window,
            q_norm_weight=layer["q_norm"],
            k_norm_weight=layer["k_norm"],
        )
    return stack


def reference_stack_step(
    layers: list[dict[str, Any]],
    windows: list[int],
    hidden: torch.Tensor,
    residual: torch.Tensor,
    caches: list[torch.Tensor],
    tables: list[list[int]],
    seq_lens: list[int],
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step through `layers` in fp64, each layer attending to the last windows[i] keys (0: all); caches
    [2, blocks, block_size, kv_heads, head_dim] get each token's key and value at position seq_len - 1."""
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    num_tokens = hidden.shape[0]
    hidden, residual, cos, sin = (t.double() for t in (hidden, residual, cos, sin))
    slot_lists = [
        [table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE for pos in range(seq_len)]
        for table, seq_len in zip(tables, seq_lens, strict=True)
    ]
    for layer, window, cache in zip(layers, windows, caches, strict=True):
        layer = {name: None if value is None else value.double() for name, value in layer.items()}
        residual = hidden + residual
        qkv = rms_norm(residual, layer["input_norm"]) @ layer["qkv"].T + layer["qkv_bias"]
        query = qkv[:, :q_size].view(num_tokens, HEADS, HEAD_DIM)
        key = qkv[:, q_size : q_size + kv_size].view(num_tokens, KV_HEADS, HEAD_DIM)
        value = qkv[:, q_size + kv_size :].view(num_tokens, KV_HEADS, HEAD_DIM)
        if layer["q_norm"] is not None:
            query, key = rms_norm(query, layer["q_norm"]), rms_norm(key, layer["k_norm"])
        query, key = rotate_half_pairs(query, cos, sin), rotate_half_pairs(key, cos, sin)
        keys_by_slot, values_by_slot = cache[0].view(-1, KV_HEADS, HEAD_DIM), cache[1].view(-1, KV_HEADS, HEAD_DIM)
        attended = []
        for token, slots in enumerate(slot_lists):
            keys_by_slot[slots[-1]], values_by_slot[slots[-1]] = key[token], value[token]
            in_window = slots[-window:] if window > 0 else slots
            keys = keys_by_slot[in_window].repeat_interleave(HEADS // KV_HEADS, dim=1)
            values = values_by_slot[in_window].repeat_interleave(HEADS // KV_HEADS, dim=1)
            scores = torch.einsum("hd,khd->hk", query[token], keys) * HEAD_DIM**-0.5
            attended.append(torch.einsum("hk,khd->hd", scores.softmax(-1), values).reshape(q_size))
        residual = torch.stack(attended) @ layer["o"].T + residual
        gate, up = (rms_norm(residual, layer["post_norm"]) @ layer["gate_up"].T).chunk(2, dim=-1)
        hidden = (torch.nn.functional.silu(gate) * up) @ layer["down"].T
    return hidden, residual


@pytest.mark.parametrize("panels", [False, True])
# 7 tokens: every kernel spread over the threads; 40 on 2 threads: each thread takes its own tokens.
@pytest.mark.parametrize(("num_tokens", "num_threads"), [(7, 1), (40, 2)])
@pytest.mark.parametrize("has_residual", [False, True])
def test_stack_with_per_layer_windows_and_qk_norms_matches_a_torch_step(
    panels: bool, num_tokens: int, num_threads: int, has_residual: bool
) -> None:
    generator = torch.Generator().manual_seed(num_tokens)
    layers = random_stack_layers(generator, qk_norm_layers={0, 2, 3})
    windows = [STACK_WINDOW if window == -1 else window for window in LAYER_WINDOWS]
    # Contexts from 1 to 30 keys: shorter and longer than each window; shuffled blocks, disjoint per request.
    seq_lens = [1 + (11 * token) % 30 for token in range(num_tokens)]
    blocks = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    tables = [blocks[token * 8 : (token + 1) * 8] for token in range(num_tokens)]
    slots = [
        table[(seq_len - 1) // BLOCK_SIZE] * BLOCK_SIZE + (seq_len - 1) % BLOCK_SIZE
        for table, seq_len in zip(tables, seq_lens, strict=True)
    ]
    # Earlier tokens' keys and values: whatever the cache holds; the step writes each new token's.
    caches = [torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=generator) for _ in layers]
    hidden = torch.randn(num_tokens, HIDDEN, generator=generator)
    residual = torch.randn(num_tokens, HIDDEN, generator=generator) if has_residual else torch.zeros(num_tokens, HIDDEN)
    angles = torch.tensor(seq_lens)[:, None] - 1.0
    angles = angles * 10000.0 ** (-torch.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    cos, sin = angles.cos(), angles.sin()

    reference_caches = [cache.double() for cache in caches]
    expected = reference_stack_step(layers, windows, hidden, residual, reference_caches, tables, seq_lens, cos, sin)
    stack = build_stack(layers, panels)
    out_hidden, out_residual = (
        hidden.clone(),
        residual.clone() if has_residual else torch.full_like(hidden, float("nan")),
    )
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        stack.forward(
            out_hidden,
            out_residual,
            has_residual,
            caches,
            torch.tensor(tables, dtype=torch.int32),
            torch.tensor(seq_lens, dtype=torch.int32),
            torch.tensor(slots, dtype=torch.int64),
            cos,
            sin,
            False,
        )
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(out_hidden.double(), expected[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out_residual.double(), expected[1], atol=1e-4, rtol=1e-4)
    for cache, reference_cache in zip(caches, reference_caches, strict=True):
        torch.testing.assert_close(cache.double(), reference_cache, atol=1e-4, rtol=1e-4)
    # Each feature changes this step: a stack that ran one window everywhere, or skipped the head norms, would fail.
    for other_layers, other_windows in (
        (layers, [STACK_WINDOW] * len(layers)),
        ([{**layer, "q_norm": None, "k_norm": None} for layer in layers], windows),
    ):
        other_caches = [cache.double() for cache in caches]
        other = reference_stack_step(
            other_layers, other_windows, hidden, residual, other_caches, tables, seq_lens, cos, sin
        )
        assert not torch.allclose(other[0], expected[0], atol=1e-3, rtol=1e-3)


def test_stack_refuses_a_bad_layer_window_or_head_norm() -> None:
    layer = random_stack_layers(torch.Generator().manual_seed(0), qk_norm_layers=set())[0]
    stack = load_cpu_ops().DecodeStack(HEADS, KV_HEADS, HEAD_DIM, EPS, HEAD_DIM**-0.5, STACK_WINDOW)
    # No biases and no panels: the 14 positional arguments every caller passes.
    plain = [layer["input_norm"], layer["qkv"], None, layer["o"], None, layer["post_norm"], layer["gate_up"], None]
    positional = [*plain, layer["down"], *[None] * 5]
    with pytest.raises(RuntimeError, match="sliding_window is -1"):
        stack.add_layer(*positional, sliding_window=-2)
    with pytest.raises(RuntimeError, match=f"q_norm must have {HEAD_DIM} elements"):
        stack.add_layer(*positional, q_norm_weight=torch.ones(HEAD_DIM + 1))
    with pytest.raises(RuntimeError, match="k_norm must be a contiguous CPU fp32"):
        stack.add_layer(*positional, k_norm_weight=torch.ones(HEAD_DIM, dtype=torch.float64))
