"""bf16 on CPU (issue 38): a bf16 model keeps a bf16 KV cache (twice the tokens per GiB of fp32), and the quality
gate: on held-out text, SmolLM2 in bf16 through our kernels picks what HF transformers' bf16 picks, within rounding.
The fp32 parity tests (tests/test_parity.py, tests/test_model_families.py) stay token-exact in fp32."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from configs.sampling_params import SamplingParams
from cuda_ext.attention.cpu_backend import CpuAttentionBackend
from tests.helpers import HFReference, assert_no_leaked_blocks
from tests.test_model_families import BF16_UNIT_ROUNDOFF, model_of

GIB = 2**30
# The tiny model's KV per 16-token block in fp32: K and V x 2 KV heads x head_dim 16 x 4 bytes x 2 layers x 16.
TINY_FP32_BLOCK_BYTES = 2 * 2 * 16 * 4 * 2 * 16


def test_a_bf16_model_keeps_a_bf16_kv_cache_with_twice_the_blocks(
    tiny_model_dir: Path, make_llm: Any, caplog: pytest.LogCaptureFixture
) -> None:
    budget_gib = 100 * TINY_FP32_BLOCK_BYTES / GIB  # exactly 100 fp32 blocks
    blocks, outputs = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="executor.engine_core"):
            llm = make_llm(
                tiny_model_dir,
                dtype=str(dtype).removeprefix("torch."),
                distributed_executor="uniproc",
                num_kv_blocks=None,
                kv_cache_memory_gib=budget_gib,
                max_model_len=256,
            )
        (line,) = [record.getMessage() for record in caplog.records if "KV cache size" in record.getMessage()]
        blocks[dtype] = int(re.match(r"KV cache size: (\d+) blocks", line).group(1))
        runner = llm.engine.core.executor.worker.runner
        assert {cache.dtype for cache in runner.kv_caches} == {dtype}
        assert sum(cache.numel() * cache.element_size() for cache in runner.kv_caches) == 100 * TINY_FP32_BLOCK_BYTES
        output = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        outputs[dtype] = output[0].outputs[0].token_ids
        assert_no_leaked_blocks(llm)
    assert blocks == {torch.float32: 100, torch.bfloat16: 200}
    assert all(len(tokens) == 8 for tokens in outputs.values())


# Held-out text (no prompt of tests/test_parity.py): prose, instructions, a letter and code.
HELD_OUT_PROMPTS = [
    "The history of the printing press begins in",
    "Photosynthesis is the process by which plants",
    "To bake a simple loaf of bread, you will need",
    "The main difference between a virus and a bacterium is",
    "In 1969, the Apollo 11 mission",
    "A good way to learn a new language is to",
    "The water cycle describes how water",
    "def is_prime(n):\n    ",
    "Dear hiring manager, I am writing to apply for",
    "The three branches of the United States government are",
    "Mount Everest is the highest mountain on Earth, located in",
    "Here is a recipe for a quick tomato soup:",
]
GATE_NEW_TOKENS = 32
# A flip is allowed where HF's own top-1 leads our pick by at most this many bf16 units of the logit scale.
GATE_BOUND_UNITS = 16
# Prompts whose whole greedy continuation must be HF bf16's: a majority.
GATE_MIN_EQUAL_PROMPTS = 7


# Decode steps through the C++ decoder stack (bf16 on AMX tiles or bf16 panels, where the CPU has them) and layer by
# layer.
@pytest.mark.parametrize("decode_path", ["stack", "layers"])
def test_bf16_greedy_picks_are_hf_bf16_top_1_within_rounding(
    smollm2_dir: Path, hf_reference: HFReference, decode_path: str
) -> None:
    """The bf16 quality gate. SmolLM2 in bf16 through our CPU kernels (bf16 KV cache, attention, norms, rotary,
    SiLU), greedy and batched on held-out text; HF transformers in bf16 teacher-forced on our tokens.

    At every position our pick t is HF bf16's top-1 h, or HF's lead H[h] - H[t] is within the bound B = 16 units,
    a unit being 2^-8 x the position's logit scale max(1, max_j |H_j|). Derivation: we pick t over h only where our
    logits O have O[t] >= O[h], so H[h] - H[t] <= (O[t] - H[t]) - (O[h] - H[h]) <= |D[t]| + |D[h]|, D = O - H. Each
    D is the difference of two bf16 computations of one logit: the logit's own rounding to bf16 (8 significant
    bits: up to 2^-8 |L|, a unit, per side) plus what the final hidden state brings, a 576-term sum of rounded
    products whose inputs went through 30 layers of bf16 activations rounded at other points and summed in other
    orders (ours accumulates in fp32 and rounds once per kernel; HF rounds attention scores and probabilities to
    bf16). tests/test_model_families.py allows each bf16 implementation 8 units of its own (BF16_ERROR_FLOOR), so
    |D| <= 8 and B = 2 x 8. Measured when written: 4 flips in 384 positions, HF's lead at most 1.9 units; run one
    request at a time, |D| was at most 7.3 units on the two tokens.

    And our greedy continuation is HF bf16's on most prompts, at least 7 of 12: at every position of the sequence our
    pick is one of HF's maxima (bf16 logits near 32 are 2^-3 apart, so exact ties are common and HF's argmax takes
    the first). Equality is judged on the one teacher-forced forward: HF's own `generate` is not consistent with
    its forward in bf16 (incremental steps round differently). Measured when written: 9 of 12 (11 with our bf16
    prefill kernel in place of SDPA)."""
    from executor import LLM

    llm = LLM(model=str(smollm2_dir), dtype="bfloat16", show_progress=False, num_kv_blocks=256, max_num_seqs=16)
    model = model_of(llm)
    assert isinstance(model.attention_backend, CpuAttentionBackend)  # our kernels, not torch's
    if decode_path == "layers":
        model.decode_stack = None
    elif model.decode_stack is None:
        pytest.skip("the bf16 decoder stack needs AMX tiles or AVX512-BF16: this CPU (or build) has neither")
    prompts = [llm.tokenizer.encode(text) for text in HELD_OUT_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=GATE_NEW_TOKENS, ignore_eos=True)
    completions = [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]
    assert_no_leaked_blocks(llm)
    flips, equal_prompts = [], 0
    for index, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        hf_logits = hf_reference.logits_after(smollm2_dir, prompt, completion, dtype=torch.bfloat16)
        unit = BF16_UNIT_ROUNDOFF * hf_logits.abs().amax(dim=-1).clamp(min=1.0)
        picked = hf_logits.gather(1, torch.tensor(completion)[:, None])[:, 0]
        lead_units = (hf_logits.amax(dim=-1) - picked) / unit
        flips += [(index, position, lead) for position, lead in enumerate(lead_units.tolist()) if lead > 0]
        equal_prompts += bool((lead_units == 0).all())
    summary = f"{equal_prompts} of {len(prompts)} prompts equal HF bf16's; flips (prompt, position, HF lead): {flips}"
    logging.getLogger(__name__).info("bf16 gate: %s", summary)
    assert all(lead <= GATE_BOUND_UNITS for _, _, lead in flips), summary
    assert equal_prompts >= GATE_MIN_EQUAL_PROMPTS, summary
