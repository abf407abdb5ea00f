"""CUDA graphs for decode steps: batch-size buckets, padding a decode step to its bucket, capture and replay.

A captured graph replays fixed shapes, so a decode step of B requests runs the graph of the smallest bucket
>= B with its inputs padded by harmless rows: token id 0 at position 0, KV slot -1 (the cache write skips it),
a block-table row of zeros and seq_len 1 (attention reads key 0 of block 0 and the result is discarded; 1 rather
than 0 so no backend ever sees an empty softmax). The bucket and padding logic is pure and runs anywhere;
`CudaGraphRunner.capture` needs CUDA, and without captured graphs the runner runs the padded inputs eagerly.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from cuda_ext.attention.base import AttentionBatch

logger = logging.getLogger(__name__)

PADDING_SLOT = -1
PADDING_SEQ_LEN = 1
DEFAULT_MAX_DECODE_BATCH = 256


def decode_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch_size, which is always the last bucket."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    buckets = [size for size in (1, 2, 4) if size < max_batch_size]
    buckets += list(range(8, max_batch_size + 1, 8))
    if not buckets or buckets[-1] != max_batch_size:
        buckets.append(max_batch_size)
    return buckets


DEFAULT_BUCKETS: tuple[int, ...] = tuple(decode_buckets(DEFAULT_MAX_DECODE_BATCH))


def bucket_for(batch_size: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int | None:
    """The smallest bucket holding batch_size (buckets sorted ascending), or None when it exceeds them all."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    index = bisect.bisect_left(buckets, batch_size)
    return buckets[index] if index < len(buckets) else None


@dataclass(slots=True)
class DecodeInputs:
    """A decode step's per-request model inputs (one token per request)."""

    input_ids: torch.Tensor  # [batch] int64
    positions: torch.Tensor  # [batch] int64
    slot_mapping: torch.Tensor  # [batch]
    seq_lens: torch.Tensor  # [batch]
    block_tables: torch.Tensor  # [batch, max_blocks]

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]


def _pad_rows(tensor: torch.Tensor, rows: int, fill: int) -> torch.Tensor:
    padding = torch.full((rows, *tensor.shape[1:]), fill, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([tensor, padding])


def pad_decode_inputs(inputs: DecodeInputs, bucket: int, max_blocks: int | None = None) -> DecodeInputs:
    """Pad a decode step to `bucket` rows (and its block tables to `max_blocks` columns when given)."""
    rows = bucket - inputs.batch_size
    if rows < 0:
        raise ValueError(f"batch of {inputs.batch_size} does not fit bucket {bucket}")
    block_tables = _pad_rows(inputs.block_tables, rows, 0)
    if max_blocks is not None:
        extra_columns = max_blocks - block_tables.shape[1]
        if extra_columns < 0:
            raise ValueError(f"block tables have {block_tables.shape[1]} columns, more than {max_blocks}")
        block_tables = torch.nn.functional.pad(block_tables, (0, extra_columns), value=0)
    return DecodeInputs(
        input_ids=_pad_rows(inputs.input_ids, rows, 0),
        positions=_pad_rows(inputs.positions, rows, 0),
        slot_mapping=_pad_rows(inputs.slot_mapping, rows, PADDING_SLOT),
        seq_lens=_pad_rows(inputs.seq_lens, rows, PADDING_SEQ_LEN),
        block_tables=block_tables,
    )


def pad_decode_batch(batch: AttentionBatch, bucket: int) -> AttentionBatch:
    """The same padding for a decode-only `AttentionBatch`, so any backend builds the bucket's metadata."""
    if batch.num_decodes != len(batch.query_lens):
        raise ValueError("only decode-only batches are padded to a CUDA-graph bucket")
    rows = bucket - len(batch.query_lens)
    if rows < 0:
        raise ValueError(f"batch of {len(batch.query_lens)} does not fit bucket {bucket}")
    return AttentionBatch(
        query_lens=[*batch.query_lens, *([1] * rows)],
        seq_lens=[*batch.seq_lens, *([PADDING_SEQ_LEN] * rows)],
        block_tables=[*batch.block_tables, *([[0]] * rows)],
        slot_mapping=[*batch.slot_mapping, *([PADDING_SLOT] * rows)],
        num_decodes=bucket,
    )


def copy_into_static(static: torch.Tensor, value: torch.Tensor) -> None:
    """Copy value into the top-left corner of a static buffer and zero the rest (e.g. narrower block tables)."""
    if static.shape == value.shape:
        static.copy_(value)
        return
    if value.dim() != static.dim() or any(v > s for v, s in zip(value.shape, static.shape, strict=True)):
        raise ValueError(f"input of shape {tuple(value.shape)} does not fit static buffer {tuple(static.shape)}")
    static.zero_()
    static[tuple(slice(0, size) for size in value.shape)].copy_(value)


@dataclass(slots=True)
class CapturedGraph:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    output: torch.Tensor


class CudaGraphRunner:
    """Captures `fn(**inputs) -> Tensor` once per bucket and replays it for batches padded to that bucket.

    `make_inputs(bucket)` allocates the static CUDA input buffers of one bucket (their first dimension is the
    bucket). Inputs given to `run` must already be padded to a bucket (see `pad_decode_inputs`); smaller trailing
    dimensions are zero-padded into the buffers. The returned tensor is the graph's static output: it is
    overwritten by the next replay of the same bucket, so clone it to keep it.
    """

    def __init__(
        self,
        fn: Callable[..., torch.Tensor],
        make_inputs: Callable[[int], dict[str, torch.Tensor]],
        buckets: Sequence[int],
        num_warmups: int = 2,
    ):
        self.fn = fn
        self.make_inputs = make_inputs
        self.buckets = sorted(buckets)
        self.num_warmups = num_warmups
        self.graphs: dict[int, CapturedGraph] = {}
        self.pool: tuple[int, int] | None = None
        self.num_replays = 0
        self.num_eager_runs = 0

    def capture(self) -> None:
        """Capture every bucket, largest first so the smaller graphs reuse its memory pool."""
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA device; run the eager path on this machine")
        for bucket in reversed(self.buckets):
            if bucket in self.graphs:
                continue
            inputs = self.make_inputs(bucket)
            # Warm up on a side stream: lazy initialisation (autotuning, allocations) must not be captured.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(self.num_warmups):
                    self.fn(**inputs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self.pool):
                output = self.fn(**inputs)
            self.graphs[bucket] = CapturedGraph(graph, inputs, output)
            logger.debug("captured CUDA graph for decode bucket %d", bucket)
        torch.cuda.synchronize()

    def has_graph(self, batch_size: int) -> bool:
        bucket = bucket_for(batch_size, self.buckets)
        return bucket is not None and bucket in self.graphs

    def run(self, inputs: Mapping[str, torch.Tensor], bucket: int) -> torch.Tensor:
        """Replay the graph of `bucket` (the padded batch size) on inputs; run eagerly if it has no graph."""
        captured = self.graphs.get(bucket)
        if captured is None:
            self.num_eager_runs += 1
            return self.fn(**inputs)
        for name, value in inputs.items():
            copy_into_static(captured.inputs[name], value)
        captured.graph.replay()
        self.num_replays += 1
        return captured.output
