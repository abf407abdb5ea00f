"""`pagedserve` as a user runs it: the console script next to this Python, `serve` flags named as vLLM's, flags over
the YAML over the defaults (read back from `--dry-run`, which starts no Ray), one-line errors with exit status 2.
The README's flag table is checked against the parser, so the docs cannot drift."""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.cli import build_parser, subcommand_parsers
from configs.cli_args import config_flags
from configs.sections import CacheConfig, ModelConfig, SchedulerConfig

PAGEDSERVE = Path(sys.executable).with_name("pagedserve")
README = Path(__file__).resolve().parent.parent / "README.md"
# The Configs table of every key lives beside the README.
CONFIGURATION_DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
TIMEOUT_S = 120
# A Ray that serve would start by mistake fails at once at this address instead of starting and hanging the test.
NO_RAY_ENV = {"RAY_ADDRESS": "127.0.0.1:1"}


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(PAGEDSERVE), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, **NO_RAY_ENV, "COLUMNS": "200", **(env or {})},
    )


def dry_run(*args: str) -> dict[str, Any]:
    result = run_cli("serve", *args, "--dry-run")
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for fragment in fragments:
        assert fragment in lines[0]
    assert result.stdout == ""
    return lines[0]


@pytest.mark.subprocess
def test_flags_override_the_yaml_which_overrides_the_defaults(tmp_path, tiny_model_dir):
    config_path = tmp_path / "preset.yaml"
    preset = {
        "model": {"name": "tiny-random-llama", "seed": 5},
        "max_logprobs": 3,  # a flat key, as EngineConfig accepts them: the flag still wins
        "cache": {"block_size": 32, "num_kv_blocks": 64},
        "scheduler": {"max_num_seqs": 7, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
        "serve": {"port": 9001, "host": "0.0.0.0"},
    }
    config_path.write_text(yaml.safe_dump(preset))
    flags = ["--max-num-seqs", "9", "--port", "9002", "--max-logprobs", "4", "--num-kv-blocks", "none"]
    resolved = dry_run("--config", str(config_path), *flags, "--speculative-config", "null")

    assert resolved["scheduler"]["max_num_seqs"] == 9  # flag over YAML
    assert resolved["serve"]["port"] == 9002
    assert resolved["model"]["max_logprobs"] == 4
    assert resolved["cache"]["num_kv_blocks"] is None
    assert resolved["scheduler"]["speculative_config"] is None
    assert resolved["model"]["name"] == "tiny-random-llama"  # YAML over default
    assert resolved["model"]["seed"] == 5
    assert resolved["cache"]["block_size"] == 32
    assert resolved["serve"]["host"] == "0.0.0.0"
    defaults = SchedulerConfig()
    assert resolved["scheduler"]["max_num_batched_tokens"] == defaults.max_num_batched_tokens  # neither: default
    assert resolved["cache"]["gpu_memory_utilization"] == CacheConfig().gpu_memory_utilization

    # The printed config is a config: fed back as --config, it resolves to itself.
    printed = tmp_path / "printed.yaml"
    printed.write_text(yaml.safe_dump(resolved))
    assert dry_run("--config", str(printed)) == resolved


@pytest.mark.subprocess
def test_every_vllm_named_flag_is_accepted(tiny_model_dir):
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    argv = [str(tiny_model_dir), "-tp", "2", "-pp", "2", "--max-model-len", "1024"]
    argv += ["--gpu-memory-utilization", "0.5", "--kv-cache-memory-gib", "0.25", "--dtype", "half"]
    argv += ["--served-model-name", "tiny", "--block-size", "32", "--no-enable-prefix-caching"]
    argv += ["--max_num_seqs=8", "--max-num-batched-tokens", "1024", "--no-enable-chunked-prefill"]  # vLLM: _ or -
    argv += ["--speculative-config", json.dumps(speculative), "--seed", "7", "--enforce-eager"]
    argv += ["--generation-config", "vllm", "--max-logprobs", "5", "--api-key", "secret", "--host", "0.0.0.0"]
    argv += ["--port", "9100", "--log-level", "warning", "--num-engine-replicas", "2", "--route-prefix", "/v"]
    argv += ["--stream-interval", "4", "--no-async-scheduling", "--attention-backend", "torch"]
    argv += ["--download-dir", "/srv/hub-cache", "--kv-cache-dtype", "auto"]
    resolved = dry_run(*argv)

    model, cache, scheduler = resolved["model"], resolved["cache"], resolved["scheduler"]
    assert model["name"] == str(tiny_model_dir)
    assert (model["served_model_name"], model["dtype"], model["max_model_len"]) == ("tiny", "float16", 1024)
    assert (model["seed"], model["generation_config"], model["max_logprobs"]) == (7, "vllm", 5)
    assert (model["download_dir"], model["revision"]) == ("/srv/hub-cache", None)
    assert (cache["gpu_memory_utilization"], cache["kv_cache_memory_gib"], cache["block_size"]) == (0.5, 0.25, 32)
    assert cache["enable_prefix_caching"] is False and cache["kv_cache_dtype"] == "auto"
    assert (scheduler["max_num_seqs"], scheduler["max_num_batched_tokens"]) == (8, 1024)
    assert scheduler["enable_chunked_prefill"] is False
    assert scheduler["stream_interval"] == 4
    assert scheduler["async_scheduling"] is False
    assert {key: scheduler["speculative_config"][key] for key in speculative} == speculative
    assert resolved["parallel"]["tensor_parallel_size"] == 2
    assert resolved["parallel"]["pipeline_parallel_size"] == 2
    assert resolved["runtime"]["cuda_graphs"] == "off"  # --enforce-eager
    assert resolved["runtime"]["attention_backend"] == "torch"
    serve = resolved["serve"]
    assert (serve["host"], serve["port"], serve["engine_replicas"], serve["route_prefix"]) == ("0.0.0.0", 9100, 2, "/v")
    assert serve["api_key"] == "<redacted>"  # set, but a secret is not printed


@pytest.mark.subprocess
def test_a_relative_model_directory_is_served_under_the_name_given(tmp_path, tiny_model_dir):
    """Ray's processes do not share the CLI's working directory: the config carries the absolute path."""
    (tmp_path / "weights").symlink_to(tiny_model_dir)
    result = subprocess.run(
        [str(PAGEDSERVE), "serve", "./weights", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=tmp_path,
        env={**os.environ, **NO_RAY_ENV},
    )
    assert result.returncode == 0, result.stderr
    model = yaml.safe_load(result.stdout)["model"]
    assert model["name"] == str(tiny_model_dir.resolve())
    assert model["served_model_name"] == "./weights"


@pytest.mark.subprocess
@pytest.mark.parametrize(
    ("argv", "suggestion"),
    [
        (["serve", "--max-num-seq", "4"], "--max-num-seqs"),
        (["serve", "--tensor-paralel-size=2"], "--tensor-parallel-size"),
        (["bench", "--num-prompt", "3"], "--num-prompts"),
    ],
)
def test_an_unknown_flag_names_the_closest_valid_one(argv, suggestion):
    line = assert_one_line_error(run_cli(*argv), "unrecognized arguments", argv[1].partition("=")[0])
    assert f"did you mean {suggestion}?" in line


@pytest.mark.subprocess
def test_flags_are_never_abbreviated():
    """`--max-num` would otherwise pick whichever flag it prefixes today, and break when a new one shares it."""
    assert_one_line_error(run_cli("serve", "--max-num-s", "4", "--dry-run"), "unrecognized arguments: --max-num-s")


@pytest.mark.subprocess
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--gpu-memory-utilization", "1.5"], "error: cache.gpu_memory_utilization: Input should be less than or"),
        (["--block-size", "x"], "argument --block-size: invalid int value: 'x'"),
        (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        # vLLM's fp8 KV cache is not built here: refused, not served in the model's dtype.
        (["--kv-cache-dtype", "fp8"], "argument --kv-cache-dtype: invalid choice: 'fp8' (choose from 'auto')"),
        (["--speculative-config", "{ngram"], "argument --speculative-config: invalid JSON"),
        (["--speculative-config", '{"num_speculative_tokens": 0}'], "speculative_config.num_speculative_tokens:"),
        (["--port", "70000"], "serve.port: Input should be less than or equal to 65535"),
        (["-tp", "2", "--async-scheduling"], "async_scheduling needs tensor_parallel_size"),
        (["--enforce-eager", "--cuda-graphs", "padded"], "--cuda-graphs and --enforce-eager disagree"),
        (["no-such-model"], "'no-such-model' is neither a known model alias nor an existing directory"),
        (["tiny-random-llama", "--revision", "v1"], "'tiny-random-llama' is a pagedserve alias: a revision applies"),
        (["--config", "no-such-preset"], "config file 'no-such-preset' not found"),
    ],
)
def test_a_bad_flag_value_or_model_is_one_line_and_exit_2(argv, expected):
    # Without --dry-run: `serve` itself refuses before it starts anything.
    assert_one_line_error(run_cli("serve", *argv), expected)


@pytest.mark.subprocess
def test_a_bad_yaml_value_is_one_line_naming_its_key(tmp_path):
    bad_value = tmp_path / "bad_value.yaml"
    bad_value.write_text("cache:\n  gpu_memory_utilization: 7\n")
    assert_one_line_error(
        run_cli("serve", "--config", str(bad_value)),
        "error: cache.gpu_memory_utilization: Input should be less than or equal to 1",
    )
    unknown_key = tmp_path / "unknown_key.yaml"
    unknown_key.write_text("cache:\n  blok_size: 16\n")
    assert_one_line_error(
        run_cli("serve", "--config", str(unknown_key)), "cache.blok_size: Extra inputs are not permitted"
    )
    not_yaml = tmp_path / "not_yaml.yaml"
    not_yaml.write_text("cache: [16\n")
    assert_one_line_error(run_cli("serve", "--config", str(not_yaml)), "is not valid YAML", "line")


@pytest.mark.subprocess
def test_a_model_type_transformers_does_not_know_is_refused_before_ray(tmp_path, tiny_model_dir):
    """A repo that ships its own modelling code (trust_remote_code) or a newer family than transformers knows."""
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "brand-new-llm"}))
    (tmp_path / "model.safetensors").symlink_to(tiny_model_dir / "model.safetensors")
    line = assert_one_line_error(
        run_cli("serve", str(tmp_path)), "model_type 'brand-new-llm' is not known to transformers"
    )
    assert "LlamaForCausalLM" in line.partition("; supported architectures: ")[2].split(", ")


@pytest.mark.subprocess
def test_max_model_len_above_the_models_is_refused_before_ray(tiny_model_dir):
    limit = json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"]
    assert_one_line_error(
        run_cli("serve", str(tiny_model_dir), "--max-model-len", str(limit + 1)),
        f"max_model_len {limit + 1} exceeds the model's max_position_embeddings {limit}",
    )


@pytest.mark.subprocess
def test_version_is_the_packages():
    result = run_cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == importlib.metadata.version("pagedserve")


@pytest.mark.subprocess
def test_serve_help_shows_each_flags_default():
    result = run_cli("serve", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    expected = {
        "--gpu-memory-utilization GPU_MEMORY_UTILIZATION": CacheConfig().gpu_memory_utilization,
        "--max-num-seqs MAX_NUM_SEQS": SchedulerConfig().max_num_seqs,
        "--model MODEL": ModelConfig().name,
        "--enable-prefix-caching, --no-enable-prefix-caching": CacheConfig().enable_prefix_caching,
        "--dtype {auto,float32,float,bfloat16,float16,half}": "auto",
        "--port PORT": 8000,
    }
    for usage, default in expected.items():
        # The flag's own help, up to the next flag, ends in its default.
        pattern = re.escape(usage) + r" (?:(?!--).)*?\(default: " + re.escape(str(default)) + r"\)"
        assert re.search(pattern, text), usage
    for flag, _ in config_flags():
        assert flag.name in text


def test_every_flag_of_every_command_has_help():
    parser = build_parser()
    for name, command in {"pagedserve": parser, **subcommand_parsers(parser)}.items():
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help and action.help != argparse.SUPPRESS, f"{name} {action.option_strings or action.dest}"


CONFIGS_TABLE_HEADER = "| key | default | flag | vLLM's flag | meaning |"
CLI_TABLE_HEADER = "| flag | vLLM's flag | does |"
CONFIG_FILE_ONLY = "config file only"  # a key no flag sets (`models`: a list of sections)
DITTO = "″"  # a nested key's row (speculative_config.*) under the row that names its section's JSON flag


def readme_table(section: str, header: str, document: Path = README) -> list[list[str]]:
    """The cells of the table with this header row under `## {section}` of `document` (the README)."""
    lines = document.read_text().split(f"\n## {section}", 1)[1].split("\n## ", 1)[0].splitlines()
    assert header in lines, (section, header)
    rows = itertools.takewhile(lambda line: line.startswith("|"), lines[lines.index(header) + 2 :])
    cells = [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]
    assert all(len(row) == header.count(" | ") + 1 for row in cells), cells
    return cells


def flag_names(cell: str) -> list[str]:
    """The flags a cell names in backticks; `--[no-]x` is the pair `--x`, `--no-x`."""
    names = []
    for name in re.findall(r"`([^`]+)`", cell):
        names += [name.replace("[no-]", ""), name.replace("[no-]", "no-")] if "[no-]" in name else [name]
    return names


def check_vllm_cell(ours: list[str], vllms: str) -> None:
    """vLLM's column names vLLM's flag only where it is ours; anything else says `pagedserve only`."""
    if vllms.startswith("pagedserve only"):
        assert not set(flag_names(vllms)) & set(ours), (ours, vllms)
    else:
        assert flag_names(vllms) and set(flag_names(vllms)) <= set(ours), (ours, vllms)


def test_the_readme_flag_table_is_the_parsers():
    serve = subcommand_parsers(build_parser())["serve"]
    parser_flags = {option for action in serve._actions for option in action.option_strings} - {"-h", "--help"}
    key_of_dest = {flag.dest: flag.config_key for flag, _ in config_flags()}
    key_of = {option: key_of_dest.get(action.dest) for action in serve._actions for option in action.option_strings}
    key_of["MODEL"] = "model.name"

    documented: list[str] = []
    # The Configs table: each key's row names the flag that sets it (tests/test_configs.py checks the keys).
    for key, _default, ours, vllms, _meaning in readme_table("Configs", CONFIGS_TABLE_HEADER, CONFIGURATION_DOC):
        key, parent = key.strip("`"), key.strip("`").rsplit(".", 1)[0]
        if ours == DITTO:
            assert vllms == DITTO and parent in {key_of[flag] for flag in documented}, key
            continue
        if ours == CONFIG_FILE_ONLY:
            assert key not in key_of.values(), key
            continue
        flags = flag_names(ours)
        assert flags, key
        documented += flags
        check_vllm_cell(flags, vllms)
        assert {key_of.get(flag) for flag in flags} in ({key}, {parent}), (key, ours)
    # The command line's table: the flags that are no config key of their own, and the key each one sets, if any.
    for ours, vllms, does in readme_table("The command line", CLI_TABLE_HEADER):
        flags = flag_names(ours)
        assert flags, ours
        documented += flags
        check_vllm_cell(flags, vllms)
        keys = {key_of.get(flag) for flag in flags}
        assert len(keys) == 1, ours
        key = keys.pop()
        assert set(re.findall(r"`(\w+\.\w+)`", does)) == ({key} if key else set()), (ours, does)
    assert sorted(documented) == sorted(parser_flags | {"MODEL"})
