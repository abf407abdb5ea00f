"""Batched LoRA for a batch whose rows use different adapters (or none): `out += scaling * (x @ A^T) @ B^T` per row.

The adapters live in L slots of stacked, zero-padded weights: A [L, R, K] and B [L, N, R] (R = the largest rank;
a smaller adapter's extra ranks are zeros). Each row names its slot in `row_slots` (-1: base model only, the row is
left untouched). Two entry points:

- `add_lora`: one projection (o_proj, down_proj, ...).
- `add_lora_sliced`: a merged projection (qkv_proj, gate_up_proj) whose output columns are several sub-projections
  each with its own LoRA pair: slice i's A [L, R_i, K] and B [L, n_i, R_i] write out[:, offset_i : offset_i + n_i].
  Slices may differ in width (K/V heads fewer than Q heads) and rank; a slice no slot adapts can be None.

With tensor parallelism the caller passes each rank's shards: a column-parallel layer its B rows (and offsets
within its local output), a row-parallel layer its A columns and x shard. LoRA is linear in x, so a row-parallel
rank may add its partial product to its partial output before the all-reduce.

Grouping the rows by slot is done once per step: build `LoraRowGroups(row_slots, num_slots)` and pass it to every
layer instead of the raw `row_slots` tensor (a raw tensor is grouped on each call).

Devices: CUDA tensors go to the Triton shrink/expand kernels (cuda_ext.kernels.lora), which never sync with the host
(safe in a CUDA graph capture). CPU tensors take a torch path with no per-row loop, in one of two forms:
- small batches (rows x slots x rank x (K + N) up to DENSE_MAX_MACS): every row against every slot's A in one
  matmul, the other slots' columns zeroed by a one-hot mask, one expand matmul: a few ops whatever the slot count;
- larger ones, or all rows on one slot, grouped: per slot present, one gather of its rows, one shrink matmul for
  all slices, one expand matmul per slice, one index_add into out.
Both scale the shrink result in fp32 (x and A upcast for bf16/fp16), round it to the activation dtype (as a bf16
model's LoRA A output is rounded), then expand. Slot ids must lie in [-1, L): the CPU path checks, the CUDA path
cannot without a host sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import torch

# Above this many multiply-adds the CPU path groups rows by slot; below, the masked all-slots matmuls (L times the
# useful work) cost less than the per-slot gathers, index_adds and small matmuls that grouping launches.
DENSE_MAX_MACS = 10_000_000


class LoraRowGroups:
    """The rows of one batch grouped by adapter slot, for every LoRA layer of a step.

    Built from row_slots [T] (int, -1 = no adapter) and the number of slots L. The CPU grouping (slots present and
    their row indices) and the kernels' device index (rows sorted by slot, each slot's start and count) are each
    computed on first use and reused by every later call.
    """

    def __init__(self, row_slots: torch.Tensor, num_slots: int) -> None:
        if row_slots.dim() != 1:
            raise ValueError(f"row_slots must be 1-D, got shape {tuple(row_slots.shape)}")
        self.row_slots = row_slots
        self.num_slots = num_slots

    @property
    def num_rows(self) -> int:
        return self.row_slots.shape[0]

    @cached_property
    def torch_groups(self) -> tuple[tuple[int, torch.Tensor | None], ...]:
        """(slot, row indices) per slot with rows, slot ascending; indices None when the slot holds every row."""
        if self.num_rows == 0:
            return ()
        # Reads the slots on the host: meant for CPU tensors (on CUDA this would sync).
        slots = self.row_slots.to("cpu", torch.int64)
        if int(slots.min()) < -1 or int(slots.max()) >= self.num_slots:
            raise ValueError(f"row_slots must lie in [-1, {self.num_slots}), got {slots.unique().tolist()}")
        keys = torch.where(slots < 0, self.num_slots, slots)
        counts = torch.bincount(keys, minlength=self.num_slots + 1).tolist()
        for slot, count in enumerate(counts[: self.num_slots]):
            if count == self.num_rows:
                return ((slot, None),)
        order = torch.sort(keys, stable=True).indices.to(self.row_slots.device)
        groups = []
        for slot, rows in enumerate(torch.split(order, counts)):
            if slot < self.num_slots and rows.numel():
                groups.append((slot, rows))
        return tuple(groups)

    @cached_property
    def slot_one_hot(self) -> torch.Tensor:
        """[T, L] float32: 1 where a row uses a slot (rows with slot -1 are all zeros)."""
        keys = torch.where(self.row_slots < 0, self.num_slots, self.row_slots).to(torch.int64)
        one_hot = torch.zeros(self.num_rows, self.num_slots + 1, device=self.row_slots.device)
        one_hot.scatter_(1, keys[:, None], 1.0)
        return one_hot[:, : self.num_slots]

    @cached_property
    def kernel_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sorted_rows [T], slot_starts [L], slot_counts [L]) int32 on row_slots' device, for the Triton kernels."""
        from cuda_ext.kernels.lora import sort_rows_by_slot

        return sort_rows_by_slot(self.row_slots, self.num_slots)


def add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    row_slots: torch.Tensor | LoraRowGroups,
    scalings: torch.Tensor,
    *,
    use_triton: bool | None = None,
) -> None:
    """out [T, N] += scalings[s] * (x [T, K] @ lora_a[s]^T) @ lora_b[s]^T for each row with slot s >= 0, in place.

    lora_a [L, R, K], lora_b [L, N, R] (same dtype as x), scalings [L] float32. `use_triton` None picks by device
    (CUDA: Triton); True forces the kernels (also CPU tensors under TRITON_INTERPRET=1), False the torch path.
    """
    add_lora_sliced(out, x, [lora_a], [lora_b], row_slots, scalings, [0], use_triton=use_triton)


def add_lora_sliced(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a_slices: Sequence[torch.Tensor | None],
    lora_b_slices: Sequence[torch.Tensor | None],
    row_slots: torch.Tensor | LoraRowGroups,
    scalings: torch.Tensor,
    slice_offsets: Sequence[int],
    *,
    use_triton: bool | None = None,
) -> None:
    """LoRA of a merged projection: for each slice i, out[:, off_i : off_i + n_i] += scaling * (x @ A_i^T) @ B_i^T.

    lora_a_slices[i] [L, R_i, K] and lora_b_slices[i] [L, n_i, R_i], or both None (no slot adapts slice i);
    slice_offsets[i] is the first output column of slice i. scalings is [L] (one per slot, all slices) or
    [num_slices, L] (per slice and slot) float32. Rows with slot -1 are untouched.
    """
    num_slots = _check_shapes(out, x, lora_a_slices, lora_b_slices, slice_offsets)
    # No slice given (num_slots 0) or no row: nothing to add.
    if x.shape[0] == 0 or num_slots == 0:
        return
    if not isinstance(row_slots, LoraRowGroups):
        groups = LoraRowGroups(row_slots, num_slots)
    elif row_slots.num_slots != num_slots or row_slots.num_rows != x.shape[0]:
        raise ValueError(
            f"row groups are for {row_slots.num_rows} rows and {row_slots.num_slots} slots, "
            f"the call has {x.shape[0]} rows and {num_slots} slots"
        )
    else:
        groups = row_slots
    slice_scalings = _scalings_per_slice(scalings, len(lora_a_slices), num_slots)
    slices = [
        (lora_a, lora_b, slice_scalings[index], offset)
        for index, (lora_a, lora_b, offset) in enumerate(zip(lora_a_slices, lora_b_slices, slice_offsets, strict=True))
        if lora_a is not None
    ]
    if use_triton is None:
        use_triton = out.device.type == "cuda"
    if use_triton:
        _add_lora_triton(out, x, slices, groups)
    else:
        _add_lora_torch(out, x, slices, groups)


def _check_shapes(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a_slices: Sequence[torch.Tensor | None],
    lora_b_slices: Sequence[torch.Tensor | None],
    slice_offsets: Sequence[int],
) -> int:
    """The number of slots L, after checking the shapes agree (host-side metadata only)."""
    if out.dim() != 2 or x.dim() != 2 or out.shape[0] != x.shape[0]:
        raise ValueError(f"out [T, N] and x [T, K] must share T, got {tuple(out.shape)} and {tuple(x.shape)}")
    if out.dtype != x.dtype:
        raise ValueError(f"out and x must share a dtype, got {out.dtype} and {x.dtype}")
    if not len(lora_a_slices) == len(lora_b_slices) == len(slice_offsets):
        raise ValueError("lora_a_slices, lora_b_slices and slice_offsets must have one entry per slice")
    num_slots = None
    for lora_a, lora_b, offset in zip(lora_a_slices, lora_b_slices, slice_offsets, strict=True):
        if (lora_a is None) != (lora_b is None):
            raise ValueError("a slice's A and B must both be given or both be None")
        if lora_a is None:
            continue
        if lora_a.dim() != 3 or lora_b.dim() != 3:
            raise ValueError(f"A [L, R, K] and B [L, N, R] expected, got {tuple(lora_a.shape)}, {tuple(lora_b.shape)}")
        slots, rank, hidden = lora_a.shape
        if hidden != x.shape[1] or lora_b.shape[0] != slots or lora_b.shape[2] != rank:
            raise ValueError(
                f"A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)} do not fit x {tuple(x.shape)} or each other"
            )
        if num_slots is not None and slots != num_slots:
            raise ValueError(f"every slice must have the same number of slots, got {num_slots} and {slots}")
        num_slots = slots
        if offset < 0 or offset + lora_b.shape[1] > out.shape[1]:
            raise ValueError(f"slice of width {lora_b.shape[1]} at column {offset} overruns out {tuple(out.shape)}")
    return num_slots or 0


def _scalings_per_slice(scalings: torch.Tensor, num_slices: int, num_slots: int) -> list[torch.Tensor]:
    if scalings.shape == (num_slots,):
        return [scalings] * num_slices
    if scalings.shape == (num_slices, num_slots):
        return list(scalings.unbind(0))
    raise ValueError(f"scalings must be [{num_slots}] or [{num_slices}, {num_slots}], got {tuple(scalings.shape)}")


def _add_lora_torch(
    out: torch.Tensor,
    x: torch.Tensor,
    slices: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]],
    groups: LoraRowGroups,
) -> None:
    # torch_groups also checks the slot ids; no group means no adapted row.
    if not slices or not groups.torch_groups:
        return
    macs_per_row_slot = sum(lora_a.shape[1] * (x.shape[1] + lora_b.shape[1]) for lora_a, lora_b, _, _ in slices)
    # One slot holding every row (always so for a single row) needs neither a mask nor a gather.
    one_slot_for_all = groups.torch_groups[0][1] is None
    if not one_slot_for_all and x.shape[0] * groups.num_slots * macs_per_row_slot <= DENSE_MAX_MACS:
        _add_lora_masked(out, x, slices, groups)
    else:
        _add_lora_grouped(out, x, slices, groups)


def _add_lora_masked(
    out: torch.Tensor,
    x: torch.Tensor,
    slices: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]],
    groups: LoraRowGroups,
) -> None:
    """Every row against every slot, other slots' ranks zeroed: a fixed handful of ops for small batches."""
    num_slots = groups.num_slots
    x_fp32 = x.float()
    for lora_a, lora_b, scaling, offset in slices:
        rank, out_features = lora_a.shape[1], lora_b.shape[1]
        shrunk = x_fp32 @ lora_a.reshape(num_slots * rank, -1).float().T
        # Each row keeps its own slot's ranks, scaled; rows without an adapter become zeros.
        row_scale = groups.slot_one_hot * scaling.float()
        low_rank = (shrunk.view(-1, num_slots, rank) * row_scale[:, :, None]).view(-1, num_slots * rank)
        # [N, L * R]: column (slot, rank) of B, matching low_rank's columns.
        stacked_b = lora_b.permute(1, 0, 2).reshape(out_features, num_slots * rank).to(x.dtype)
        out[:, offset : offset + out_features].add_(low_rank.to(x.dtype) @ stacked_b.T)


def _add_lora_grouped(
    out: torch.Tensor,
    x: torch.Tensor,
    slices: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]],
    groups: LoraRowGroups,
) -> None:
    """Per slot present: gather its rows, one shrink for every slice, one expand per slice, index_add back."""
    ranks = [lora_a.shape[1] for lora_a, _, _, _ in slices]
    for slot, rows in groups.torch_groups:
        slot_x = x if rows is None else x.index_select(0, rows)
        # One shrink for every slice: their A rows stacked, all in fp32.
        slot_a = torch.cat([lora_a[slot] for lora_a, _, _, _ in slices]) if len(slices) > 1 else slices[0][0][slot]
        shrunk = slot_x.float() @ slot_a.float().T
        rank_start = 0
        for (_, lora_b, scaling, offset), rank in zip(slices, ranks, strict=True):
            low_rank = (shrunk[:, rank_start : rank_start + rank] * scaling[slot]).to(x.dtype)
            rank_start += rank
            slot_b = lora_b[slot]
            delta = low_rank @ slot_b.T.to(x.dtype)
            target = out[:, offset : offset + slot_b.shape[0]]
            if rows is None:
                target.add_(delta)
            else:
                target.index_add_(0, rows, delta)


def _add_lora_triton(
    out: torch.Tensor,
    x: torch.Tensor,
    slices: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]],
    groups: LoraRowGroups,
) -> None:
    # Imported on first use: CPU-only runs never import triton.
    from cuda_ext.kernels.lora import lora_expand, lora_shrink

    sorted_rows, slot_starts, slot_counts = groups.kernel_index
    for lora_a, lora_b, scaling, offset in slices:
        # The kernel reads slot s's scaling at scalings_ptr + s.
        scaling = scaling.to(torch.float32).contiguous()
        buffer = lora_shrink(x, lora_a, scaling, sorted_rows, slot_starts, slot_counts)
        target = out[:, offset : offset + lora_b.shape[1]]
        lora_expand(target, buffer, lora_b, sorted_rows, slot_starts, slot_counts)
