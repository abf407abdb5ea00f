"""The C++ decoder stack against the layer-by-layer forward it replaces on CPU decode steps."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cuda_ext.attention.base import AttentionBatch
from model_executor.cpu_decode_stack import CpuDecodeStackLlama as LlamaForCausalLM
from model_executor.parallel_state import ParallelContext

CPU = torch.device("cpu")
BLOCK_SIZE = 4
NUM_BLOCKS = 320


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


def new_caches(model: LlamaForCausalLM) -> list[torch.Tensor]:
    return [
        model.attention_backend.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE, torch.float32, CPU)
        for _ in range(model.num_local_layers)
    ]


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
    num_cached = [56 - i for i in range(16)] + [1 + i % 3 for i in range(24)]
    blocks = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(3)).tolist()
    tables, start = [], 0
    for cached in num_cached:
        needed = cached // BLOCK_SIZE + 1
        tables.append(blocks[start : start + needed])
        start += needed
    caches = new_caches(model)
    for cached, table in zip(num_cached, tables, strict=True):
        run(model, caches, attention_batch([cached], [0], [table]), None)
    decode = attention_batch([1] * len(num_cached), num_cached, tables)

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
    for _ in range(5):
        output, step_caches, step_handoffs = step(2)
        handoffs += step_handoffs
        torch.testing.assert_close(output, one_output, rtol=0, atol=0)
        for cache, one_cache in zip(step_caches, one_caches, strict=True):
            torch.testing.assert_close(cache, one_cache, rtol=0, atol=0)
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


def test_a_step_with_a_prefill_chunk_runs_layer_by_layer() -> None:
    """The stack takes decode tokens only: a step that also prefills a prompt chunk must not call it."""
    model = random_llama()
    num_cached = [2] * 5
    tables = [list(range(i * 3, i * 3 + 3)) for i in range(len(num_cached) + 1)]
    caches = new_caches(model)
    for cached, table in zip(num_cached, tables[:-1], strict=True):
        run(model, caches, attention_batch([cached], [0], [table]), None)
    model.decode_stack = "not a stack"  # calling it would raise
    output = run(model, caches, attention_batch([1] * len(num_cached) + [4], [*num_cached, 0], tables), None)
    assert output.shape == (len(num_cached) + 4, model.config.hidden_size)


def test_a_slot_outside_the_cache_is_refused_not_written() -> None:
    model = random_llama()
    batch = attention_batch([1], [4], [list(range(NUM_BLOCKS))])
    batch.slot_mapping[0] = NUM_BLOCKS * BLOCK_SIZE
    with pytest.raises(RuntimeError, match="outside the cache"):
        run(model, new_caches(model), batch, None)


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


def test_no_stack_in_bf16() -> None:
    """The stack is fp32 only: a bf16 model keeps the layer-by-layer path."""
    model = random_llama()
    model.to(torch.bfloat16)
    model.decode_stack = None
    assert not model.prepare_decode_stack()


@pytest.mark.parametrize(("panels", "pp_rank", "pp_size"), [(False, 0, 1), (True, 0, 1), (True, 1, 2), (True, 0, 2)])
@pytest.mark.parametrize("output_rows", [[2, 9, 10], [9], []])
def test_output_rows_skip_the_last_layer_for_the_others_and_cache_every_row(
    panels: bool, pp_rank: int, pp_size: int, output_rows: list[int]
) -> None:
    """A mixed step (two decodes, a 7-token prompt and a 5-token chunk of another) asked for the
    rows that sample: those rows' hidden states equal the full step's, every row's keys and values are cached all
    the same, and a first pipeline stage hands every row on."""
    model = random_llama(pp_rank=pp_rank, pp_size=pp_size, panels=panels)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(4)]
    num_new, num_cached = [1, 1, 7, 5], [3, 6, 0, 2]
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
