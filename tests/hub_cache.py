"""A real Hugging Face hub cache laid by hand, for tests that may not reach the hub (`from tests.hub_cache import
...`).

No huggingface_hub API writes a cache entry without network (`snapshot_download` needs an endpoint), so this lays
the documented layout with huggingface_hub's own path helpers, then asserts with its public readers
(`scan_cache_dir`, `try_to_load_from_cache`) that it is a cache they accept:

    <cache>/models--org--name/
      blobs/<sha256 of a .safetensors | git blob sha1 of any other file>
      snapshots/<commit>/<file> -> ../../blobs/<hash>
      refs/<branch or tag>            # "<commit>", no newline
      trees/<commit>.json             # the listing huggingface_hub caches (2.x): what a complete snapshot holds

The helpers it uses are private: each has a hand-written stand-in, so an upgrade that moves one changes nothing
here, and the public readers still judge the result.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

COMMIT_LENGTH = 40
# The files the tiny random Llama is made of (its weights, config and tokenizer).
TINY_LLAMA_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


def fake_commit(seed: str) -> str:
    """A 40-hex commit id (what `file_download.REGEX_COMMIT_HASH` accepts), the same for the same seed."""
    return hashlib.sha1(seed.encode()).hexdigest()


def repo_folder(cache_dir: Path, repo_id: str) -> Path:
    try:
        from huggingface_hub.file_download import repo_folder_name
    except ImportError:
        return cache_dir / ("models--" + repo_id.replace("/", "--"))
    return cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model")


def _blob_id(data: bytes) -> str:
    """Git's blob sha1, the hub's id of a file kept in git."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _link(blob: Path, pointer: Path) -> None:
    try:
        from huggingface_hub.file_download import _create_symlink
    except ImportError:
        pointer.unlink(missing_ok=True)
        os.symlink(os.path.relpath(blob, pointer.parent), pointer)
        return
    _create_symlink(str(blob), str(pointer), new_blob=False)


def _write_ref(folder: Path, ref: str, commit: str) -> None:
    try:
        from huggingface_hub.file_download import _cache_commit_hash_for_specific_revision
    except ImportError:
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
        return
    _cache_commit_hash_for_specific_revision(str(folder), ref, commit)


def _write_tree(folder: Path, commit: str, entries: dict[str, dict[str, object]]) -> None:
    try:
        from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache
    except ImportError:
        (folder / "trees").mkdir(parents=True, exist_ok=True)
        listing = {"format_version": 1, "files": dict(sorted(entries.items()))}
        (folder / "trees" / f"{commit}.json").write_text(json.dumps(listing))
        return
    write_tree_cache(str(folder), commit, {path: TreeCacheEntry(**entry) for path, entry in entries.items()})


def lay_hub_cache(
    cache_dir: Path,
    repo_id: str,
    files: Mapping[str, Path | bytes],
    refs: Sequence[str] = ("main",),
    *,
    commit: str | None = None,
    tree_listing: bool = True,
    absent: Sequence[str] = (),
) -> Path:
    """Lay one snapshot of `repo_id` into the hub cache at `cache_dir` and return its directory.

    `files`: name in the repo -> a file to copy or its bytes. `refs`: branches or tags pointing at this commit.
    `commit`: default a fixed id derived from the repo and its refs. `tree_listing`: write the listing
    huggingface_hub caches after a download (it then knows what a complete snapshot holds). `absent`: names that
    listing holds but the snapshot lacks, as an interrupted download leaves it.
    """
    commit = commit or fake_commit(f"{repo_id}@{','.join(refs)}")
    folder = repo_folder(cache_dir, repo_id)
    snapshot_dir = folder / "snapshots" / commit
    (folder / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot_dir.mkdir(parents=True, exist_ok=True)
    entries: dict[str, dict[str, object]] = {}
    for name, source in files.items():
        data = source if isinstance(source, bytes) else Path(source).read_bytes()
        # The hub names a large (LFS) file's blob by its sha256, any other file by its git blob id.
        is_lfs = name.endswith((".safetensors", ".bin", ".pt"))
        blob_id = _blob_id(data)
        blob_name = hashlib.sha256(data).hexdigest() if is_lfs else blob_id
        blob = folder / "blobs" / blob_name
        if not blob.exists():
            if isinstance(source, bytes):
                blob.write_bytes(data)
            else:
                shutil.copyfile(source, blob)
        pointer = snapshot_dir / name
        pointer.parent.mkdir(parents=True, exist_ok=True)
        _link(blob, pointer)
        entry: dict[str, object] = {"size": len(data), "blob_id": blob_id}
        if is_lfs:
            entry.update(lfs_sha256=blob_name, lfs_size=len(data))
        entries[name] = entry
    for name in absent:
        entries[name] = {"size": 1, "blob_id": _blob_id(name.encode()), "lfs_sha256": "0" * 64, "lfs_size": 1}
    if tree_listing:
        _write_tree(folder, commit, entries)
    for ref in refs:
        _write_ref(folder, ref, commit)
    _assert_huggingface_hub_reads_it(cache_dir, repo_id, commit, refs, snapshot_dir, files)
    return snapshot_dir


def _assert_huggingface_hub_reads_it(
    cache_dir: Path, repo_id: str, commit: str, refs: Sequence[str], snapshot_dir: Path, files: Mapping[str, object]
) -> None:
    """huggingface_hub's public readers accept the laid snapshot as a cache entry of theirs."""
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache

    scanned = scan_cache_dir(cache_dir)
    repos = {repo.repo_id: repo for repo in scanned.repos if repo.repo_type == "model"}
    assert repo_id in repos, (repos, scanned.warnings)
    revisions = {revision.commit_hash: revision for revision in repos[repo_id].revisions}
    assert commit in revisions, revisions
    assert {file.file_name for file in revisions[commit].files} >= {Path(name).name for name in files}
    assert set(refs) <= set(revisions[commit].refs), revisions[commit].refs
    for revision in (commit, *refs):
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir, revision=revision)
        if "config.json" in files:
            assert found == str(snapshot_dir / "config.json"), found


def lay_tiny_llama(
    cache_dir: Path, tiny_model_dir: Path, repo_id: str = "pagedserve-test/tiny-llama", **kwargs: object
) -> Path:
    """The tiny random Llama (`resolve_model("tiny-random-llama")`) as a hub repo in `cache_dir`; `kwargs` go to
    :func:`lay_hub_cache` (refs, commit, tree_listing, absent)."""
    files = {name: tiny_model_dir / name for name in TINY_LLAMA_FILES if (tiny_model_dir / name).is_file()}
    return lay_hub_cache(cache_dir, repo_id, files, **kwargs)  # type: ignore[arg-type]
