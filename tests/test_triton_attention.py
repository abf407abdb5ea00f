"""Triton paged-attention kernels against the torch reference backend, under the Triton CPU interpreter.

Triton decorates every jit function (its own standard library included) once, when it is imported, for the
interpreter or for the GPU: TRITON_INTERPRET=1 must be set before anything imports triton. tests/conftest.py
sets it where there is no CUDA device. Where there is one, this process compiles the kernels and the interpreter
tests run in a child pytest with the variable set (test_interpreter_tests_in_subprocess). Compiled-kernel tests
(CUDA) need the opposite and skip in an interpreting process.

Tolerances: fp32 atol = rtol = 1e-5 against the torch backend; fp16 2e-3 and bf16 1.6e-2 (about two output
ulps) against the torch backend in fp32 on the same rounded inputs; the KV-cache write is exact.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from cuda_ext.attention import get_attention_backend
from cuda_ext.attention.base import AttentionBatch
from cuda_ext.attention.torch_backend import TorchAttentionBackend
from cuda_ext.attention.triton_backend import TritonAttentionBackend
from cuda_ext.cuda_graphs import pad_decode_batch
from cuda_ext.kernels import unified_attention as unified_attention_module
from cuda_ext.kernels.reshape_and_cache import reshape_and_cache
from cuda_ext.kernels.unified_attention import make_tile_config, plan_query_tiles

REPO_ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

interpreted = pytest.mark.skipif(
    not unified_attention_module.INTERPRETED,
    reason="this process compiles Triton kernels: these run in a child process (test_interpreter_tests_in_subprocess)",
)
needs_compiled_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or unified_attention_module.INTERPRETED,
    reason="needs a CUDA GPU and compiled (not interpreted) Triton kernels"
    if torch.cuda.is_available()
    else "CUDA is not available on this machine",
)


@dataclass
class Case:
    batch: AttentionBatch
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    block_size: int


def make_case(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: torch.device = CPU,
    extra_blocks: int = 4,
) -> Case:
    """Random requests (decodes first) over shuffled, non-contiguous blocks of a randomly filled cache.

    Every block table also lists one block past what seq_len needs, as the engine's tables may.
    """
    generator = torch.Generator().manual_seed(seed)
    order = sorted(range(len(query_lens)), key=lambda i: query_lens[i] != 1)
    query_lens = [query_lens[i] for i in order]
    seq_lens = [seq_lens[i] for i in order]
    blocks_needed = [-(-seq_len // block_size) + 1 for seq_len in seq_lens]
    num_blocks = sum(blocks_needed) + extra_blocks
    # Block 0 is never handed out: padded block-table entries point at it.
    permutation = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    block_tables, slot_mapping = [], []
    for query_len, seq_len, needed in zip(query_lens, seq_lens, blocks_needed, strict=True):
        table, permutation = permutation[:needed], permutation[needed:]
        block_tables.append(table)
        slot_mapping += [
            table[pos // block_size] * block_size + pos % block_size for pos in range(seq_len - query_len, seq_len)
        ]
    num_decodes = sum(1 for query_len in query_lens if query_len == 1)
    batch = AttentionBatch(query_lens, seq_lens, block_tables, slot_mapping, num_decodes)
    num_tokens = sum(query_lens)
    # A fused QKV buffer sliced like the model does, so key and value are strided views.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    query = qkv[:, : num_heads * head_dim].reshape(num_tokens, num_heads, head_dim).contiguous()
    key = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    return Case(
        batch,
        query.to(device, dtype),
        key.to(device, dtype),
        value.to(device, dtype),
        kv_cache.to(device, dtype),
        block_size,
    )


def run_backend(
    backend_cls: type,
    case: Case,
    num_heads: int,
    sliding_window: int | None,
    dtype: torch.dtype,
    *,
    scale: float | None = None,
    logit_soft_cap: float | None = None,
):
    """(output, cache after the step) of one backend on a copy of the case's cache, inputs cast to dtype."""
    num_kv_heads, head_dim = case.key.shape[1], case.key.shape[2]
    backend = backend_cls(num_heads, num_kv_heads, head_dim, sliding_window, scale=scale, logit_soft_cap=logit_soft_cap)
    kv_cache = case.kv_cache.to(dtype).clone()
    metadata = backend.build_metadata(case.batch, case.block_size, case.query.device)
    output = backend.forward(case.query.to(dtype), case.key.to(dtype), case.value.to(dtype), kv_cache, metadata)
    return output, kv_cache


# (name, heads, kv heads, head_dim, block size, query_lens, seq_lens, sliding window)
CASES = [
    ("decode_only_gqa2_bs16", 4, 2, 16, 16, [1, 1, 1, 1, 1], [1, 16, 17, 33, 50], None),
    ("prefill_only_gqa1_bs16", 2, 2, 64, 16, [7, 16, 40], [7, 16, 40], None),
    ("mixed_gqa4_bs32", 8, 2, 64, 32, [1, 1, 1, 9, 33], [5, 32, 70, 9, 80], None),
    ("mixed_gqa3_bs16", 6, 2, 64, 16, [1, 1, 20, 3], [31, 64, 45, 3], None),
    ("short_prefills_in_small_tiles_gqa1", 2, 2, 16, 16, [1, 5, 16, 17], [3, 21, 16, 40], None),
    ("long_chunk_several_tiles_gqa1", 1, 1, 16, 32, [100], [131], None),
    ("window_gqa2_bs16", 4, 2, 64, 16, [1, 1, 24], [40, 9, 50], 8),
    ("window_gqa4_bs32_multi_tile", 4, 1, 16, 32, [1, 70], [90, 100], 33),
    ("head_dim_128_gqa4", 4, 1, 128, 16, [1, 18], [20, 18], None),
]


@interpreted
@pytest.mark.parametrize(
    ("name", "num_heads", "num_kv_heads", "head_dim", "block_size", "query_lens", "seq_lens", "window"),
    CASES,
    ids=[case[0] for case in CASES],
)
def test_matches_torch_backend_fp32(
    name: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    query_lens: list[int],
    seq_lens: list[int],
    window: int | None,
) -> None:
    case = make_case(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, seed=len(name))
    expected, expected_cache = run_backend(TorchAttentionBackend, case, num_heads, window, torch.float32)
    actual, actual_cache = run_backend(TritonAttentionBackend, case, num_heads, window, torch.float32)
    assert torch.equal(actual_cache, expected_cache)
    tolerance = TOLERANCES[torch.float32]
    torch.testing.assert_close(actual, expected, atol=tolerance, rtol=tolerance)


# (name, heads, kv heads, head_dim, block size, query_lens, seq_lens, window, scale, soft cap)
SOFT_CAP_CASES = [
    ("gemma2_like_gqa2_window20", 4, 2, 32, 16, [1, 1, 30, 9], [45, 17, 60, 9], 20, 24**-0.5, 3.0),
    ("capped_global_gqa1_multi_tile", 2, 2, 16, 32, [1, 70], [90, 100], None, 0.5, 5.0),
    ("scale_only_gqa3", 6, 2, 16, 16, [1, 24], [33, 40], None, 0.05, None),
]


@interpreted
@pytest.mark.parametrize(
    ("name", "num_heads", "num_kv_heads", "head_dim", "block_size", "query_lens", "seq_lens", "window", "scale", "cap"),
    SOFT_CAP_CASES,
    ids=[case[0] for case in SOFT_CAP_CASES],
)
def test_soft_cap_and_scale_match_torch_backend(
    name: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    query_lens: list[int],
    seq_lens: list[int],
    window: int | None,
    scale: float,
    cap: float | None,
) -> None:
    case = make_case(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, seed=len(name))
    case.query *= 3  # scores past the cap, where tanh bends them
    settings = {"scale": scale, "logit_soft_cap": cap}
    expected, expected_cache = run_backend(TorchAttentionBackend, case, num_heads, window, torch.float32, **settings)
    actual, actual_cache = run_backend(TritonAttentionBackend, case, num_heads, window, torch.float32, **settings)
    assert torch.equal(actual_cache, expected_cache)
    tolerance = TOLERANCES[torch.float32]
    torch.testing.assert_close(actual, expected, atol=tolerance, rtol=tolerance)
    # The settings matter: the default layer gives other outputs, so a kernel ignoring them fails above.
    default, _ = run_backend(TorchAttentionBackend, case, num_heads, window, torch.float32)
    assert (default - expected).abs().max() > 1e-2


@interpreted
@pytest.mark.parametrize("seed", range(6))
def test_random_batches_match_torch_backend(seed: int) -> None:
    """Random mixes of decodes, fresh prompts and chunks over a cached prefix, random layer shapes."""
    generator = torch.Generator().manual_seed(100 + seed)

    def pick(options: list) -> object:
        return options[int(torch.randint(len(options), (1,), generator=generator))]

    group = pick([1, 3, 4])
    num_kv_heads = pick([1, 2])
    head_dim = pick([16, 32, 64])
    block_size = pick([16, 32])
    window = pick([None, None, 5, 40])
    query_lens, seq_lens = [], []
    for _ in range(int(torch.randint(1, 6, (1,), generator=generator))):
        kind = pick(["decode", "prompt", "chunk"])
        query_len = 1 if kind == "decode" else int(torch.randint(1, 50, (1,), generator=generator))
        cached = 0 if kind == "prompt" else int(torch.randint(0, 70, (1,), generator=generator))
        query_lens.append(query_len)
        seq_lens.append(max(cached + query_len, 1))
    num_heads = group * num_kv_heads
    case = make_case(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, seed=seed)
    expected, expected_cache = run_backend(TorchAttentionBackend, case, num_heads, window, torch.float32)
    actual, actual_cache = run_backend(TritonAttentionBackend, case, num_heads, window, torch.float32)
    assert torch.equal(actual_cache, expected_cache)
    tolerance = TOLERANCES[torch.float32]
    torch.testing.assert_close(actual, expected, atol=tolerance, rtol=tolerance)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "query_lens", "seq_lens", "window"),
    [(8, 2, 64, 32, [1, 1, 9, 33], [5, 70, 9, 80], None), (6, 2, 64, 16, [1, 1, 24], [40, 9, 50], 8)],
    ids=["mixed_gqa4_bs32", "window_gqa3_bs16"],
)
def test_half_precision_matches_fp32_reference(
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    query_lens: list[int],
    seq_lens: list[int],
    window: int | None,
) -> None:
    case = make_case(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype=dtype, seed=3)
    # The reference sees the same rounded inputs, computed in fp32: the error left is the kernel's own.
    expected, _ = run_backend(TorchAttentionBackend, case, num_heads, window, torch.float32)
    _, expected_cache = run_backend(TorchAttentionBackend, case, num_heads, window, dtype)
    actual, actual_cache = run_backend(TritonAttentionBackend, case, num_heads, window, dtype)
    assert actual.dtype == dtype
    assert torch.equal(actual_cache, expected_cache)
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected, atol=tolerance, rtol=tolerance)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cache_write_skips_padding_slots(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_kv_heads, head_dim = 6, 16, 3, 16
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    # Strided key/value views, as sliced from a fused projection.
    fused = torch.randn(7, 2 * num_kv_heads * head_dim + 5, generator=generator).to(dtype)
    key = fused[:, : num_kv_heads * head_dim].view(7, num_kv_heads, head_dim)
    value = fused[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(7, num_kv_heads, head_dim)
    slots = torch.tensor([37, -1, 3, 95, -1, 16, 50], dtype=torch.int32)
    expected = kv_cache.clone()
    keep = slots >= 0
    expected[0].view(-1, num_kv_heads, head_dim)[slots[keep].long()] = key[keep]
    expected[1].view(-1, num_kv_heads, head_dim)[slots[keep].long()] = value[keep]
    reshape_and_cache(key, value, kv_cache[0], kv_cache[1], slots)
    assert torch.equal(kv_cache, expected)


@interpreted
def test_padded_decode_rows_are_harmless() -> None:
    """A decode batch padded to a CUDA-graph bucket: real rows unchanged, padding writes nothing."""
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 16
    case = make_case([1, 1, 1], [5, 20, 33], num_heads, num_kv_heads, head_dim, block_size, seed=7)
    padded = pad_decode_batch(case.batch, 8)
    padding = torch.randn(5, num_heads + 2 * num_kv_heads, head_dim)
    padded_case = Case(
        padded,
        torch.cat([case.query, padding[:, :num_heads]]),
        torch.cat([case.key, padding[:, num_heads : num_heads + num_kv_heads]]),
        torch.cat([case.value, padding[:, num_heads + num_kv_heads :]]),
        case.kv_cache,
        block_size,
    )
    expected, expected_cache = run_backend(TorchAttentionBackend, case, num_heads, None, torch.float32)
    actual, actual_cache = run_backend(TritonAttentionBackend, padded_case, num_heads, None, torch.float32)
    assert torch.equal(actual_cache, expected_cache)
    tolerance = TOLERANCES[torch.float32]
    torch.testing.assert_close(actual[:3], expected, atol=tolerance, rtol=tolerance)
    assert torch.isfinite(actual).all()


@interpreted
def test_reads_only_keys_it_may_see() -> None:
    """NaN everywhere a request may not look (other blocks, slots past seq_len) leaves the output unchanged."""
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 16
    case = make_case([1, 1, 13], [20, 7, 30], num_heads, num_kv_heads, head_dim, block_size, seed=11)
    clean, _ = run_backend(TritonAttentionBackend, case, num_heads, 8, torch.float32)
    visible = torch.zeros(case.kv_cache.shape[1] * block_size, dtype=torch.bool)
    for table, query_len, seq_len in zip(
        case.batch.block_tables, case.batch.query_lens, case.batch.seq_lens, strict=True
    ):
        # With a window of 8 the first query still sees 7 keys before its own position.
        for pos in range(max(0, seq_len - query_len - 7), seq_len):
            visible[table[pos // block_size] * block_size + pos % block_size] = True
    poisoned = case.kv_cache.clone().view(2, -1, num_kv_heads, head_dim)
    poisoned[:, ~visible] = float("nan")
    case.kv_cache = poisoned.view_as(case.kv_cache)
    actual, _ = run_backend(TritonAttentionBackend, case, num_heads, 8, torch.float32)
    assert torch.equal(actual, clean)


def test_tile_plan_sizes_the_grid_to_real_work() -> None:
    config = make_tile_config(num_heads=32, num_kv_heads=8, head_dim=128)
    assert (config.small_block_m, config.small_block_q) == (16, 4)
    assert (config.large_block_m, config.large_block_q) == (64, 16)
    # Decode-only: one small tile per request, nothing else.
    requests, starts, num_small = plan_query_tiles([1] * 64, config)
    assert (requests, starts, num_small) == (list(range(64)), [0] * 64, 64)
    # Mixed: decodes and short chunks take small tiles first; a 40-token chunk takes cdiv(40, 16) large tiles.
    requests, starts, num_small = plan_query_tiles([1, 1, 4, 40, 5], config)
    assert num_small == 3
    assert requests == [0, 1, 2, 3, 3, 3, 4]
    assert starts == [0, 0, 0, 0, 16, 32, 0]
    assert plan_query_tiles([], config) == ([], [], 0)
    # head_dim 16 (the tiny model) and a 3-way group pad to powers of two for tl.arange.
    tiny = make_tile_config(num_heads=6, num_kv_heads=2, head_dim=20)
    assert (tiny.group_pad, tiny.head_dim_pad, tiny.small_block_q, tiny.large_block_q) == (4, 32, 4, 16)


@interpreted
def test_metadata_is_packed_and_padded() -> None:
    backend = TritonAttentionBackend(4, 2, 16)
    batch = AttentionBatch([1, 3], [17, 3], [[5, 2, 9], [4, 8]], [2 * 16 + 0, 64, 65, 66], num_decodes=1)
    metadata = backend.build_metadata(batch, 16, CPU)
    assert metadata.query_start_loc.tolist() == [0, 1, 4]
    assert metadata.seq_lens.tolist() == [17, 3]
    # Only the blocks seq_len needs are kept, and short rows pad with block 0.
    assert metadata.block_tables.tolist() == [[5, 2], [4, 0]]
    assert metadata.slot_mapping.tolist() == [32, 64, 65, 66]
    assert (metadata.num_tokens, metadata.max_query_len, metadata.max_seq_len) == (4, 3, 17)
    assert metadata.tile_request.tolist() == [0, 1] and metadata.num_small_tiles == 2


def test_registry_picks_triton_on_cuda_and_torch_on_cpu() -> None:
    assert get_attention_backend("auto", CPU, 4, 2, 16).name in ("cpu", "torch")  # cpu where the C++ kernels built
    assert get_attention_backend("auto", torch.device("cuda"), 4, 2, 16).name == "triton"
    assert get_attention_backend("torch", torch.device("cuda"), 4, 2, 16).name == "torch"
    with pytest.raises(ValueError, match="triton"):
        get_attention_backend("flash", CPU, 4, 2, 16)


@pytest.mark.subprocess
def test_cpu_use_never_imports_triton() -> None:
    """In a fresh process without the interpreter: auto on CPU never imports triton; triton on CPU says why not."""
    script = (
        "import sys, torch\n"
        "from cuda_ext.attention import get_attention_backend\n"
        "assert get_attention_backend('auto', torch.device('cpu'), 4, 2, 16).name in ('cpu', 'torch')\n"
        "assert 'triton' not in sys.modules\n"
        "try:\n"
        "    get_attention_backend('triton', torch.device('cpu'), 4, 2, 16)\n"
        "except RuntimeError as error:\n"
        "    assert 'TRITON_INTERPRET' in str(error), error\n"
        "else:\n"
        "    raise AssertionError('triton on CPU without the interpreter should fail')\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.subprocess
def test_kernels_compile_for_an_nvidia_gpu_without_one() -> None:
    """The interpreter does not check what the GPU compiler does: compile for sm_90 with the bundled ptxas."""
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend to compile with")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    command = [sys.executable, "-m", "cuda_ext.kernels.offline_compile", "--quick", "--arch", "90"]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("attention shared") == 2
    assert result.stdout.count("4 elementwise kernels") == 2  # RMSNorm alone and with the residual, SiLU, rotary


@interpreted
def test_engine_greedy_output_matches_torch_backend() -> None:
    from executor import LLM, SamplingParams

    prompts = [
        [1, 532, 1232, 88, 9],
        [1, 77, 45, 2000, 31, 42, 18, 99, 1000, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14],
        [1, 5],
    ]
    outputs = {}
    # "padded" sends decode steps through the CUDA-graph path (bucket padding, metadata from device tensors).
    for backend, cuda_graphs in (("torch", "off"), ("triton", "off"), ("triton", "padded")):
        llm = LLM(
            model="tiny-random-llama",
            attention_backend=backend,
            device="cpu",
            num_kv_blocks=64,
            cuda_graphs=cuda_graphs,
            show_progress=False,
        )
        results = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        outputs[backend, cuda_graphs] = [result.outputs[0].token_ids for result in results]
        if cuda_graphs == "padded":
            assert llm.engine.core.executor.worker.runner.decode_graphs.num_eager_runs >= 7
    assert outputs["triton", "off"] == outputs["torch", "off"]
    assert outputs["triton", "padded"] == outputs["torch", "off"]
    assert all(len(tokens) == 8 for tokens in outputs["torch", "off"])


@pytest.mark.subprocess
@pytest.mark.skipif(unified_attention_module.INTERPRETED, reason="the interpreter tests already ran in this process")
def test_interpreter_tests_in_subprocess() -> None:
    """Where this process compiles Triton kernels (CUDA), run this module's interpreter tests in a child."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-W", "ignore"]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]


@needs_compiled_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_compiled_kernels_match_torch_on_cuda(dtype: torch.dtype, block_size: int) -> None:
    cuda = torch.device("cuda")
    query_lens = [1] * 24 + [3, 130, 257]
    seq_lens = [int(n) for n in torch.randint(1, 1500, (24,), generator=torch.Generator().manual_seed(0))]
    seq_lens += [40, 1000, 257]
    # The last shape is Gemma 2 27B's: head_dim 256, query_pre_attn_scalar 144, logit soft cap 50.
    shapes = [
        (32, 8, 128, None, None, None),
        (12, 4, 64, 200, None, None),
        (4, 2, 16, None, None, None),
        (8, 4, 256, 300, 144**-0.5, 50.0),
    ]
    for num_heads, num_kv_heads, head_dim, window, scale, cap in shapes:
        case = make_case(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype=dtype, device=cuda)
        settings = {"scale": scale, "logit_soft_cap": cap}
        expected, _ = run_backend(TorchAttentionBackend, case, num_heads, window, torch.float32, **settings)
        _, expected_cache = run_backend(TorchAttentionBackend, case, num_heads, window, dtype, **settings)
        actual, actual_cache = run_backend(TritonAttentionBackend, case, num_heads, window, dtype, **settings)
        assert torch.equal(actual_cache, expected_cache)
        # On GPU the probabilities are rounded to the input dtype for the P @ V tensor-core dot.
        tolerance = 2e-4 if dtype == torch.float32 else 2 * TOLERANCES[dtype]
        torch.testing.assert_close(actual.float(), expected, atol=tolerance, rtol=tolerance)


@interpreted
def test_metadata_of_a_large_decode_step_holds_every_request_and_block() -> None:
    """The 256-request decode step with 2k contexts whose build `python -m benchmarks.bench_attention` times."""
    from benchmarks.bench_attention import large_decode_batch

    batch = large_decode_batch()
    metadata = TritonAttentionBackend(32, 8, 128).build_metadata(batch, 16, CPU)
    assert metadata.block_tables.tolist() == batch.block_tables
    assert metadata.seq_lens.tolist() == [2048] * 256
