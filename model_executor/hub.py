"""Hugging Face hub ids as model sources: `org/name[@revision]` found in, or downloaded into, the hub cache.

The cache is huggingface_hub's own (`<cache>/models--org--name/snapshots/<commit>/...`), so a model downloaded by
`huggingface-cli`, transformers or vLLM is found here too, and the other way round. A model comes in two calls:
the small files every process needs (config, tokenizer, generation config, the shard index) first, then the
safetensors weights, which only the model workers ask for (`weights=True`).

huggingface_hub reads `HF_HOME` / `HF_HUB_CACHE` / `HF_HUB_OFFLINE` once, when it is imported; this module reads
them on every call, so what the environment says now is what happens.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# The files every process of a deployment reads; the weights come in a second call. Root files only: see below.
META_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "model.safetensors.index.json",
]
INDEX_FILE = "model.safetensors.index.json"
# huggingface_hub filters with fnmatch, whose `*` crosses `/`: this keeps subfolders (Llama 3's `original/`) out.
SUBFOLDERS = "*/*"
# Mistral repos ship their own layout next to the transformers one: downloading both doubles the bytes.
CONSOLIDATED = "consolidated*.safetensors"
PYTORCH_WEIGHTS = ("pytorch_model*.bin", "*.pt")
# What a process that resolves a hub id reads from its environment: a raylet on another node has its own.
HF_ENV_VARS = (
    "HF_TOKEN",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_ENDPOINT",
)
COMMIT_RE = re.compile(r"[0-9a-f]{40}")
# huggingface_hub's REPO_ID_REGEX with the namespace required (a bare name is an alias or a directory here).
_REPO_ID_FALLBACK = re.compile(r"\b[\w\-.]{1,96}\b/\b[\w\-.]{1,96}\b", re.ASCII)
_TRUE_VALUES = {"1", "ON", "YES", "TRUE"}


def bin_only_message(what: str) -> str:
    """The refusal of a model whose weights are PyTorch pickles only (one line)."""
    return (
        f"{what} has only PyTorch .bin weights; pagedserve loads safetensors only: convert it with transformers' "
        "save_pretrained(safe_serialization=True) or pick a safetensors revision"
    )


def split_revision(name: str) -> tuple[str, str | None]:
    """`org/name@rev` -> ("org/name", "rev"); without `@`, (name, None). Split on the last `@`."""
    repo_id, at, revision = name.rpartition("@")
    if not at:
        return name, None
    return repo_id, revision


def _repo_id_regex() -> re.Pattern[str]:
    try:
        from huggingface_hub.utils._validators import REPO_ID_REGEX
    except ImportError:  # a private name: if it moves, our copy of the rule stands in
        return _REPO_ID_FALLBACK
    return REPO_ID_REGEX


def is_hub_id(name: str) -> bool:
    """Whether `name` has the shape of a hub model id `org/name[@revision]` (nothing is looked up)."""
    repo_id, revision = split_revision(name)
    if revision == "" or repo_id.count("/") != 1 or ".." in repo_id:
        return False
    return _repo_id_regex().fullmatch(repo_id) is not None


def _is_true(value: str | None) -> bool:
    return value is not None and value.upper() in _TRUE_VALUES


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as the environment says now, or as huggingface_hub read it."""
    if _is_true(os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")):
        return True
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_cache_dir(download_dir: str | os.PathLike[str] | None = None) -> Path:
    """`download_dir`, else huggingface_hub's rule on today's environment: $HF_HUB_CACHE, $HF_HOME/hub,
    $XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub."""
    if download_dir:
        return Path(download_dir).expanduser()
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = os.environ.get("HF_HOME")
    if home:
        return Path(os.path.expandvars(home)).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def commit_of(path: str | os.PathLike[str]) -> str | None:
    """The commit of a hub-cache snapshot directory (`.../snapshots/<commit>`), else None."""
    path = Path(path)
    if path.parent.name == "snapshots" and COMMIT_RE.fullmatch(path.name):
        return path.name
    return None


def _disabled_tqdm() -> type:
    from huggingface_hub.utils import tqdm as hf_tqdm

    class DisabledTqdm(hf_tqdm):
        """huggingface_hub's bar, never shown (its `disable_progress_bars` is a function in 0.x, a class in 2.x)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return DisabledTqdm


def _listed_files(repo_id: str, commit: str, cache_dir: Path, offline: bool, endpoint: str | None) -> list[str] | None:
    """The repo's files at `commit`: the tree listing huggingface_hub cached (2.x), else the hub's answer when
    online, else None (offline with no listing: only the snapshot directory tells)."""
    try:
        from huggingface_hub._tree_cache import read_tree_cache
        from huggingface_hub.file_download import repo_folder_name
    except ImportError:
        pass
    else:
        folder = cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model")
        entries = read_tree_cache(str(folder), commit)
        if entries is not None:
            return sorted(entries)
    if offline:
        return None
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint).list_repo_files(repo_id, revision=commit)


def _weight_files(repo_id: str, snapshot_dir: Path, list_files: Callable[[], list[str] | None]) -> list[str] | None:
    """The safetensors files to fetch: the index's shards, else the root `*.safetensors` of the repo's listing
    (Mistral's consolidated* left out when others exist); None when neither is known (offline without a listing:
    whatever is cached). Raises ValueError for a repo of `.bin` weights only, before a byte of them is fetched."""
    index = snapshot_dir / INDEX_FILE
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    listed = list_files()
    if listed is None:
        return None
    root = [name for name in listed if "/" not in name]
    safetensors = [name for name in root if name.endswith(".safetensors")]
    if not safetensors:
        if any(Path(name).match(pattern) for name in root for pattern in PYTORCH_WEIGHTS):
            raise ValueError(bin_only_message(repo_id))
        raise ValueError(f"{repo_id} has no *.safetensors weights at commit {snapshot_dir.name}")
    transformers_layout = [name for name in safetensors if not Path(name).match(CONSOLIDATED)]
    return transformers_layout or safetensors


def _absent(snapshot_dir: Path | None, files: list[str] | None) -> str | None:
    """The first few of `files` the snapshot lacks, as one phrase; None when there is no such list or none lack."""
    if snapshot_dir is None or files is None:
        return None
    missing = [name for name in files if not (snapshot_dir / name).is_file()]
    if not missing:
        return None
    return ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")


def _check_weights_present(
    repo_id: str, snapshot_dir: Path, files: list[str] | None, not_cached: Callable[[str], ValueError]
) -> None:
    """What huggingface_hub cannot check without a cached tree listing: the weights are in the snapshot."""
    if files is not None:
        missing = _absent(snapshot_dir, files)
        if missing:
            raise not_cached(missing)
        return
    if any(path.is_file() for path in snapshot_dir.glob("*.safetensors")):
        return
    if any(path.is_file() for pattern in PYTORCH_WEIGHTS for path in snapshot_dir.glob(pattern)):
        raise ValueError(bin_only_message(repo_id))
    raise not_cached("its *.safetensors weights")


def hub_environment() -> dict[str, str]:
    """The hub variables of this process's environment, for processes started elsewhere (a raylet on another node
    has its own environment)."""
    return {name: os.environ[name] for name in HF_ENV_VARS if name in os.environ}


def snapshot(
    repo_id: str,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    weights: bool = True,
    show_progress: bool = False,
) -> Path:
    """The local snapshot directory (`<cache>/models--org--name/snapshots/<commit>`) of `repo_id` at `revision`
    (branch, tag or commit; default the repo's default branch), downloading what the cache lacks unless offline.

    `weights=False`: config, tokenizer and generation config only (what an ingress or a scheduler reads).
    `cache_dir` None: :func:`hub_cache_dir` now. Offline (HF_HUB_OFFLINE): the cache only, nothing is asked of
    the hub. Every failure is a ValueError of one line saying what to do.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = hub_cache_dir(cache_dir)
    offline = hub_offline()
    endpoint = os.environ.get("HF_ENDPOINT") or None  # None: huggingface_hub's default (it reads it at import)
    reference = repo_id if revision is None else f"{repo_id}@{revision}"
    common: dict[str, Any] = {
        "cache_dir": str(cache),
        "local_files_only": offline,
        "endpoint": endpoint,
        "tqdm_class": None if show_progress else _disabled_tqdm(),
    }

    def not_cached(what: str) -> ValueError:
        if offline:
            return ValueError(
                f"{reference}: {what} not (fully) in the hub cache at {cache} and HF_HUB_OFFLINE=1: run "
                f"`pagedserve fetch-model {reference}` with network, or unset HF_HUB_OFFLINE"
            )
        return ValueError(f"{reference}: {what} missing from the hub cache at {cache} after downloading it")

    snapshot_dir: Path | None = None
    files: list[str] | None = None
    try:
        snapshot_dir = Path(
            snapshot_download(
                repo_id, revision=revision, allow_patterns=META_FILES, ignore_patterns=[SUBFOLDERS], **common
            )
        )
        if not (snapshot_dir / "config.json").is_file():
            if offline:
                raise not_cached("config.json")
            raise ValueError(f"{reference} has no config.json: not a transformers model repository")
        if weights:
            commit = commit_of(snapshot_dir) or revision
            files = _weight_files(
                repo_id, snapshot_dir, lambda: _listed_files(repo_id, commit, cache, offline, endpoint)
            )
            ignore = [SUBFOLDERS] if files is not None else [SUBFOLDERS, CONSOLIDATED]
            logger.info("%s: weights %s", reference, ", ".join(files) if files else "*.safetensors")
            # The commit, not the branch: both calls read one snapshot even if the branch moves in between.
            snapshot_download(
                repo_id, revision=commit, allow_patterns=files or ["*.safetensors"], ignore_patterns=ignore, **common
            )
    except GatedRepoError:
        raise ValueError(f"{repo_id} is gated: accept its licence on the hub and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"{repo_id} is neither a local directory nor a model on the hub (or it is private: set HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise ValueError(f"{repo_id} has no revision {revision!r} (a branch, tag or commit) on the hub") from None
    except LocalEntryNotFoundError as error:
        # IncompleteSnapshotError is one too: huggingface_hub's cached listing names files the snapshot lacks.
        if offline:
            raise not_cached(_absent(snapshot_dir, files) or "it is") from None
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"{reference}: the hub could not be reached and the hub cache at {cache} does not hold it: {first_line}"
        ) from None
    except HfHubHTTPError as error:
        raise ValueError(f"{reference}: the hub refused: {' '.join(str(error).split())}") from None
    if weights:
        _check_weights_present(repo_id, snapshot_dir, files, not_cached)
    logger.info("%s is %s", reference, snapshot_dir)
    return snapshot_dir
