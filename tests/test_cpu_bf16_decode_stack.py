"""The C++ decoder stack on a bf16 model: its weights on our AMX tiles (CPUs with AMX) or on our bf16 panels
(AVX512-BF16), the KV cache bf16. Each kernel runs where this CPU has it; the panels run on an AMX CPU too (the
engine picks the tiles there, this test packs the panels itself)."""

from __future__ import annotations

import pytest
import torch

from cuda_ext.cpu_ops import load_cpu_ops
from tests.test_cpu_decoder_stack import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    as_tuple,
    attention_batch,
    prefilled_decode,
    random_llama,
    run,
    stack_takes_step,
)

OPS = load_cpu_ops()
HAS_AMX = OPS is not None and getattr(OPS, "has_amx", False) and OPS.amx_usable()
HAS_BF16_PANELS = OPS is not None and getattr(OPS, "has_bf16_panels", False)
KERNELS = [
    pytest.param("amx", marks=pytest.mark.skipif(not HAS_AMX, reason="no AMX tiles on this CPU (or build)")),
    pytest.param(
        "bf16 panels", marks=pytest.mark.skipif(not HAS_BF16_PANELS, reason="no AVX512-BF16 on this CPU (or build)")
    ),
]


def bf16_llama(kernel: str, **overrides: object) -> torch.nn.Module:
    """random_llama's model in bf16, its linears packed for `kernel`, the stack built over them."""
    from model_executor.layers.linear import (
        BF16_PANEL_MAX_TOKENS,
        CpuAmxLinearMethod,
        CpuBf16PanelLinearMethod,
        PackableWeight,
    )

    model = random_llama(**overrides)
    model.to(torch.bfloat16)
    for rotary in model.rotary_embeddings.values():
        rotary.float()  # the loader builds the cos/sin tables in fp32 whatever the model's dtype
    for module in model.modules():
        if isinstance(module, PackableWeight):
            if kernel == "amx":
                method = CpuAmxLinearMethod(OPS)
            else:
                method = CpuBf16PanelLinearMethod(OPS, BF16_PANEL_MAX_TOKENS)
            module.linear_method = method
            method.process_weights_after_loading(module)
    assert model.prepare_decode_stack()
    return model


# Both bf16 paths against the same model in fp32 with the bf16 weights' values (activations exact to fp32). They
# round at different points (the stack keeps the hidden state, residual and MLP sums fp32 between kernels, where the
# layers round each to bf16), so neither is the other's bits: the stack's error must stay of the layers' size.
# Measured when written: 0.8-1.6x the layers' mean and worst error (1.6x on head_dim 10, one token).
ERROR_SLACK = 1.75


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(
    "overrides",
    [{}, {"attention_bias": True, "mlp_bias": True}, {"hidden_size": 40, "intermediate_size": 36}],
)
# (new tokens, cached tokens) per request, decodes first: one decode, a few, 40 (each of 2 threads takes its own 20
# through every layer); decodes with prefill chunks, and a fresh 70-token prompt alone.
@pytest.mark.parametrize(
    ("num_new", "num_cached"),
    [
        ([1], [9]),
        ([1] * 3, [5, 17, 2]),
        ([1] * 40, [(7 * i) % 27 + 1 for i in range(40)]),
        ([1, 1, 7], [3, 6, 0]),
        ([1, 4, 9, 2], [20, 0, 5, 3]),
        ([70], [0]),
    ],
)
def test_bf16_steps_through_the_stack_are_as_close_to_exact_as_layer_by_layer(
    kernel: str, overrides: dict[str, object], num_new: list[int], num_cached: list[int]
) -> None:
    blocks = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(sum(num_cached))).tolist()
    width = -(-max(new + cached for new, cached in zip(num_new, num_cached, strict=True)) // BLOCK_SIZE)
    tables = [blocks[i * width : (i + 1) * width] for i in range(len(num_cached))]
    decode = attention_batch(num_new, num_cached, tables)

    def decode_step(model: torch.nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
        caches = [
            model.attention_backend.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE, dtype, torch.device("cpu"))
            for _ in range(model.num_local_layers)
        ]
        for cached, table in zip(num_cached, tables, strict=True):
            if cached:
                run(model, caches, attention_batch([cached], [0], [table]), None)
        (output,) = as_tuple(run(model, caches, decode, None))
        return output.float(), caches

    reference = random_llama(**overrides)
    with torch.no_grad():
        for param in reference.parameters():
            param.copy_(param.bfloat16().float())
    reference.decode_stack = None
    exact, _ = decode_step(reference, torch.float32)

    model = bf16_llama(kernel, **overrides)
    assert stack_takes_step(model, num_new, num_cached) == (model.stack_runs_prefill or max(num_new) == 1)
    stack_output, stack_caches = decode_step(model, torch.bfloat16)
    model.decode_stack = None
    layer_output, _ = decode_step(model, torch.bfloat16)
    stack_error, layer_error = (stack_output - exact).abs(), (layer_output - exact).abs()
    summary = (
        f"stack mean/worst {stack_error.mean():.4f}/{stack_error.max():.4f}, "
        f"layers {layer_error.mean():.4f}/{layer_error.max():.4f}"
    )
    assert stack_error.mean() <= ERROR_SLACK * layer_error.mean(), summary
    assert stack_error.max() <= ERROR_SLACK * layer_error.max(), summary
    assert {cache.dtype for cache in stack_caches} == {torch.bfloat16}
    # Each new token's keys landed in its slot (the prefill alone leaves those rows zero).
    key_rows = stack_caches[0][0].view(-1, *stack_caches[0].shape[3:])
    assert all(key_rows[slot].abs().sum() > 0 for slot in decode.slot_mapping)


def test_a_bf16_layer_without_kernel_weights_is_refused() -> None:
    """The stack reads bf16 weights through a kernel's layout only: a bf16 layer given neither is refused."""
    model = random_llama()
    model.to(torch.bfloat16)
    layer = next(iter(model.layers.values()))
    attn, mlp = layer.self_attn, layer.mlp
    stack = OPS.DecodeStack(num_heads=4, num_kv_heads=2, head_dim=16, eps=1e-5, scale=0.25, sliding_window=0)
    with pytest.raises(RuntimeError, match="AMX tiles or bf16 panels"):
        stack.add_layer(
            layer.input_layernorm.weight,
            attn.qkv_proj.weight,
            None,
            attn.o_proj.weight,
            None,
            layer.post_attention_layernorm.weight,
            mlp.gate_up_proj.weight,
            None,
            mlp.down_proj.weight,
            None,
            None,
            None,
            None,
            None,
        )


@pytest.mark.skipif(not HAS_AMX, reason="no AMX tiles on this CPU (or build)")
# The MLP's SiLU-and-mul runs in the gate_up projection's epilogue where intermediate_size is a multiple of 16 (96:
# whole depth tiles of the down projection's input; 48 with biases: its last tile half filled), as a row-wise stage
# otherwise (36).
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"attention_bias": True, "hidden_size": 40, "intermediate_size": 36},
        {"intermediate_size": 48, "mlp_bias": True},
    ],
)
def test_lockstep_decode_steps_match_one_thread_bit_for_bit(overrides: dict[str, object]) -> None:
    """With AMX linears and 16 decode rows or more per thread, the threads go through each stage together: each
    projection's weight pairs shared out, the row-wise work (norms, attention, SiLU where it is not fused) by rows.
    50 rows (a partial last token block), contexts long and short, on 2 and 3 threads: output and cache equal the
    one-thread stack's exactly (one thread runs every kernel over all rows)."""
    model = bf16_llama("amx", **overrides)
    num_cached = [60 - i for i in range(20)] + [1 + i % 5 for i in range(30)]
    caches, decode = prefilled_decode(model, num_cached, 4, torch.bfloat16)

    def step(num_threads: int) -> tuple[torch.Tensor, list[torch.Tensor], bool]:
        step_caches = [cache.clone() for cache in caches]
        previous = torch.get_num_threads()
        torch.set_num_threads(num_threads)
        try:
            (output,) = as_tuple(run(model, step_caches, decode, None))
        finally:
            torch.set_num_threads(previous)
        return output, step_caches, model.decode_stack.last_step_lockstep

    one_output, one_caches, one_lockstep = step(1)
    assert not one_lockstep
    for num_threads in (2, 3, 2):
        output, step_caches, lockstep = step(num_threads)
        assert lockstep
        torch.testing.assert_close(output, one_output, rtol=0, atol=0)
        for cache, one_cache in zip(step_caches, one_caches, strict=True):
            torch.testing.assert_close(cache, one_cache, rtol=0, atol=0)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_bf16_mixed_step_asked_for_its_sampled_rows_gives_the_full_steps_rows(kernel: str) -> None:
    """A bf16 mixed step (two decodes, a 7-token prompt, a 5-token chunk after a cached prefix) through the stack,
    asked for the rows that sample: its last layer attends those rows alone, the chunks' last rows as decodes.
    The caches are the full step's bits, the decode rows its bits too, and a chunk's last row differs from the full
    step's by no more than the two attention kernels' bf16 rounding of its output carries."""
    model = bf16_llama(kernel)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(4)]
    num_new, num_cached = [1, 1, 7, 5], [3, 6, 0, 2]
    assert stack_takes_step(model, num_new, num_cached) == model.stack_runs_prefill
    sampled = [0, 1, 8, 13]  # the decodes and each chunk's last row
    positions = torch.tensor([p for n, c in zip(num_new, num_cached, strict=True) for p in range(c, c + n)])
    outputs, caches = [], []
    for rows in (None, torch.tensor(sampled, dtype=torch.int64)):
        step_caches = [
            model.attention_backend.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE, torch.bfloat16, torch.device("cpu"))
            for _ in range(model.num_local_layers)
        ]
        for cached, table in zip(num_cached, tables, strict=True):
            if cached:
                run(model, step_caches, attention_batch([cached], [0], [table]), None)
        metadata = model.attention_backend.build_metadata(
            attention_batch(num_new, num_cached, tables), BLOCK_SIZE, torch.device("cpu")
        )
        with torch.inference_mode():
            (output,) = as_tuple(
                model((positions * 7 + 3) % model.config.vocab_size, positions, step_caches, metadata, None, rows)
            )
        outputs.append(output.float())
        caches.append(step_caches)
    full, selected = outputs
    for full_cache, selected_cache in zip(*caches, strict=True):
        assert torch.equal(selected_cache, full_cache)
    assert selected.shape == (len(sampled), model.config.hidden_size)
    assert torch.equal(selected[:2], full[:2])
    # One bf16 step (2^-8 of the value) in an attention output element moves the final norm's row by about that.
    torch.testing.assert_close(selected[2:], full[sampled[2:]], rtol=2**-7, atol=2**-7 * full.abs().max().item())
