"""Hugging Face hub ids as model names, in-process, against a hub cache laid by hand (tests/hub_cache.py): which
snapshot a name, `@rev` or `revision` resolves to, what is fetched with and without weights, where the cache is,
and the one-line errors of a model that cannot be had offline."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub.constants
import pytest

from configs.app_config import AppConfig
from configs.sampling_params import SamplingParams
from model_executor import hub
from model_executor.model_fetch import resolve_configured_model, resolve_model
from tests.hub_cache import lay_hub_cache, lay_tiny_llama

REPO = "pagedserve-test/tiny-llama"
PROMPT = [17, 2300, 981, 45, 6]


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> SimpleNamespace:
    """`<home>/hub` holding the tiny Llama at two commits: `main` and the tag `v1`."""
    home = tmp_path_factory.mktemp("hf-home")
    cache = home / "hub"
    main = lay_tiny_llama(cache, tiny_model_dir, refs=("main",))
    v1 = lay_tiny_llama(cache, tiny_model_dir, refs=("v1",))
    assert main.name != v1.name
    return SimpleNamespace(home=home, cache=cache, main=main, v1=v1, tiny=tiny_model_dir)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, hub_cache: SimpleNamespace) -> SimpleNamespace:
    """HF_HUB_OFFLINE=1 and HF_HUB_CACHE the laid cache, set after huggingface_hub was imported (it read its own
    at import: what counts is what the environment says now)."""
    for name in (*hub.HF_ENV_VARS, "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache.cache))
    return hub_cache


def test_a_hub_id_is_its_main_snapshot_and_generates_as_hf_does(offline, make_llm, hf_reference):
    assert resolve_model(REPO) == offline.main
    assert (offline.main / "model.safetensors").is_file()
    llm = make_llm(REPO)
    # The engine read the commit, and its worker loaded the snapshot of that commit.
    assert llm.engine.model_info.hub_commit == offline.main.name
    assert llm.engine.model_info.model_dir == offline.main
    output = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    assert output.outputs[0].token_ids == hf_reference.greedy(offline.main, PROMPT, 8)


def test_a_tag_or_commit_names_its_snapshot(offline):
    v1 = offline.v1
    assert resolve_model(f"{REPO}@v1") == v1
    assert resolve_model(REPO, revision="v1") == v1
    assert resolve_model(REPO, revision=v1.name) == v1
    assert resolve_model(f"{REPO}@{v1.name}") == v1
    assert resolve_model(f"{REPO}@main") == offline.main
    assert hub.commit_of(v1) == v1.name


def test_a_revision_named_twice_differently_is_refused(offline):
    with pytest.raises(ValueError, match=r"names revision 'v1' and the revision given is 'main': give one"):
        resolve_model(f"{REPO}@v1", revision="main")
    with pytest.raises(ValueError, match="revision applies to hub ids only"):
        resolve_model("tiny-random-llama", revision="v1")
    with pytest.raises(ValueError, match="revision applies to hub ids only"):
        resolve_model(str(offline.tiny), revision="v1")


def test_without_weights_only_the_config_and_tokenizer_are_needed(offline, tmp_path, monkeypatch):
    meta_only = {name: offline.tiny / name for name in ("config.json", "tokenizer.json", "tokenizer_config.json")}
    # The listing names the weights, as after a `weights=False` download: the snapshot lacks them.
    snapshot_dir = lay_hub_cache(tmp_path, "pagedserve-test/meta-only", meta_only, absent=["model.safetensors"])
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert resolve_model("pagedserve-test/meta-only", weights=False) == snapshot_dir
    with pytest.raises(ValueError) as error:
        resolve_model("pagedserve-test/meta-only")
    assert str(error.value) == (
        f"pagedserve-test/meta-only: model.safetensors not (fully) in the hub cache at {tmp_path} and "
        "HF_HUB_OFFLINE=1: run `pagedserve fetch-model pagedserve-test/meta-only` with network, or unset HF_HUB_OFFLINE"
    )


def test_offline_and_not_cached_is_one_line_naming_the_cache(offline):
    for name in ("pagedserve-test/no-such-model", f"{REPO}@no-such-tag"):
        with pytest.raises(ValueError) as error:
            resolve_model(name)
        message = str(error.value)
        assert "\n" not in message
        assert message == (
            f"{name}: it is not (fully) in the hub cache at {offline.cache} and HF_HUB_OFFLINE=1: run "
            f"`pagedserve fetch-model {name}` with network, or unset HF_HUB_OFFLINE"
        )


@pytest.mark.parametrize("tree_listing", [True, False], ids=["huggingface_hub-knows", "no-listing"])
def test_a_shard_missing_from_the_snapshot_is_named(offline, tmp_path, monkeypatch, tree_listing):
    """An interrupted download: the index names two shards, one is there. With huggingface_hub's cached listing
    it raises IncompleteSnapshotError; without one, our own check finds the gap."""
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.dumps({"metadata": {}, "weight_map": {"a": shards[0], "b": shards[1]}}).encode()
    files = {
        "config.json": offline.tiny / "config.json",
        "model.safetensors.index.json": index,
        "model-00001-of-00002.safetensors": b"shard one",
    }
    absent = ["model-00002-of-00002.safetensors"]
    lay_hub_cache(tmp_path, "pagedserve-test/sharded", files, tree_listing=tree_listing, absent=absent)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match=r"^pagedserve-test/sharded: model-00002-of-00002\.safetensors not \(fully\)"):
        resolve_model("pagedserve-test/sharded")


@pytest.mark.parametrize("tree_listing", [True, False], ids=["listed", "no-listing"])
def test_bin_only_weights_are_refused(offline, tmp_path, monkeypatch, tree_listing):
    files = {"config.json": offline.tiny / "config.json", "pytorch_model.bin": b"a pickle"}
    lay_hub_cache(tmp_path, "pagedserve-test/bin-only", files, tree_listing=tree_listing)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError) as error:
        resolve_model("pagedserve-test/bin-only")
    assert str(error.value) == (
        "pagedserve-test/bin-only has only PyTorch .bin weights; pagedserve loads safetensors only: convert it with "
        "transformers' save_pretrained(safe_serialization=True) or pick a safetensors revision"
    )


def test_download_dir_is_the_cache_whatever_the_environment_says(offline, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    assert resolve_model(REPO, download_dir=str(offline.cache)) == offline.main
    with pytest.raises(ValueError, match=f"not \\(fully\\) in the hub cache at {tmp_path / 'empty'} "):
        resolve_model(REPO)
    model = AppConfig.model_validate({"model": {"name": REPO, "revision": "v1", "download_dir": str(offline.cache)}})
    assert resolve_configured_model(model.model, weights=True) == offline.v1


def test_the_environment_is_read_at_each_call(offline, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(offline.home))  # the cache is $HF_HOME/hub
    assert resolve_model(REPO) == offline.main
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ValueError, match=f"hub cache at {tmp_path / 'hub'} and HF_HUB_OFFLINE=1"):
        resolve_model(REPO)
    monkeypatch.setenv("HF_HUB_CACHE", str(offline.cache))  # over HF_HOME, as huggingface_hub ranks them
    assert resolve_model(REPO) == offline.main
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    assert hub.hub_environment() == {
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(offline.cache),
        "HF_HOME": str(tmp_path),
        "HF_TOKEN": "hf_test",
    }


def test_the_cli_pins_a_hub_id_to_its_commit(offline, monkeypatch):
    from cluster.cli import check_model

    typed = f"{REPO}@v1"
    pinned = check_model(AppConfig.model_validate({"model": {"name": typed}})).model
    # Every process on every node loads the commit read now; clients see the id as typed.
    assert (pinned.name, pinned.revision, pinned.served_model_name) == (REPO, offline.v1.name, typed)
    assert resolve_configured_model(pinned, weights=True) == offline.v1
    served = check_model(AppConfig.model_validate({"model": {"name": REPO, "served_model_name": "tiny"}})).model
    assert (served.name, served.revision, served.served_model_name) == (REPO, offline.main.name, "tiny")


def test_the_cli_fetches_no_weights_for_a_cluster_of_its_own(offline, tmp_path, monkeypatch):
    """With RAY_ADDRESS the workers run on the cluster's nodes: the CLI needs the config and tokenizer only."""
    from cluster.cli import check_model
    from configs.cli_args import ConfigError

    meta_only = {name: offline.tiny / name for name in ("config.json", "tokenizer.json", "tokenizer_config.json")}
    snapshot_dir = lay_hub_cache(tmp_path, "pagedserve-test/meta-only", meta_only, absent=["model.safetensors"])
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    config = AppConfig.model_validate({"model": {"name": "pagedserve-test/meta-only"}})
    with pytest.raises(ConfigError, match=r"model\.safetensors not"):
        check_model(config)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # never dialled: the CLI only reads it
    assert check_model(config).model.revision == snapshot_dir.name
