"""A tiny random-weight Llama with SmolLM2's tokenizer: fast tests and presets for TP/PP on small machines.

Alias `tiny-random-llama`: 2 layers, 4 heads, 2 KV heads, hidden 64, vocab 49152, seed 0. Built locally
(no download) next to the fetched models; deterministic, so every node of a cluster builds the same weights.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

TINY_ALIAS = "tiny-random-llama"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
MARKER_NAME = ".pagedserve-complete"


def write_tiny_llama(directory: Path, tokenizer_source: Path, **config_overrides: Any) -> Path:
    """Random weights (seed 0) with large init so greedy choices have clear margins, plus a real tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = {
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        # std 0.02 gives near-ties in the logits that flip on rounding; 0.2 gives clear winners.
        "initializer_range": 0.2,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **config_overrides,
    }
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**settings)).eval()
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (tokenizer_source / name).exists():
            shutil.copy(tokenizer_source / name, directory / name)
    return directory


def ensure_tiny_random_llama(models_dir: Path, tokenizer_source: Path) -> Path:
    """Build the alias once under models_dir (atomically); later calls return at once."""
    target = models_dir / TINY_ALIAS
    if (target / MARKER_NAME).is_file():
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{TINY_ALIAS}.staging-", dir=models_dir))
    try:
        write_tiny_llama(staging, tokenizer_source)
        (staging / MARKER_NAME).write_text("tiny random llama, seed 0\n")
        os.chmod(staging, 0o755)
        try:
            os.replace(staging, target)
        except OSError:
            if not (target / MARKER_NAME).is_file():  # another process won the race: fine; otherwise a real error
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
