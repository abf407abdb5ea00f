"""Multi-LoRA: adapters in PEFT's format served beside the base model in one batch. The anchor is HF transformers with
PEFT's `merge_and_unload()` of the same adapter: greedy tokens per prompt equal, whatever the batch mixes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from configs.sampling_params import SamplingParams
from executor import LLM, LoRARequest
from tests.helpers import assert_no_leaked_blocks, one_torch_thread
from tests.test_parity import random_prompts

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_peft_adapter(base_dir: Path, directory: Path, seed: int, **lora_settings) -> Path:
    """A random LoRA adapter (B not zero, so it changes the output) for the model in `base_dir`, saved by PEFT."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora_settings))
    peft_model.save_pretrained(directory)
    return directory


def merged_greedy(base_dir: Path, adapter_dir: Path | None, prompts: list[list[int]]) -> list[list[int]]:
    """HF greedy tokens per prompt, on the base model with the adapter merged by PEFT (or the base model alone)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    model.eval()
    outputs = []
    with torch.inference_mode(), one_torch_thread():
        for prompt in prompts:
            input_ids = torch.tensor([prompt])
            generated = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                pad_token_id=0,
            )
            outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    """Adapter "a": rank 8, alpha 12, every projection. Adapter "b": rank 4, alpha 16, rank-stabilised scaling, a
    subset of the projections, on layer 1 only."""
    root = tmp_path_factory.mktemp("lora-adapters")
    return {
        "a": write_peft_adapter(tiny_llama_dir, root / "a", 1, r=8, lora_alpha=12, target_modules=ALL_TARGETS),
        "b": write_peft_adapter(
            tiny_llama_dir,
            root / "b",
            2,
            r=4,
            lora_alpha=16,
            use_rslora=True,
            target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
            layers_to_transform=[1],
        ),
    }


@pytest.fixture(scope="module")
def mixed_batch(tiny_llama_dir, adapters):
    """Prompts, the adapter of each (None: the base model), and HF + PEFT's greedy tokens for each."""
    prompts = random_prompts(6, seed=37)
    names = [None, "a", "b", None, "a", "b"]
    references = {name: merged_greedy(tiny_llama_dir, adapters.get(name), prompts) for name in (None, "a", "b")}
    expected = [references[name][index] for index, name in enumerate(names)]
    # The adapters change the tokens: a run that ignored them could not pass.
    assert all(references["a"][index] != references[None][index] for index in range(len(prompts)))
    assert any(references["b"][index] != references[None][index] for index in range(len(prompts)))
    return prompts, names, expected


def lora_requests(names: list[str | None], adapters: dict[str, Path]) -> list[LoRARequest | None]:
    return [None if name is None else LoRARequest(name, 1 + (name == "b"), str(adapters[name])) for name in names]


def lora_llm(model_dir: Path, **engine_args) -> LLM:
    settings = {"num_kv_blocks": 128, "enable_lora": True, "max_loras": 2, "max_lora_rank": 8, **engine_args}
    return LLM(str(model_dir), show_progress=False, **settings)


def test_a_mixed_batch_equals_peft_merged_per_prompt(tiny_llama_dir, adapters, mixed_batch):
    prompts, names, expected = mixed_batch
    llm = lora_llm(tiny_llama_dir)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora_requests(names, adapters))
    assert [output.outputs[0].token_ids for output in outputs] == expected
    loaded = {adapter["name"]: adapter for adapter in llm.list_loras()}
    assert (loaded["a"]["rank"], loaded["a"]["alpha"], loaded["b"]["rank"]) == (8, 12.0, 4)
    assert loaded["b"]["target_modules"] == ["down_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert_no_leaked_blocks(llm)


def test_draft_rows_run_their_requests_adapter(tiny_llama_dir, adapters, mixed_batch):
    """N-gram drafts verified in one step give each request the tokens of one-token steps under its adapter. The
    logit bias keeps outputs within three tokens, so they repeat and drafts are accepted; which of the three wins
    still depends on the adapter."""
    prompts = mixed_batch[0]
    biased = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logit_bias={77: 100.0, 78: 100.0, 79: 100.0})
    names = [name for name in (None, "a", "b") for _ in prompts]
    requests, all_prompts = lora_requests(names, adapters), prompts * 3
    one_token_steps = lora_llm(tiny_llama_dir).generate(all_prompts, biased, use_tqdm=False, lora_request=requests)
    expected = [output.outputs[0].token_ids for output in one_token_steps]
    assert expected[: len(prompts)] != expected[len(prompts) : 2 * len(prompts)]  # the adapter changes the tokens
    speculative = {"num_speculative_tokens": 3, "disable_by_batch_size": None}
    llm = lora_llm(tiny_llama_dir, speculative_config=speculative)
    outputs = llm.generate(all_prompts, biased, use_tqdm=False, lora_request=requests)
    assert [output.outputs[0].token_ids for output in outputs] == expected
    assert llm.engine.scheduler.num_accepted_draft_tokens > 10


def test_one_slot_runs_both_adapters_in_turn_through_preemption(tiny_llama_dir, adapters, mixed_batch):
    """max_loras=1: requests of the other adapter wait while one runs (base requests run beside it); a cache too
    small for every request preempts some, and every prompt still gets its adapter's tokens."""
    prompts, names, expected = mixed_batch
    llm = lora_llm(tiny_llama_dir, num_kv_blocks=6, max_loras=1)
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, lora_name=name) for name in names]
    for name in ("a", "b"):
        llm.engine.core.add_lora(name, str(adapters[name]))
    engine, scheduler = llm.engine, llm.engine.scheduler
    for index, (prompt, request_params) in enumerate(zip(prompts, params)):
        engine.add_request(f"mixed-{index}", prompt, request_params)
    finished = {}
    for _ in range(500):
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
        running_adapters = {request.lora.name for request in scheduler.running if request.lora is not None}
        assert len(running_adapters) <= 1
        if not engine.has_unfinished_requests():
            break
    assert [finished[f"mixed-{index}"] for index in range(len(prompts))] == expected
    assert scheduler.num_preemptions > 0
    assert_no_leaked_blocks(llm)


def test_tensor_parallel_lora_equals_one_rank(ray_cluster, tiny_llama_dir, adapters, mixed_batch):
    """TP=2: each rank loads its slices of B (q/k/v, gate/up) and of A (o, down) from the adapter's files."""
    prompts, names, expected = mixed_batch
    llm = lora_llm(tiny_llama_dir, tensor_parallel_size=2, worker_num_cpus=0.5, num_threads=1)
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora_requests(names, adapters))
        assert [output.outputs[0].token_ids for output in outputs] == expected
    finally:
        llm.engine.shutdown()


def test_a_prefix_cache_hit_never_crosses_adapters(tiny_llama_dir, adapters):
    prompt = random_prompts(1, seed=5)[0] + list(range(100, 140))  # over two full blocks of 16
    llm = lora_llm(tiny_llama_dir)
    kv_cache = llm.engine.scheduler.kv_cache
    full_blocks = (len(prompt) - 1) // 16 * 16

    def cached_tokens(lora_name: str | None) -> tuple[int, list[int]]:
        before = kv_cache.prefix_cache_hits
        request = None if lora_name is None else LoRARequest(lora_name, 1, str(adapters[lora_name]))
        output = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=request)[0]
        return kv_cache.prefix_cache_hits - before, output.outputs[0].token_ids

    hits_a, tokens_a = cached_tokens("a")
    hits_b, tokens_b = cached_tokens("b")
    hits_base, tokens_base = cached_tokens(None)
    assert (hits_a, hits_b, hits_base) == (0, 0, 0)
    again = [cached_tokens(name) for name in ("a", "b", None)]
    assert [hits for hits, _ in again] == [full_blocks] * 3
    assert [tokens for _, tokens in again] == [tokens_a, tokens_b, tokens_base]
    assert tokens_a != tokens_base


def test_bad_adapters_are_refused_naming_the_cause(tiny_llama_dir, adapters, tmp_path):
    llm = LLM(str(tiny_llama_dir), show_progress=False, num_kv_blocks=32, enable_lora=True, max_lora_rank=4)
    core = llm.engine.core
    with pytest.raises(ValueError, match=r"rank 8, above max_lora_rank 4"):
        core.add_lora("a", str(adapters["a"]))
    with pytest.raises(ValueError, match="does not exist"):
        core.add_lora("missing", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"no adapter_config\.json"):
        core.add_lora("empty", str(tmp_path))
    embedding = shutil.copytree(adapters["b"], tmp_path / "embedding")
    config = json.loads((embedding / "adapter_config.json").read_text())
    config["target_modules"] = [*config["target_modules"], "embed_tokens", "lm_head"]
    (embedding / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"targets modules \['embed_tokens', 'lm_head'\]"):
        core.add_lora("embedding", str(embedding))
    with pytest.raises(ValueError, match="base model's name"):
        core.add_lora(str(tiny_llama_dir), str(adapters["b"]))
    core.add_lora("b", str(adapters["b"]))
    with pytest.raises(ValueError, match="already loaded"):
        core.add_lora("b", str(adapters["b"]))
    with pytest.raises(ValueError, match=r"LoRA adapter 'c' is not loaded \(loaded: b\)"):
        core.add_request("unknown", [5, 6, 7], SamplingParams(lora_name="c"))
    assert not core.has_request("unknown")
    # Unloading is refused while a request uses the adapter, and works once none does.
    core.add_request("uses-b", [5, 6, 7], SamplingParams(lora_name="b"))
    with pytest.raises(ValueError, match="in use by 1 request"):
        core.remove_lora("b")
    core.abort_request(["uses-b"])
    assert core.remove_lora("b") is True
    assert core.remove_lora("b") is False
    assert core.list_loras() == []


def test_lora_requests_need_lora_enabled(tiny_llama_dir, adapters):
    llm = LLM(str(tiny_llama_dir), show_progress=False, num_kv_blocks=32)
    with pytest.raises(ValueError, match="--enable-lora"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapters["a"])))
    with pytest.raises(ValueError, match="not enabled"):
        llm.engine.core.add_request("r", [5, 6, 7], SamplingParams(lora_name="a"))


def test_phi3_fused_qkv_and_gate_up_adapters_equal_peft_merged(tiny_phi3_dir, tmp_path):
    """Phi-3's checkpoint fuses q|k|v and gate|up: PEFT adapters target qkv_proj and gate_up_proj, whose B rows
    split into our q, k, v and gate, up slices sharing one A."""
    adapter = write_peft_adapter(
        tiny_phi3_dir, tmp_path / "phi3", 3, r=6, lora_alpha=9, target_modules=["qkv_proj", "gate_up_proj", "o_proj"]
    )
    prompts = [prompt[:40] for prompt in random_prompts(3, seed=11)]
    expected = merged_greedy(tiny_phi3_dir, adapter, prompts)
    llm = LLM(str(tiny_phi3_dir), show_progress=False, num_kv_blocks=64, enable_lora=True, max_lora_rank=8)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=LoRARequest("phi", 1, str(adapter)))
    assert [output.outputs[0].token_ids for output in outputs] == expected
    with pytest.raises(ValueError, match=r"targets modules \['q_proj'\].*supported: down_proj, gate_up_proj"):
        llama_style = write_peft_adapter(tiny_phi3_dir, tmp_path / "phi3-q", 4, r=2, target_modules=["qkv_proj"])
        config = json.loads((llama_style / "adapter_config.json").read_text())
        (llama_style / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj"]}))
        llm.engine.core.add_lora("q-only", str(llama_style))


def test_adapter_rows_get_their_delta_and_base_rows_stay_bitwise():
    """One QKV layer, rows of two adapters and of the base model: base rows are the layer's plain output bit for
    bit; adapter rows add scaling * x A^T B^T to their slices only (q for slot 0, q|k|v fused for slot 1)."""
    from model_executor.layers.linear import QKVParallelLinear
    from model_executor.lora import LinearLoRA, LoRABatch
    from model_executor.parallel_state import ParallelContext

    torch.manual_seed(0)
    layer = QKVParallelLinear(32, 8, 4, 2, ParallelContext())
    layer.weight.data.normal_()
    batch = LoRABatch(max_loras=2, device=torch.device("cpu"))
    layer.lora = LinearLoRA(layer, batch, max_loras=2, max_rank=4)
    a_q, b_q = torch.randn(4, 32), torch.randn(32, 4)
    a_fused, b_fused = torch.randn(3, 32), torch.randn(64, 3)
    layer.lora.load_slot(0, 0, a_q, b_q)
    layer.lora.load_slot(1, None, a_fused, b_fused)
    batch.scalings.copy_(torch.tensor([0.5, 2.0]))
    x = torch.randn(5, 32)
    plain = torch.nn.functional.linear(x, layer.weight)
    batch.set_step([-1, 0, 1, -1, 0], None)
    out = layer(x)
    assert torch.equal(out[[0, 3]], plain[[0, 3]])
    expected_q = plain[[1, 4]].clone()
    expected_q[:, :32] += 0.5 * x[[1, 4]] @ a_q.t() @ b_q.t()
    torch.testing.assert_close(out[[1, 4]], expected_q)
    torch.testing.assert_close(out[2], plain[2] + 2.0 * x[2] @ a_fused.t() @ b_fused.t())
    batch.clear()
    assert torch.equal(layer(x), plain)
