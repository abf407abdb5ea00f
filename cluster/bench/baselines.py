"""Reference throughputs to put our numbers in context, measured on the same machine.

* `hf_generate_throughput`: HF transformers `generate` (greedy, on CPU, left padding, static batches) over given
  prompts, exactly `output_len` new tokens per prompt, at several batch sizes.
* `matmul_roofline`: only the linear layers of our own model (every layer's qkv/o/gate_up/down projections plus the
  LM head, with the weights `ModelRunner` loads) on random activations, as one decode step of `batch_size` tokens.
  No attention, norms, sampling, scheduling or HTTP: an upper bound for our decode throughput at that batch.
* `workload_ceiling`: the roofline summed over a whole burst of requests (their prefill, then their decode steps).

Each takes the engine's `dtype` names ("auto", "float32", "bfloat16", "float16"), so a benchmark measures its
baselines in the precision its server serves; every result names the precision it ran in (`dtype`). "auto" resolves
as the engine resolves it on the device the baseline runs on (HF generate: always the CPU).

Plain functions of a model directory, shared by `pagedserve bench --baselines`, `pagedserve bench-offline` and
`benchmarks/run_matrix.py`.
"""

from __future__ import annotations

import functools
import logging
import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


def hf_generate_throughput(
    model_dir: str | Path,
    prompts: Sequence[str],
    output_len: int,
    batch_sizes: Sequence[int],
    *,
    chat: bool = False,
    dtype: str = "float32",
    show_progress: bool = True,
) -> list[dict[str, Any]]:
    """One run per batch size over all `prompts`, in order, in static batches; returns one dict per run.

    Greedy, `max_new_tokens = min_new_tokens = output_len` (EOS cannot end a row early), left padding, on CPU in
    `dtype` ("auto" as the engine picks on this CPU, `cpu_dtype_name`), after one small untimed warm-up generate.
    The prompts are tokenized as our server does: completion prompts with the tokenizer's special tokens, chat
    prompts (`chat=True`: each prompt is one user message) through the chat template with no extra special tokens.
    Tokenization counts in the timed time. Each run's `dtype` is the loaded model's. Raises RuntimeError if a batch
    does not produce exactly `output_len` new tokens per row.
    """
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from model_executor.model_info import DTYPES

    if not prompts:
        raise ValueError("no prompts")
    if output_len < 1 or not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"output_len and every batch size must be >= 1, got {output_len} and {list(batch_sizes)}")
    torch_dtype = DTYPES[cpu_dtype_name(model_dir, dtype)]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if chat:
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            for prompt in prompts
        ]
    else:
        texts = list(prompts)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to("cpu").eval()
    # Read back from the loaded weights: the precision HF actually ran, not the one asked for.
    run_dtype = str(model.dtype).removeprefix("torch.")
    generate_args = {
        "do_sample": False,
        "max_new_tokens": output_len,
        "min_new_tokens": output_len,
        "pad_token_id": tokenizer.pad_token_id,
    }

    def encode(batch_texts: Sequence[str]) -> Any:
        return tokenizer(list(batch_texts), return_tensors="pt", padding=True, add_special_tokens=not chat)

    runs: list[dict[str, Any]] = []
    progress = tqdm(
        total=sum(math.ceil(len(texts) / size) for size in batch_sizes),
        desc="HF generate",
        unit="batch",
        disable=not show_progress,
    )
    with torch.inference_mode():
        model.generate(**encode(texts[:1]), **{**generate_args, "max_new_tokens": 2, "min_new_tokens": 2})
        for batch_size in batch_sizes:
            progress.set_postfix(batch_size=batch_size)
            generated_tokens = prompt_tokens = 0
            started = time.perf_counter()
            for first in range(0, len(texts), batch_size):
                batch = encode(texts[first : first + batch_size])
                generated = model.generate(**batch, **generate_args)
                new_tokens = generated.shape[1] - batch["input_ids"].shape[1]
                if new_tokens != output_len:
                    raise RuntimeError(f"HF generate made {new_tokens} new tokens per row, not {output_len}")
                generated_tokens += new_tokens * generated.shape[0]
                prompt_tokens += int(batch["attention_mask"].sum())
                progress.update(1)
            elapsed = time.perf_counter() - started
            run = {
                "batch_size": batch_size,
                "effective_batch_size": min(batch_size, len(texts)),
                "num_prompts": len(texts),
                "elapsed_s": elapsed,
                "prompt_tokens": prompt_tokens,
                "generated_tokens": generated_tokens,
                "output_tok_per_s": generated_tokens / elapsed,
                "dtype": run_dtype,
                "torch_threads": torch.get_num_threads(),
            }
            logger.info(
                "HF generate batch %d (%s): %d tokens in %.2f s = %.1f output tok/s",
                batch_size,
                run_dtype,
                generated_tokens,
                elapsed,
                run["output_tok_per_s"],
            )
            runs.append(run)
    progress.close()
    prompt_token_counts = [len(tokenizer(text, add_special_tokens=not chat).input_ids) for text in texts]
    for run in runs:
        run["prompt_token_counts"] = prompt_token_counts
    return runs


def cpu_dtype_name(model_dir: str | Path, dtype: str) -> str:
    """`dtype` (an engine dtype name) for a run on CPU: "auto" as the engine resolves it there (the checkpoint's
    precision and this CPU's bf16 support, `resolve_auto_dtype`), any other name as given."""
    from model_executor.model_info import DTYPES, auto_dtype_for, read_hf_config

    if dtype == "auto":
        return auto_dtype_for(read_hf_config(Path(model_dir)), "cpu").dtype_name
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(DTYPES)}, got {dtype!r}")
    return dtype


@functools.lru_cache(maxsize=1)
def _load_runner(model_dir: str, device: str, dtype: str) -> Any:
    """Our ModelRunner with its weights loaded (no KV cache); the last one is kept for the next batch size."""
    from configs.engine_config import EngineConfig
    from model_executor.model_info import load_model_info
    from model_executor.model_runner import ModelRunner

    model_info = load_model_info(Path(model_dir), EngineConfig(model=model_dir, device=device, dtype=dtype))
    return ModelRunner(model_info, block_size=16, show_progress=False)


def decode_linears(model: Any) -> list[tuple[str, Any]]:
    """(name, callable module) of every matmul one decode step runs, in forward order: per layer qkv_proj, o_proj,
    gate_up_proj, down_proj, then the LM head (its `compute_logits`)."""
    linears: list[tuple[str, Any]] = []
    for index, layer in model.layers.items():
        linears += [
            (f"layers.{index}.self_attn.qkv_proj", layer.self_attn.qkv_proj),
            (f"layers.{index}.self_attn.o_proj", layer.self_attn.o_proj),
            (f"layers.{index}.mlp.gate_up_proj", layer.mlp.gate_up_proj),
            (f"layers.{index}.mlp.down_proj", layer.mlp.down_proj),
        ]
    if hasattr(model, "lm_head"):
        linears.append(("lm_head", model.lm_head))
    return linears


def matmul_roofline(
    model_dir: str | Path,
    batch_size: int,
    iterations: int = 20,
    *,
    warmup: int = 3,
    device: str = "auto",
    dtype: str = "auto",
    show_progress: bool = True,
    include_lm_head: bool = True,
    greedy_head: bool = True,
) -> dict[str, Any]:
    """Time one "decode step" of our model's linear layers alone at `batch_size` tokens (without the LM head:
    a prefill chunk's matmuls, whose rows but the last never reach the LM head).

    The LM head is the matmul the engine runs for greedy rows (the benchmarks' rows): where the engine screens
    them (`model_executor.layers.greedy_screen`), its bf16 matmul; where a bf16 head takes them on AMX
    (`model_executor.layers.greedy_head`), that matmul with its argmax; `greedy_head=False` (or neither) times the
    head that sampled rows take.

    The weights are those `ModelRunner` loads (`device` and `dtype` resolved as the engine resolves them); the
    inputs are random activations of each layer's input width, made once. Each timed step runs every layer's
    qkv/o/gate_up/down projection and the LM head under `torch.inference_mode`; `warmup` untimed steps first, then
    the median of `iterations`. tok/s = batch_size / median step time.
    """
    from tqdm import tqdm

    if batch_size < 1 or iterations < 1 or warmup < 0:
        raise ValueError(f"batch_size and iterations must be >= 1 and warmup >= 0, got {batch_size}, {iterations}")
    runner = _load_runner(str(Path(model_dir).resolve()), device, dtype)
    model = runner.model
    linears = [(name, module) for name, module in decode_linears(model) if include_lm_head or name != "lm_head"]
    weights = [module.weight for _, module in linears]
    run_device = weights[0].device
    run_dtype = weights[0].dtype
    generator = torch.Generator(device="cpu").manual_seed(0)
    # One activation per input width; tied layers (same width) share it as real layers share the hidden state.
    activations = {
        width: torch.randn(batch_size, width, generator=generator, dtype=torch.float32).to(run_device, run_dtype)
        for width in {weight.shape[1] for weight in weights}
    }
    from model_executor.layers.greedy_screen import GreedyScreen

    screen = runner.greedy_screen if greedy_head else None
    # The fp32 screen reads a bf16 copy of the head; the fused bf16 head, the head's own bf16 weight.
    screens_fp32_head = isinstance(screen, GreedyScreen)

    def matmul_of(name: str, module: Any) -> Any:
        if name != "lm_head":
            return module
        if screen is None:
            return module.compute_logits
        return screen.approx_logits if screens_fp32_head else screen.token_ids

    calls = [(matmul_of(name, module), activations[module.weight.shape[1]]) for name, module in linears]

    def synchronize() -> None:
        if run_device.type == "cuda":
            torch.cuda.synchronize(run_device)

    step_times: list[float] = []
    progress = tqdm(total=warmup + iterations, desc=f"matmul roofline b={batch_size}", disable=not show_progress)
    with torch.inference_mode():
        for step in range(warmup + iterations):
            synchronize()
            started = time.perf_counter()
            for function, activation in calls:
                function(activation)
            synchronize()
            if step >= warmup:
                step_times.append(time.perf_counter() - started)
            progress.update(1)
    progress.close()

    step_time = statistics.median(step_times)
    params = sum(weight.numel() for weight in weights)
    weight_bytes = sum(weight.numel() * weight.element_size() for weight in weights)
    if screens_fp32_head and include_lm_head:
        # The screened head reads its bf16 copy: half the fp32 weight's bytes.
        weight_bytes -= model.lm_head.weight.numel() * model.lm_head.weight.element_size() // 2
    head_label = str(run_dtype).removeprefix("torch.")
    if screen is not None:
        head_label = "bf16 (greedy screen)" if screens_fp32_head else "bf16 (fused greedy argmax)"
    result = {
        "batch_size": batch_size,
        "include_lm_head": include_lm_head,
        "lm_head": head_label if include_lm_head else None,
        "iterations": iterations,
        "warmup": warmup,
        "step_time_s": step_time,
        "step_time_min_s": min(step_times),
        "step_time_max_s": max(step_times),
        "tok_per_s": batch_size / step_time,
        "num_matmuls": len(calls),
        "linear_params": params,
        "gflop_per_s": 2.0 * params * batch_size / step_time / 1e9,
        "weight_gib_per_s": weight_bytes / step_time / 2**30,
        "device": str(run_device),
        "dtype": str(run_dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
    }
    logger.info(
        "matmul roofline batch %d: %d matmuls, %.2f ms/step = %.1f tok/s (%.1f GFLOP/s)",
        batch_size,
        len(calls),
        step_time * 1000,
        result["tok_per_s"],
        result["gflop_per_s"],
    )
    return result


def workload_ceiling(
    model_dir: str | Path,
    prompt_token_counts: Sequence[int],
    output_len: int,
    prefill_chunk_tokens: int = 512,
    iterations: int = 10,
    *,
    dtype: str = "auto",
    show_progress: bool = True,
) -> dict[str, Any]:
    """The fastest this machine can serve a burst of requests (all sent at once, `output_len` tokens each) when
    nothing but our linear layers ran: a lower bound on time that no scheduler or server can beat.

    Every prompt token goes through the layers' matmuls once (timed at `prefill_chunk_tokens` rows, the
    engine's chunk), then every later token of every request through one decode step at the full batch, LM head
    included. Attention, norms, sampling, the first tokens' LM head rows and all serving work come on top.
    The TTFT p50 floor prefills the requests one after another, in arrival order, at that same rate. The weights
    are `dtype`'s, as `matmul_roofline` loads them.
    """
    num_requests = len(prompt_token_counts)
    prefill = matmul_roofline(
        model_dir, prefill_chunk_tokens, iterations, dtype=dtype, show_progress=show_progress, include_lm_head=False
    )
    decode = matmul_roofline(model_dir, num_requests, iterations, dtype=dtype, show_progress=show_progress)
    prefill_s_per_token = prefill["step_time_s"] / prefill_chunk_tokens
    prefill_s = prefill_s_per_token * sum(prompt_token_counts)
    decode_s = decode["step_time_s"] * (output_len - 1)
    half = -(-num_requests // 2)
    ttft_p50_floor_s = prefill_s_per_token * sum(prompt_token_counts[:half])
    return {
        "num_requests": num_requests,
        "prompt_tokens": sum(prompt_token_counts),
        "output_len": output_len,
        "prefill_chunk_tokens": prefill_chunk_tokens,
        "prefill_gflop_per_s": prefill["gflop_per_s"],
        "decode_gflop_per_s": decode["gflop_per_s"],
        "prefill_linears_s": prefill_s,
        "decode_linears_s": decode_s,
        "output_tok_per_s": num_requests * output_len / (prefill_s + decode_s),
        "ttft_p50_floor_s": ttft_p50_floor_s,
        "dtype": decode["dtype"],
    }
