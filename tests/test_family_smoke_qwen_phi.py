"""Qwen2, Qwen3 and Phi-3 on tiny random checkpoints: our fp32 greedy tokens equal HF transformers' on the same
weights, alone and batched, on the default backend (C++ kernels, decode stack where it applies) and on torch's.

Each checkpoint randomises what HF initialises neutrally (biases zero, norm weights one), so a bias, a norm or a
window we dropped changes tokens. Windows of 20 and 40 are not multiples of the 16-token block, and prompts up to
60 tokens plus 40 generated cross them; Phi-3 stays under its `original_max_position_embeddings` of 128, where
longrope's short factors are HF's too.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from configs.sampling_params import SamplingParams
from model_executor.tiny_model import TOKENIZER_FILES
from tests.helpers import assert_no_leaked_blocks
from tests.model_families import FamilySpec, random_prompts, write_tiny_family

MAX_NEW_TOKENS = 40

# Beside the parity matrix's specs (qwen2: per-layer windows; qwen3: head_dim 32, q/k norms; phi3: longrope, window
# 40; phi3_partial: half of each head rotated), the shapes of released checkpoints the matrix leaves out.
EXTRA_SPECS: dict[str, FamilySpec] = {
    # Qwen2.5 0.5B-3B: no window, tied head, the decode stack's common case.
    "qwen2_tied": FamilySpec("Qwen2ForCausalLM", "Qwen2Config", {"tie_word_embeddings": True}),
    # attention_bias puts a bias on o_proj too (Qwen2 never has one there).
    "qwen3_bias": FamilySpec("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 32, "attention_bias": True}),
}
# The matrix (tests/test_model_families.py) covers qwen2, qwen3, phi3 and phi3_partial on every backend and feature;
# these two shapes of released checkpoints are not among its specs.
FAMILIES = ["qwen2_tied", "qwen3_bias"]


def write_extra_family(name: str, directory: Path, tokenizer_source: Path) -> Path:
    """`EXTRA_SPECS[name]`'s checkpoint, built as the matrix builds its own (seed 0, neutral init randomised)."""
    from transformers import AutoModelForCausalLM

    spec = EXTRA_SPECS[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(spec.config(), dtype=torch.float32).eval()
    assert type(model).__name__ == spec.architecture
    spec.tweak(model)
    model.save_pretrained(directory)
    for file_name in TOKENIZER_FILES:
        if (tokenizer_source / file_name).exists():
            shutil.copy(tokenizer_source / file_name, directory / file_name)
    return directory


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            write = write_extra_family if name in EXTRA_SPECS else write_tiny_family
            built[name] = write(name, tmp_path_factory.mktemp(name), smollm2_dir)
        return built[name]

    return get


PROMPTS = [*random_prompts(3, seed=7), [5] * 60]


def greedy(max_tokens: int = MAX_NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def engine_model(llm: Any) -> Any:
    return llm.engine.core.executor.worker.runner.model


@pytest.mark.parametrize("attention_backend", ["auto", "torch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_hf_alone_and_batched(family, attention_backend, family_dir, make_llm, hf_reference):
    model_dir = family_dir(family)
    expected = [hf_reference.greedy(model_dir, ids, MAX_NEW_TOKENS) for ids in PROMPTS]
    llm = make_llm(model_dir, attention_backend=attention_backend)
    batched = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [output.outputs[0].token_ids for output in batched] == expected
    alone = [llm.generate([ids], greedy(), use_tqdm=False)[0].outputs[0].token_ids for ids in PROMPTS]
    assert alone == expected
    assert_no_leaked_blocks(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_stack_runs_these_shapes(family, family_dir, make_llm):
    """Tied heads and an o_proj bias keep the C++ stack (the matrix's tier F covers the other shapes)."""
    from cuda_ext.cpu_ops import load_cpu_ops
    from model_executor.cpu_decode_stack import runs_decode_stack

    if load_cpu_ops() is None:
        pytest.skip("our C++ kernels are not built")
    assert runs_decode_stack(engine_model(make_llm(family_dir(family))))


def test_phi3_logs_where_longrope_stops_matching_hf(family_dir, make_llm, caplog):
    with caplog.at_level(logging.INFO):
        make_llm(family_dir("phi3"))
    assert "longrope: not HF-identical past 128 tokens" in caplog.text


REFUSED = [
    # Qwen2.5's long-context recipe adds YaRN, which the rotary tables here do not build.
    ("qwen2_tied", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope type 'yarn'"),
    ("qwen3_bias", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ("phi3", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
]


@pytest.mark.parametrize(("family", "changes", "message"), REFUSED, ids=[case[0] for case in REFUSED])
def test_refused_config_names_the_setting(family, changes, message, family_dir, tmp_path):
    """A config the family cannot run is refused with one line naming the setting, not run with wrong tokens."""
    from executor import LLM

    shutil.copytree(family_dir(family), tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(model=str(tmp_path), num_kv_blocks=256, show_progress=False)


@pytest.mark.parametrize(
    "settings",
    [
        {"use_sliding_window": True, "sliding_window": 20, "max_window_layers": 1},
        {"use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 1},
        {"use_sliding_window": True, "sliding_window": 20, "max_window_layers": 3},
    ],
)
def test_qwen2_windows_without_layer_types_follow_transformers_rule(settings):
    """A config without `layer_types` (read without transformers' post-init) gets the windows transformers derives."""
    from types import SimpleNamespace

    from transformers import Qwen2Config

    from model_executor.models.qwen2 import layer_sliding_window

    hf_config = Qwen2Config(num_hidden_layers=3, **settings)
    expected = [hf_config.sliding_window if kind == "sliding_attention" else None for kind in hf_config.layer_types]
    raw = SimpleNamespace(num_hidden_layers=3, **settings)
    assert [layer_sliding_window(raw, index) for index in range(3)] == expected
    assert [layer_sliding_window(hf_config, index) for index in range(3)] == expected
