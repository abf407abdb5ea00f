"""ModelRunner: holds the model shard and its KV cache, turns a StepPlan into tensors, runs, samples."""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from configs.sampling_params import SamplingParams
from cuda_ext.cpu_ops import load_cpu_ops, select_cpu_kernels
from cuda_ext.cuda_graphs import PADDING_SEQ_LEN, PADDING_SLOT, CudaGraphRunner, bucket_for, decode_buckets
from model_executor.cpu_decode_stack import runs_decode_stack
from model_executor.input_batch import InputBatch, RunnerRequestState, build_input_batch
from model_executor.layers.greedy_head import AmxGreedyHead
from model_executor.layers.greedy_screen import GreedyScreen
from model_executor.lora import LoRASlots
from model_executor.model_info import ModelInfo
from model_executor.model_loader import load_model
from model_executor.parallel_state import ParallelContext
from model_executor.sampler import Sampler, SamplerOutput, SamplingRow, TokenLogprobs
from model_executor.step_plan import CachedRequestData, NewRequestData, StepPlan, StepResult
from model_executor.structured_output import GrammarStore, RequestGrammar, allocate_bitmask

logger = logging.getLogger(__name__)


class ModelRunner:
    """One rank's model shard, KV cache and request states. Call `allocate_kv_cache` before `execute`."""

    def __init__(
        self,
        model_info: ModelInfo,
        block_size: int,
        parallel: ParallelContext | None = None,
        attention_backend: str = "auto",
        seed: int = 0,
        show_progress: bool = True,
        cuda_graphs: str = "auto",
        greedy_screening: str = "auto",
        cuda_graph_max_batch_size: int = 256,
        cpu_kernels: str = "auto",
        lora_capacity: tuple[int, int] | None = None,
    ):
        """`lora_capacity`: (max_loras, max_lora_rank) to size the adapter slots now, before the KV cache is sized;
        None: when the first plan that loads an adapter comes (its `lora_capacity`)."""
        self.model_info = model_info
        self.block_size = block_size
        self.device = torch.device(model_info.device)
        self.parallel = parallel or ParallelContext()
        torch.manual_seed(seed)
        # The config's runtime.cpu_kernels, applied once for this process before any layer picks its kernel.
        use_cpu_kernels = self.device.type == "cpu" and select_cpu_kernels(cpu_kernels) is not None
        self.model = load_model(model_info, self.parallel, attention_backend, use_cpu_kernels, show_progress)
        self.greedy_screen = self._build_greedy_screen(greedy_screening)
        self.uses_decode_stack = runs_decode_stack(self.model)
        self.attention_backend = self.model.attention_backend
        self.kv_caches: list[torch.Tensor] = []
        self.num_kv_blocks = 0
        # The last stage's first tensor-parallel rank samples; the others only compute.
        self.is_driver = self.parallel.is_last_stage and self.parallel.tp_rank == 0
        # The only rank: nobody else needs the sampled tokens, so plans don't carry them back (see Scheduler).
        self.keeps_sampled_tokens = self.parallel.tp_size * self.parallel.pp_size == 1
        self.sampler = Sampler(model_info.eos_token_ids, load_cpu_ops() if use_cpu_kernels else None)
        # Structured outputs: the sampling rank alone constrains (the others learn its tokens from the plans).
        self.grammar_store = GrammarStore() if self.is_driver else None
        self.grammars: dict[str, RequestGrammar] = {}
        self.requests: dict[str, RunnerRequestState] = {}
        # Seeded generators outlive preemption so a resumed request continues the same random stream.
        self.generators: dict[str, torch.Generator] = {}
        self.cuda_graphs = cuda_graphs
        self.cuda_graph_max_batch_size = cuda_graph_max_batch_size
        # Set by allocate_kv_cache when decode steps go through bucketed (and, on CUDA, captured) graphs.
        self.decode_graphs: CudaGraphRunner | None = None
        self.max_blocks_per_seq = 0
        # Dummy prompts `warm_up` ran before serving (0: it did not run).
        self.num_warm_up_prompts = 0
        # LoRA adapter slots over this shard's linear layers (None until LoRA is used or sized up front).
        self.lora: LoRASlots | None = None
        if lora_capacity is not None:
            self._enable_lora(lora_capacity)

    def _enable_lora(self, capacity: tuple[int, int]) -> None:
        max_loras, max_rank = capacity
        if self.lora is not None:
            if (self.lora.max_loras, self.lora.max_rank) != (max_loras, max_rank):
                sized = (self.lora.max_loras, self.lora.max_rank)
                raise ValueError(f"LoRA slots are sized (max_loras, max_lora_rank) {sized}, not {capacity}")
            return
        self.lora = LoRASlots(self.model, max_loras, max_rank)
        logger.info("LoRA: %d adapter slots of rank up to %d on %d layers", max_loras, max_rank, len(self.lora.layers))

    def _build_greedy_screen(self, mode: str) -> GreedyScreen | AmxGreedyHead | None:
        """What takes plain greedy rows past the sampler, where its argmax is the sampler's: one rank holds the whole
        head (vocab-parallel heads would need a cross-rank argmax), and the logits are the head's raw output. Unless
        `mode` is "off": a bf16 head on our AMX kernel takes the fused argmax; an fp32 head, the bf16 screen."""
        lm_head = getattr(self.model, "lm_head", None) if self.parallel.tp_size == 1 else None
        if lm_head is None:
            return None
        if getattr(self.model, "final_logit_softcapping", None) is not None:
            # cap * tanh(x / cap) saturates in fp32: raw logits that differ can tie after it, and the sampler takes
            # the first of the tied, which the screen (an argmax of raw logits) need not pick.
            if mode != "off":
                logger.info("greedy rows: the plain LM head (final logits are soft-capped, so no screen applies)")
            return None
        fused = AmxGreedyHead.build(lm_head) if mode != "off" else None
        if fused is not None:
            logger.info("greedy rows: the argmax of the bf16 LM head's logits as its AMX tiles produce them")
            return fused
        return GreedyScreen.build(lm_head.weight, lm_head.linear_method.ops, mode)

    def kv_cache_bytes_per_block(self) -> int:
        backend = self.attention_backend
        element_size = torch.tensor([], dtype=self.model_info.dtype).element_size()
        per_token = 2 * backend.num_kv_heads * backend.head_dim * element_size * self.model.num_local_layers
        return per_token * self.block_size

    def num_kv_blocks_for_budget(self, memory_bytes: int) -> int:
        return max(1, memory_bytes // self.kv_cache_bytes_per_block())

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._allocate_kv_caches(num_blocks)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB on this rank)",
            num_blocks,
            self.block_size,
            num_blocks * self.block_size,
            num_blocks * self.kv_cache_bytes_per_block() / 2**30,
        )
        self._prepare_decode_graphs()

    def warm_up(self, max_num_batched_tokens: int) -> None:
        """A prefill chunk of the step budget, in prompts of 64 tokens, then two decode steps of those prompts, on
        dummy requests before serving, so the first real burst does not pay for the allocator growing its heap,
        oneDNN creating its primitives and cold code faulting in. The dummy KV lands in blocks no request holds yet
        (every block is written before it is read)."""
        prompt_len = max(1, min(64, self.model_info.max_model_len - 2))
        blocks_per_request = -(-(prompt_len + 2) // self.block_size)
        num_requests = min(-(-max_num_batched_tokens // prompt_len), self.num_kv_blocks // blocks_per_request)
        if num_requests < 1:
            return
        params = SamplingParams(temperature=0.0, max_tokens=2)
        request_ids = [f"warm-up-{index}" for index in range(num_requests)]
        token_id = min(100, self.model_info.hf_config.vocab_size - 1)
        new_requests = [
            NewRequestData(
                request_id,
                [token_id] * prompt_len,
                [],
                params,
                list(range(index * blocks_per_request, (index + 1) * blocks_per_request)),
                0,
            )
            for index, request_id in enumerate(request_ids)
        ]
        started = time.perf_counter()
        self.execute(StepPlan(new_requests, num_scheduled_tokens=dict.fromkeys(request_ids, prompt_len)))
        for step in range(2):
            cached = [CachedRequestData(request_id, [], prompt_len + step) for request_id in request_ids]
            self.execute(StepPlan(cached_requests=cached, num_scheduled_tokens=dict.fromkeys(request_ids, 1)))
        self.execute(StepPlan(finished_request_ids=request_ids))
        self.num_warm_up_prompts = num_requests
        if self.greedy_screen is not None:
            self.greedy_screen.num_screened_rows = self.greedy_screen.num_fallback_rows = 0
        logger.info(
            "warmed up: %d prompts of %d tokens and two decode steps in %.2f s",
            num_requests,
            prompt_len,
            time.perf_counter() - started,
        )

    def profile_run(self, max_num_batched_tokens: int, max_num_seqs: int, max_logprobs: int) -> int:
        """vLLM's profile run, on CUDA before the KV cache is sized: the largest step the scheduler can plan
        (max_num_batched_tokens prompt tokens over up to max_num_seqs sequences, each sampling with every sampler
        stage on) over a scratch cache just big enough for it. Returns the step's peak torch memory above what was
        allocated before it (the scratch cache excluded) on CUDA; elsewhere it runs the step and returns 0."""
        num_seqs = max(1, min(max_num_seqs, max_num_batched_tokens))
        # The step's tokens split evenly; a step never runs more of a sequence than its context holds.
        share, remainder = divmod(max_num_batched_tokens, num_seqs)
        seq_lens = [min(share + (index < remainder), self.model_info.max_model_len) for index in range(num_seqs)]
        blocks_per_seq = -(-max(seq_lens) // self.block_size)
        params = SamplingParams(
            temperature=1.0,
            top_p=0.9,
            top_k=50,
            min_p=0.01,
            repetition_penalty=1.1,
            frequency_penalty=0.1,
            presence_penalty=0.1,
            logprobs=min(max_logprobs, self.model_info.vocab_size) or None,
            max_tokens=1,
        )
        token_id = min(100, self.model_info.hf_config.vocab_size - 1)
        request_ids = [f"profile-{index}" for index in range(num_seqs)]
        starts = range(0, num_seqs * blocks_per_seq, blocks_per_seq)
        block_ids = [list(range(start, start + blocks_per_seq)) for start in starts]
        new_requests = [
            NewRequestData(request_id, [token_id] * seq_len, [], params, blocks, 0)
            for request_id, seq_len, blocks in zip(request_ids, seq_lens, block_ids)
        ]
        self._allocate_kv_caches(num_seqs * blocks_per_seq)
        on_cuda = self.device.type == "cuda"
        peak = 0
        try:
            if on_cuda:
                torch.cuda.synchronize(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
                allocated_before = torch.cuda.memory_allocated(self.device)
            self.execute(StepPlan(new_requests, num_scheduled_tokens=dict(zip(request_ids, seq_lens))))
            if on_cuda:
                torch.cuda.synchronize(self.device)
                peak = torch.cuda.max_memory_allocated(self.device) - allocated_before
        finally:
            self.execute(StepPlan(finished_request_ids=request_ids))
            self.kv_caches, self.num_kv_blocks = [], 0
        return peak

    def _allocate_kv_caches(self, num_blocks: int) -> None:
        self.num_kv_blocks = num_blocks
        self.kv_caches = [
            self.attention_backend.allocate_kv_cache(num_blocks, self.block_size, self.model_info.dtype, self.device)
            for _ in range(self.model.num_local_layers)
        ]

    def _prepare_decode_graphs(self) -> None:
        """Decode steps of up to cuda_graph_max_batch_size requests run padded to a bucket; on CUDA, as graphs."""
        mode = self.cuda_graphs
        # PP stages exchange hidden states between steps outside any graph; keep them eager.
        graphable = self.device.type == "cuda" and self.parallel.pp_size == 1
        if mode == "auto" and graphable and not self.attention_backend.supports_cuda_graphs:
            logger.info("the %s attention backend cannot be captured; decode runs eagerly", self.attention_backend.name)
            graphable = False
        if mode == "off" or (mode == "auto" and not graphable):
            return
        self.max_blocks_per_seq = min(self.num_kv_blocks, -(-self.model_info.max_model_len // self.block_size))
        buckets = decode_buckets(self.cuda_graph_max_batch_size)
        self.decode_graphs = CudaGraphRunner(self._decode_forward, self._static_decode_inputs, buckets)
        if mode == "auto":
            logger.info("capturing CUDA graphs for decode batches %s", buckets)
            with torch.inference_mode():
                self.decode_graphs.capture()

    def _static_decode_inputs(self, bucket: int) -> dict[str, torch.Tensor]:
        """A bucket's graph inputs, filled with padding rows so warm-up and capture write no KV slot."""
        device = self.device
        return {
            "input_ids": torch.zeros(bucket, dtype=torch.int64, device=device),
            "positions": torch.zeros(bucket, dtype=torch.int64, device=device),
            "slot_mapping": torch.full((bucket,), PADDING_SLOT, dtype=torch.int32, device=device),
            "seq_lens": torch.full((bucket,), PADDING_SEQ_LEN, dtype=torch.int32, device=device),
            "block_tables": torch.zeros(bucket, self.max_blocks_per_seq, dtype=torch.int32, device=device),
        }

    def _decode_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> torch.Tensor:
        """The graphed part of a decode step: attention metadata from device tensors, then the model."""
        metadata = self.attention_backend.build_decode_metadata(seq_lens, block_tables, slot_mapping, self.block_size)
        return self.model(input_ids, positions, self.kv_caches, metadata, None)

    def _add_request(self, new: NewRequestData) -> None:
        generator = None
        if new.sampling_params.seed is not None:
            generator = self.generators.get(new.request_id)
            if generator is None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(new.sampling_params.seed)
                self.generators[new.request_id] = generator
        if new.grammar_key is not None and self.grammar_store is not None:
            # A resumed (preempted) request's matcher replays what it generated.
            self.grammars[new.request_id] = RequestGrammar(
                self.grammar_store.get(new.grammar_key), new.output_token_ids
            )
        token_ids = new.prompt_token_ids + new.output_token_ids
        num_prompt = len(new.prompt_token_ids)
        row = SamplingRow(new.sampling_params, token_ids[:num_prompt], token_ids[num_prompt:], generator)
        self.requests[new.request_id] = RunnerRequestState(
            new.request_id, token_ids, num_prompt, row, list(new.block_ids), new.num_computed_tokens, new.lora_slot
        )

    def _update_states(self, plan: StepPlan) -> None:
        if plan.lora_loads:
            self._enable_lora(plan.lora_capacity)
            for load in plan.lora_loads:
                self.lora.load(load.slot, load.name, load.path, load.scaling)
        store = self.grammar_store
        if store is not None:
            # Loaded while this step's forward runs, before the first request that needs one samples.
            if plan.grammar_tokenizer_info is not None:
                store.load_tokenizer_info(plan.grammar_tokenizer_info)
            for key, payload in plan.grammars.items():
                store.add(key, payload)
            store.evict(plan.evicted_grammars)
        for request_id in plan.finished_request_ids:
            self.requests.pop(request_id, None)
            self.generators.pop(request_id, None)
            self.grammars.pop(request_id, None)
        for request_id in plan.preempted_request_ids:
            self.requests.pop(request_id, None)
            self.grammars.pop(request_id, None)
        for new in plan.new_requests:
            self._add_request(new)
        for cached in plan.cached_requests:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.new_token_ids:
                state.token_ids.extend(cached.new_token_ids)
                state.sampling_row.output_token_ids.extend(cached.new_token_ids)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """One step: the plan's rows as inputs, this rank's forward, and on the sampling rank the sampled tokens."""
        self._update_states(plan)
        if not plan.num_scheduled_tokens:
            return StepResult()
        batch = build_input_batch(plan, self.requests, self.block_size)
        try:
            hidden_states = self._run_model(batch)
        finally:
            if batch.uses_lora:
                self.lora.batch.clear()  # the next step's base-only rows skip every adapter
        if hidden_states is None or not batch.sample_rows:
            return StepResult()
        return self._sample(batch, hidden_states)

    def _run_model(self, batch: InputBatch) -> torch.Tensor | None:
        """The sampled rows' final hidden states on the last pipeline stage; earlier stages send their output on to
        the next and return None."""
        bucket = self._decode_bucket(batch)
        if bucket is not None:
            decode_inputs = batch.padded_decode_inputs(bucket, self.block_size, self.device)
            return self.decode_graphs.run(decode_inputs, bucket)[: batch.num_decodes]
        attn_metadata = self.attention_backend.build_metadata(batch.attention_batch(), self.block_size, self.device)
        input_ids = torch.tensor(batch.input_ids, dtype=torch.int64, device=self.device)
        positions = torch.tensor(batch.positions, dtype=torch.int64, device=self.device)
        intermediate = None
        if not self.parallel.is_first_stage:
            intermediate = self._receive_intermediate(batch.num_tokens)
        # Rows that sample nothing (a prompt's earlier tokens) skip the last layer's projection and MLP.
        output_rows = (
            torch.tensor(batch.sample_rows, dtype=torch.int64, device=self.device)
            if len(batch.sample_rows) < batch.num_tokens
            else None
        )
        if batch.uses_lora:
            self.lora.batch.set_step(batch.lora_slots, output_rows if self.parallel.is_last_stage else None)
        hidden_states = self.model(
            input_ids, positions, self.kv_caches, attn_metadata, intermediate, output_rows=output_rows
        )
        if not self.parallel.is_last_stage:
            self._send_intermediate(hidden_states)
            return None
        return hidden_states

    def _decode_bucket(self, batch: InputBatch) -> int | None:
        """The padded size at which a decode-only step runs through `decode_graphs`, or None to run it as it is."""
        if self.decode_graphs is None or not batch.is_decode_only:
            return None
        if batch.uses_lora:
            return None  # graphs hold no adapter rows: a step with any runs eagerly
        # The C++ decoder stack splits a padded step's rows between threads unless told they share sequences.
        if batch.has_drafts and self.uses_decode_stack:
            return None
        return bucket_for(batch.num_decodes, self.decode_graphs.buckets)

    def _sample(self, batch: InputBatch, hidden_states: torch.Tensor) -> StepResult:
        """Plain greedy rows through the screened head where there is one; the rest through the LM head and the
        sampler (every tensor-parallel rank computes logits; only the driver samples)."""
        sampling_rows = batch.sampling_rows()
        bitmask = self._grammar_bitmask(batch, len(sampling_rows)) if self.grammars else None
        greedy_index = (
            [index for index, row in enumerate(sampling_rows) if self.sampler.is_plain_greedy(row)]
            if self.greedy_screen is not None
            else []
        )
        if greedy_index:
            sampled = self._sample_with_screen(hidden_states, sampling_rows, greedy_index, bitmask)
        else:
            # In the head's dtype: the sampler widens what it processes, and its one-kernel draw reads bf16 as it is.
            logits = self.model.compute_logits(hidden_states)
            if not self.is_driver:
                return StepResult()
            sampled = self.sampler(logits, sampling_rows, bitmask)
        return self._step_result(batch.sampling_states, batch.step_drafts, sampled)

    def _grammar_bitmask(self, batch: InputBatch, num_rows: int) -> torch.Tensor | None:
        """Allowed tokens of every sampled row (all allowed for unconstrained rows); None if no row is constrained."""
        bitmask = None
        row = 0
        for state, drafts in zip(batch.sampling_states, batch.step_drafts, strict=True):
            grammar = self.grammars.get(state.request_id)
            if grammar is not None:
                if bitmask is None:
                    bitmask = allocate_bitmask(num_rows, self.model_info.vocab_size)
                grammar.fill_bitmask(bitmask, row, drafts)
            row += len(drafts) + 1
        return bitmask

    def _step_result(
        self, states: list[RunnerRequestState], step_drafts: list[list[int]], sampled: SamplerOutput
    ) -> StepResult:
        """Each request's tokens: its sampled token, or its drafts up to the first its rows disagree with, and the
        token sampled after them (what those rows sampled is what one-token steps would have: a draft is a token
        the rows agree with)."""
        result = StepResult([state.request_id for state in states])
        has_logprobs = any(entry is not None for entry in sampled.logprobs)
        row = 0
        for state, drafts in zip(states, step_drafts, strict=True):
            rows_sampled = sampled.sampled_token_ids[row : row + len(drafts) + 1]
            num_accepted = 0
            while num_accepted < len(drafts) and rows_sampled[num_accepted] == drafts[num_accepted]:
                num_accepted += 1
            token_ids = rows_sampled[: num_accepted + 1]
            result.sampled_token_ids.append(token_ids)
            grammar = self.grammars.get(state.request_id)
            if grammar is not None:
                grammar.accept(token_ids)
            if has_logprobs:
                result.logprobs.append(sampled.logprobs[row : row + num_accepted + 1])
            row += len(drafts) + 1
            # The rejected drafts' slots are written again by the tokens that really come there.
            state.num_computed_tokens -= len(drafts) - num_accepted
            if self.keeps_sampled_tokens:
                # The next step may be planned before the scheduler has seen these tokens (async scheduling).
                state.token_ids.extend(token_ids)
                state.sampling_row.output_token_ids.extend(token_ids)
        return result

    def _sample_with_screen(
        self, hidden: torch.Tensor, rows: list[SamplingRow], greedy_index: list[int], bitmask: torch.Tensor | None
    ) -> SamplerOutput:
        """The plain greedy rows (`greedy_index`) through the screened head; the others (sampled, logprobs,
        penalties) through the fp32 head and the sampler, as if they were the whole batch (every sampler stage works
        row by row)."""
        greedy = set(greedy_index)
        other_index = [index for index in range(len(rows)) if index not in greedy]
        token_ids = [0] * len(rows)
        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        if other_index:
            hidden_greedy = hidden.index_select(0, torch.tensor(greedy_index, dtype=torch.int64))
            hidden_other = hidden.index_select(0, torch.tensor(other_index, dtype=torch.int64))
            logits = self.model.compute_logits(hidden_other)
            other_bitmask = None if bitmask is None else bitmask[other_index]
            others = self.sampler(logits, [rows[index] for index in other_index], other_bitmask)
            for index, token_id, entry in zip(other_index, others.sampled_token_ids, others.logprobs, strict=True):
                token_ids[index], logprobs[index] = token_id, entry
        else:
            hidden_greedy = hidden
        constrained = [j for j, index in enumerate(greedy_index) if rows[index].params.structured_outputs is not None]
        greedy_bitmask = bitmask[greedy_index] if constrained else None
        screened = self.greedy_screen.token_ids(hidden_greedy, greedy_bitmask, constrained)
        for index, token_id in zip(greedy_index, screened.tolist(), strict=True):
            token_ids[index] = token_id
        return SamplerOutput(token_ids, logprobs)

    def _stage_peer(self, stage_offset: int) -> int:
        """Global rank of the same tensor-parallel rank in a neighbouring pipeline stage."""
        return (self.parallel.pp_rank + stage_offset) * self.parallel.tp_size + self.parallel.tp_rank

    def _send_intermediate(self, tensors: tuple[torch.Tensor, torch.Tensor]) -> None:
        for tensor in tensors:
            dist.send(tensor.contiguous(), dst=self._stage_peer(+1))

    def _receive_intermediate(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (num_tokens, self.model_info.hf_config.hidden_size)
        received = []
        for _ in range(2):
            tensor = torch.empty(shape, dtype=self.model_info.dtype, device=self.device)
            dist.recv(tensor, src=self._stage_peer(-1))
            received.append(tensor)
        return received[0], received[1]
