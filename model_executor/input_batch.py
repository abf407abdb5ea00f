"""One step's token rows, built from the runner's request states and the scheduler's plan: plain lists until the
runner turns them into tensors (as they are, or padded to a decode bucket)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cuda_ext.attention import AttentionBatch
from cuda_ext.cuda_graphs import DecodeInputs, pad_decode_inputs
from model_executor.sampler import SamplingRow
from model_executor.step_plan import StepPlan


@dataclass(slots=True)
class RunnerRequestState:
    """The runner's copy of a request: tokens it has seen, where its KV lives, how it samples."""

    request_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    sampling_row: SamplingRow
    block_ids: list[int]
    num_computed_tokens: int
    lora_slot: int = -1
    """The adapter slot its rows use; -1: the base model."""


@dataclass(slots=True)
class InputBatch:
    """A step's rows, decodes first. Per row: token id, position and cache slot; per attention request: query
    length, key count and block table (a request with drafts is one decode request per row)."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    num_decodes: int
    sample_rows: list[int]
    """Rows whose output is sampled: each sampling request's last known token and its drafts."""
    sampling_states: list[RunnerRequestState]
    """The requests that sample this step, in row order."""
    step_drafts: list[list[int]]
    """Per sampling state: the drafts its rows verify."""
    lora_slots: list[int] | None = None
    """Per row, the adapter slot (-1: the base model); None when no row of the step uses an adapter."""

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def has_drafts(self) -> bool:
        return any(self.step_drafts)

    @property
    def uses_lora(self) -> bool:
        return self.lora_slots is not None

    @property
    def is_decode_only(self) -> bool:
        return self.num_decodes == len(self.query_lens)

    def attention_batch(self) -> AttentionBatch:
        return AttentionBatch(
            self.query_lens, self.seq_lens, self.block_tables, self.slot_mapping, self.num_decodes, self.has_drafts
        )

    def sampling_rows(self) -> list[SamplingRow]:
        """One per sampled row: a request's row repeats for each of its drafts."""
        return [
            state.sampling_row
            for state, drafts in zip(self.sampling_states, self.step_drafts)
            for _ in range(len(drafts) + 1)
        ]

    def padded_decode_inputs(self, bucket: int, block_size: int, device: torch.device) -> dict[str, torch.Tensor]:
        """A decode-only step's inputs padded to its bucket, block tables cut to the blocks the kernels read."""
        width = -(-max(self.seq_lens) // block_size)
        table_rows = []
        for blocks, seq_len in zip(self.block_tables, self.seq_lens, strict=True):
            needed = -(-seq_len // block_size)
            table_rows.append(blocks[:needed] + [0] * (width - needed))
        inputs = DecodeInputs(
            input_ids=torch.tensor(self.input_ids, dtype=torch.int64),
            positions=torch.tensor(self.positions, dtype=torch.int64),
            slot_mapping=torch.tensor(self.slot_mapping, dtype=torch.int32),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(table_rows, dtype=torch.int32),
        )
        padded = pad_decode_inputs(inputs, bucket)
        return {
            name: getattr(padded, name).to(device, non_blocking=True)
            for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables")
        }


def build_input_batch(plan: StepPlan, requests: dict[str, RunnerRequestState], block_size: int) -> InputBatch:
    """The rows of `plan`'s scheduled tokens. Moves each request's `num_computed_tokens` past its rows, drafts
    included (the runner takes back the rejected drafts once it has sampled)."""
    spec_token_ids = plan.spec_token_ids
    # Decodes (one new token) first: the attention backend handles them as one padded group. A request's token
    # and its drafts are decode rows too, one per token, each attending up to itself.
    ordered = sorted(plan.num_scheduled_tokens.items(), key=lambda item: item[1] != 1 and item[0] not in spec_token_ids)
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    block_tables: list[list[int]] = []
    sample_rows: list[int] = []
    sampling_states: list[RunnerRequestState] = []
    step_drafts: list[list[int]] = []
    lora_slots: list[int] = []
    uses_lora = False
    for request_id, num_tokens in ordered:
        state = requests[request_id]
        start = state.num_computed_tokens
        end = start + num_tokens
        drafts = spec_token_ids.get(request_id, [])
        lora_slots.extend([state.lora_slot] * num_tokens)  # drafts are counted in num_tokens
        uses_lora |= state.lora_slot >= 0
        input_ids.extend(state.token_ids[start:end])
        if drafts:
            input_ids.extend(drafts)
        positions.extend(range(start, end))
        block_ids = state.block_ids
        slot_mapping.extend(block_ids[pos // block_size] * block_size + pos % block_size for pos in range(start, end))
        if drafts:
            query_lens.extend([1] * num_tokens)
            seq_lens.extend(range(start + 1, end + 1))
            block_tables.extend([block_ids] * num_tokens)
        else:
            query_lens.append(num_tokens)
            seq_lens.append(end)
            block_tables.append(block_ids)
        # Every row from its last known token on samples.
        if end == len(state.token_ids) + len(drafts):
            sample_rows.extend(range(len(input_ids) - 1 - len(drafts), len(input_ids)))
            sampling_states.append(state)
            step_drafts.append(drafts)
        state.num_computed_tokens = end
    num_decodes = sum(1 for n in query_lens if n == 1)
    return InputBatch(
        input_ids,
        positions,
        slot_mapping,
        query_lens,
        seq_lens,
        block_tables,
        num_decodes,
        sample_rows,
        sampling_states,
        step_drafts,
        lora_slots if uses_lora else None,
    )
