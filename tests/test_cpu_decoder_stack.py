"""The one-token C++ decoder stack against the layer-by-layer forward it replaces on CPU decode steps of one."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cuda_ext.attention.base import AttentionBatch
from cuda_ext.cpu_ops import load_cpu_ops
from model_executor.models.llama import LlamaForCausalLM
from model_executor.parallel_state import ParallelContext

CPU = torch.device("cpu")
BLOCK_SIZE = 4
NUM_BLOCKS = 12


def random_llama(pp_rank: int = 0, pp_size: int = 1, **overrides: Any) -> LlamaForCausalLM:
    # Imported here: transformers' config import loads triton, which the Triton tests must import first.
    from transformers import LlamaConfig

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
    assert model.prepare_one_token_stack()
    return model


def attention_batch(num_new: int, num_cached: int, block_table: list[int]) -> AttentionBatch:
    positions = range(num_cached, num_cached + num_new)
    slots = [block_table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE for pos in positions]
    return AttentionBatch([num_new], [num_cached + num_new], [block_table], slots, int(num_new == 1))


def run(
    model: LlamaForCausalLM, caches: list[torch.Tensor], batch: AttentionBatch, intermediate: Any, token_id: int
) -> Any:
    num_new = batch.query_lens[0]
    start = batch.seq_lens[0] - num_new
    metadata = model.attention_backend.build_metadata(batch, BLOCK_SIZE, CPU)
    input_ids = torch.arange(token_id, token_id + num_new)
    positions = torch.arange(start, start + num_new)
    with torch.inference_mode():
        return model(input_ids, positions, caches, metadata, intermediate)


def as_tuple(output: Any) -> tuple[torch.Tensor, ...]:
    return output if isinstance(output, tuple) else (output,)


@pytest.mark.parametrize(
    ("overrides", "pp_rank", "pp_size"),
    [
        ({}, 0, 1),
        ({"attention_bias": True, "mlp_bias": True}, 0, 1),
        ({"sliding_window": 6}, 0, 1),
        # hidden 40 and head_dim 10: the scalar tails of every vector loop; one KV head for all four.
        ({"hidden_size": 40, "intermediate_size": 36, "num_key_value_heads": 1}, 0, 1),
        ({"num_attention_heads": 8, "num_key_value_heads": 8, "hidden_size": 128}, 0, 1),
        ({}, 0, 2),  # a first pipeline stage hands (hidden, residual) on
        ({}, 1, 2),  # a later one starts from them
    ],
)
@pytest.mark.parametrize("num_cached", [1, 9, 23])
def test_one_token_through_the_stack_matches_layer_by_layer(
    overrides: dict[str, Any], pp_rank: int, pp_size: int, num_cached: int
) -> None:
    model = random_llama(pp_rank, pp_size, **overrides)
    hidden_size = model.config.hidden_size
    # Shuffled blocks: the stack must follow the block table, not assume a contiguous cache.
    block_table = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(num_cached)).tolist()
    caches = [
        model.attention_backend.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE, torch.float32, CPU)
        for _ in range(model.num_local_layers)
    ]
    generator = torch.Generator().manual_seed(7)

    def stage_input(num_tokens: int) -> Any:
        if pp_rank == 0:
            return None
        return tuple(torch.randn(num_tokens, hidden_size, generator=generator) for _ in range(2))

    run(model, caches, attention_batch(num_cached, 0, block_table), stage_input(num_cached), token_id=10)
    decode = attention_batch(1, num_cached, block_table)
    decode_input = stage_input(1)

    results = {}
    stack = model.one_token_stack
    for name, one_token_stack in (("stack", stack), ("layers", None)):
        model.one_token_stack = one_token_stack
        step_caches = [cache.clone() for cache in caches]
        step_input = None if decode_input is None else tuple(t.clone() for t in decode_input)
        results[name] = (as_tuple(run(model, step_caches, decode, step_input, token_id=77)), step_caches)

    (stack_outputs, stack_caches), (layer_outputs, layer_caches) = results["stack"], results["layers"]
    assert len(stack_outputs) == (1 if pp_rank == pp_size - 1 else 2)
    for stack_output, layer_output in zip(stack_outputs, layer_outputs, strict=True):
        torch.testing.assert_close(stack_output, layer_output, atol=1e-4, rtol=1e-4)
    for stack_cache, layer_cache in zip(stack_caches, layer_caches, strict=True):
        torch.testing.assert_close(stack_cache, layer_cache, atol=1e-4, rtol=1e-4)
    # The new token's keys landed in its slot (the prefill's alone would leave it zero).
    slot = decode.slot_mapping[0]
    assert stack_caches[0][0].view(-1, *stack_caches[0].shape[3:])[slot].abs().sum() > 0


def test_a_slot_outside_the_cache_is_refused_not_written() -> None:
    model = random_llama()
    caches = [
        model.attention_backend.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE, torch.float32, CPU)
        for _ in range(model.num_local_layers)
    ]
    batch = attention_batch(1, 4, list(range(NUM_BLOCKS)))
    batch.slot_mapping[0] = NUM_BLOCKS * BLOCK_SIZE
    with pytest.raises(RuntimeError, match="outside the cache"):
        run(model, caches, batch, None, token_id=5)


def test_the_engine_decodes_one_stream_through_the_stack_with_the_same_tokens(make_llm, tiny_model_dir) -> None:
    from configs.sampling_params import SamplingParams

    llm = make_llm(tiny_model_dir)
    model = llm.engine.core.executor.worker.runner.model
    assert model.one_token_stack is not None  # the default CPU engine takes the stack
    prompt = [1, *range(300, 340)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with_stack = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    stack, model.one_token_stack = model.one_token_stack, None
    try:
        layer_by_layer = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        model.one_token_stack = stack
    assert with_stack == layer_by_layer
    assert len(with_stack) == 24


def test_no_stack_without_the_kernels_or_in_bf16() -> None:
    assert load_cpu_ops() is not None
    model = random_llama()
    model.to(torch.bfloat16)
    model.one_token_stack = None
    assert not model.prepare_one_token_stack()
