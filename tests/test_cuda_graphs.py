"""Decode CUDA-graph buckets and padding (pure, CPU) and graph capture/replay (CUDA only)."""

from __future__ import annotations

import pytest
import torch

from cuda_ext.attention.base import AttentionBatch
from cuda_ext.attention.torch_backend import TorchAttentionBackend
from cuda_ext.cuda_graphs import (
    PADDING_SEQ_LEN,
    PADDING_SLOT,
    CudaGraphRunner,
    DecodeInputs,
    bucket_for,
    copy_into_static,
    decode_buckets,
    pad_decode_batch,
    pad_decode_inputs,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available on this machine")


def test_buckets() -> None:
    buckets = decode_buckets(256)
    assert buckets[:7] == [1, 2, 4, 8, 16, 24, 32]
    assert buckets[-1] == 256 and buckets == sorted(set(buckets))
    assert decode_buckets(1) == [1]
    assert decode_buckets(3) == [1, 2, 3]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]
    with pytest.raises(ValueError):
        decode_buckets(0)


@pytest.mark.parametrize(("batch_size", "bucket"), [(1, 1), (3, 4), (5, 8), (9, 16), (17, 24), (256, 256), (257, None)])
def test_bucket_for(batch_size: int, bucket: int | None) -> None:
    assert bucket_for(batch_size) == bucket
    assert bucket_for(batch_size, decode_buckets(256)) == bucket


def test_bucket_for_rejects_empty_batch() -> None:
    with pytest.raises(ValueError):
        bucket_for(0)


def test_pad_decode_inputs() -> None:
    inputs = DecodeInputs(
        input_ids=torch.tensor([11, 12, 13]),
        positions=torch.tensor([4, 20, 7]),
        slot_mapping=torch.tensor([36, 83, 23]),
        seq_lens=torch.tensor([5, 21, 8], dtype=torch.int32),
        block_tables=torch.tensor([[2, 0], [4, 5], [1, 0]], dtype=torch.int32),
    )
    padded = pad_decode_inputs(inputs, bucket_for(inputs.batch_size), max_blocks=4)
    assert padded.batch_size == 4
    assert padded.input_ids.tolist() == [11, 12, 13, 0]
    assert padded.positions.tolist() == [4, 20, 7, 0]
    assert padded.slot_mapping.tolist() == [36, 83, 23, PADDING_SLOT]
    assert padded.seq_lens.tolist() == [5, 21, 8, PADDING_SEQ_LEN]
    assert padded.seq_lens.dtype == torch.int32
    assert padded.block_tables.tolist() == [[2, 0, 0, 0], [4, 5, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
    with pytest.raises(ValueError):
        pad_decode_inputs(inputs, 2)
    with pytest.raises(ValueError):
        pad_decode_inputs(inputs, 4, max_blocks=1)


def test_pad_decode_batch() -> None:
    batch = AttentionBatch([1, 1], [5, 17], [[3], [1, 2]], [3 * 16 + 4, 2 * 16], num_decodes=2)
    padded = pad_decode_batch(batch, 4)
    assert padded.query_lens == [1, 1, 1, 1]
    assert padded.seq_lens == [5, 17, 1, 1]
    assert padded.block_tables == [[3], [1, 2], [0], [0]]
    assert padded.slot_mapping == [52, 32, -1, -1]
    assert padded.num_decodes == 4
    with pytest.raises(ValueError):
        pad_decode_batch(AttentionBatch([1, 3], [5, 3], [[3], [1]], [52, 16, 17, 18], num_decodes=1), 4)


def test_padded_batch_leaves_real_rows_alone_on_torch_backend() -> None:
    generator = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 16
    backend = TorchAttentionBackend(num_heads, num_kv_heads, head_dim)
    batch = AttentionBatch([1, 1, 1], [5, 17, 30], [[3], [1, 2], [4, 5]], [52, 32, 77], num_decodes=3)
    query = torch.randn(8, num_heads, head_dim, generator=generator)
    key = torch.randn(8, num_kv_heads, head_dim, generator=generator)
    value = torch.randn(8, num_kv_heads, head_dim, generator=generator)
    kv_cache = torch.randn(2, 6, block_size, num_kv_heads, head_dim, generator=generator)
    padded_cache = kv_cache.clone()
    expected = backend.forward(
        query[:3], key[:3], value[:3], kv_cache, backend.build_metadata(batch, block_size, torch.device("cpu"))
    )
    metadata = backend.build_metadata(pad_decode_batch(batch, 8), block_size, torch.device("cpu"))
    actual = backend.forward(query, key, value, padded_cache, metadata)
    torch.testing.assert_close(actual[:3], expected)
    assert torch.equal(padded_cache, kv_cache)


def test_copy_into_static() -> None:
    static = torch.full((3, 4), 7)
    copy_into_static(static, torch.tensor([[1, 2], [3, 4], [5, 6]]))
    assert static.tolist() == [[1, 2, 0, 0], [3, 4, 0, 0], [5, 6, 0, 0]]
    copy_into_static(static, torch.ones(3, 4, dtype=torch.int64))
    assert static.sum().item() == 12
    with pytest.raises(ValueError):
        copy_into_static(static, torch.ones(4, 4, dtype=torch.int64))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where CUDA is absent")
def test_runner_capture_needs_cuda_and_runs_eagerly_without_it() -> None:
    runner = CudaGraphRunner(lambda x: x * 2, lambda bucket: {"x": torch.zeros(bucket)}, [1, 2])
    with pytest.raises(RuntimeError, match="CUDA"):
        runner.capture()
    assert runner.run({"x": torch.ones(2)}, 2).tolist() == [2.0, 2.0]
    assert (runner.num_eager_runs, runner.num_replays) == (1, 0)


@needs_cuda
def test_runner_captures_and_replays_each_bucket() -> None:
    cuda = torch.device("cuda")
    weight = torch.randn(8, 8, device=cuda)

    def step(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return x @ weight + table.sum(-1, keepdim=True)

    def make_inputs(bucket: int) -> dict[str, torch.Tensor]:
        return {"x": torch.zeros(bucket, 8, device=cuda), "table": torch.zeros(bucket, 4, device=cuda)}

    runner = CudaGraphRunner(step, make_inputs, decode_buckets(8))
    runner.capture()
    assert sorted(runner.graphs) == [1, 2, 4, 8]
    for batch_size in (1, 3, 8):
        bucket = bucket_for(batch_size, runner.buckets)
        x = torch.randn(bucket, 8, device=cuda)
        table = torch.randn(bucket, 2, device=cuda)  # narrower than the static buffer: zero-padded
        expected = step(x, torch.nn.functional.pad(table, (0, 2)))
        actual = runner.run({"x": x, "table": table}, bucket).clone()
        torch.testing.assert_close(actual, expected)
    # A batch above every bucket runs eagerly.
    x, table = torch.randn(9, 8, device=cuda), torch.randn(9, 4, device=cuda)
    torch.testing.assert_close(runner.run({"x": x, "table": table}, 9), step(x, table))


@needs_cuda
def test_triton_decode_step_in_a_graph_matches_eager_torch() -> None:
    from cuda_ext.attention.triton_backend import TritonAttentionBackend, TritonAttentionMetadata
    from cuda_ext.kernels import unified_attention

    if unified_attention.INTERPRETED:
        pytest.skip("this process interprets Triton kernels (TRITON_INTERPRET=1); a graph needs compiled ones")
    cuda = torch.device("cuda")
    generator = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size, max_blocks = 8, 2, 64, 16, 8
    dtype = torch.bfloat16
    backend = TritonAttentionBackend(num_heads, num_kv_heads, head_dim)
    kv_cache = torch.randn(2, 32, block_size, num_kv_heads, head_dim, generator=generator).to(cuda, dtype)
    names = ("query_start_loc", "seq_lens", "slot_mapping", "tile_request", "tile_q_start", "block_tables")

    def step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **tensors: torch.Tensor) -> torch.Tensor:
        bucket = query.shape[0]
        metadata = TritonAttentionMetadata(
            **tensors, num_small_tiles=bucket, num_tokens=bucket, max_query_len=1, max_seq_len=0
        )
        return backend.forward(query, key, value, kv_cache, metadata)

    def make_inputs(bucket: int) -> dict[str, torch.Tensor]:
        metadata = backend.build_metadata(pad_decode_batch(AttentionBatch([], [], [], [], 0), bucket), block_size, cuda)
        inputs = {name: getattr(metadata, name).clone() for name in names}
        inputs["block_tables"] = torch.zeros(bucket, max_blocks, dtype=torch.int32, device=cuda)
        inputs["query"] = torch.zeros(bucket, num_heads, head_dim, dtype=dtype, device=cuda)
        inputs["key"] = torch.zeros(bucket, num_kv_heads, head_dim, dtype=dtype, device=cuda)
        inputs["value"] = torch.zeros(bucket, num_kv_heads, head_dim, dtype=dtype, device=cuda)
        return inputs

    runner = CudaGraphRunner(step, make_inputs, [2, 4])
    runner.capture()
    batch = AttentionBatch([1, 1, 1], [5, 17, 100], [[3], [1, 2], [4, 5, 6, 7, 8, 9, 10]], [52, 32, 10 * 16 + 3], 3)
    query = torch.randn(4, num_heads, head_dim, generator=generator).to(cuda, dtype)
    key = torch.randn(4, num_kv_heads, head_dim, generator=generator).to(cuda, dtype)
    value = torch.randn(4, num_kv_heads, head_dim, generator=generator).to(cuda, dtype)
    reference = TorchAttentionBackend(num_heads, num_kv_heads, head_dim)
    reference_cache = kv_cache.clone()
    expected = reference.forward(
        query[:3], key[:3], value[:3], reference_cache, reference.build_metadata(batch, block_size, cuda)
    )
    metadata = backend.build_metadata(pad_decode_batch(batch, 4), block_size, cuda)
    inputs = {name: getattr(metadata, name) for name in names} | {"query": query, "key": key, "value": value}
    actual = runner.run(inputs, 4)[:3].clone()
    torch.testing.assert_close(actual.float(), expected.float(), atol=3e-2, rtol=3e-2)
    assert torch.equal(kv_cache, reference_cache)


def _greedy_tokens(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from executor import SamplingParams

    results = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [result.outputs[0].token_ids for result in results]


# Lengths straddle the 16-token block size; 7 prompts under max_num_seqs=5 make decode batches of many sizes.
GRAPH_PROMPTS = [[1, *range(100 + i, 100 + i + length)] for i, length in enumerate([3, 14, 15, 16, 30, 1, 47])]


def _tokens_and_runners_per_mode(modes: tuple[str, ...], device: str) -> tuple[dict, dict]:
    """Greedy tokens of GRAPH_PROMPTS and the model runner, per cuda_graphs mode (buckets capped at 5 seqs)."""
    from executor import LLM

    outputs, runners = {}, {}
    for mode in modes:
        llm = LLM(
            model="tiny-random-llama",
            device=device,
            dtype="float32",
            num_kv_blocks=96,
            max_num_seqs=5,
            cuda_graphs=mode,
            cuda_graph_max_batch_size=8,
            show_progress=False,
        )
        outputs[mode] = _greedy_tokens(llm, GRAPH_PROMPTS, max_tokens=24)
        runners[mode] = llm.engine.core.executor.worker.runner
    return outputs, runners


def test_padded_decode_path_gives_the_eager_engines_tokens() -> None:
    """cuda_graphs=padded runs every decode step through the graph path (bucket padding, block tables cut,
    metadata from device tensors) without capture, so the CPU checks what the GPU would replay."""

    outputs, runners = _tokens_and_runners_per_mode(("auto", "padded"), device="cpu")
    assert outputs["padded"] == outputs["auto"]
    assert all(len(tokens) == 24 for tokens in outputs["auto"])
    assert runners["auto"].decode_graphs is None  # auto on CPU: eager, no padding
    graphs = runners["padded"].decode_graphs
    assert graphs.buckets == [1, 2, 4, 5] and not graphs.graphs  # capped at max_num_seqs; nothing captured on CPU
    assert graphs.num_eager_runs >= 20 and graphs.num_replays == 0


def test_decode_batches_above_the_largest_bucket_stay_eager() -> None:
    from executor import LLM

    llm = LLM(
        model="tiny-random-llama",
        device="cpu",
        num_kv_blocks=96,
        cuda_graphs="padded",
        cuda_graph_max_batch_size=2,
        show_progress=False,
    )
    reference = LLM(model="tiny-random-llama", device="cpu", num_kv_blocks=96, cuda_graphs="off", show_progress=False)
    prompts = GRAPH_PROMPTS[:4]
    assert _greedy_tokens(llm, prompts, 6) == _greedy_tokens(reference, prompts, 6)
    # Four running decodes exceed bucket 2: those steps ran the ordinary path, so no padded run happened.
    assert llm.engine.core.executor.worker.runner.decode_graphs.num_eager_runs == 0


def test_decode_metadata_from_tensors_matches_the_list_built_one_on_torch_backend() -> None:
    generator = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 16, 16
    backend = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, sliding_window=20)
    batch = AttentionBatch([1, 1, 1], [5, 17, 40], [[3], [1, 2], [4, 0, 5]], [52, 32, 5 * 16 + 7], num_decodes=3)
    query = torch.randn(3, num_heads, head_dim, generator=generator)
    key = torch.randn(3, num_kv_heads, head_dim, generator=generator)
    value = torch.randn(3, num_kv_heads, head_dim, generator=generator)
    kv_cache = torch.randn(2, 6, block_size, num_kv_heads, head_dim, generator=generator)
    graph_cache = kv_cache.clone()
    expected = backend.forward(query, key, value, kv_cache, backend.build_metadata(batch, block_size, kv_cache.device))
    tables = torch.tensor([[3, 0, 0], [1, 2, 0], [4, 0, 5]], dtype=torch.int32)
    metadata = backend.build_decode_metadata(
        torch.tensor(batch.seq_lens, dtype=torch.int32),
        tables,
        torch.tensor(batch.slot_mapping, dtype=torch.int32),
        block_size,
    )
    torch.testing.assert_close(backend.forward(query, key, value, graph_cache, metadata), expected)
    assert torch.equal(graph_cache, kv_cache)


@needs_cuda
def test_engine_replays_captured_decode_graphs_with_eager_tokens() -> None:
    from cuda_ext.kernels import unified_attention

    if unified_attention.INTERPRETED:
        pytest.skip("this process interprets Triton kernels (TRITON_INTERPRET=1); a graph needs compiled ones")
    outputs, runners = _tokens_and_runners_per_mode(("off", "auto"), device="cuda")
    assert outputs["auto"] == outputs["off"]
    graphs = runners["auto"].decode_graphs
    assert sorted(graphs.graphs) == [1, 2, 4, 5]
    assert graphs.num_replays >= 20 and graphs.num_eager_runs == 0
