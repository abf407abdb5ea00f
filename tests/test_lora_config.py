"""The LoRA section: vLLM's flags (`--enable-lora --max-loras --max-lora-rank --lora-modules`), YAML and keywords."""

from __future__ import annotations

import json

import pytest

from cluster.cli import build_parser, subcommand_parsers
from configs.app_config import AppConfig
from configs.cli_args import build_app_config, config_overrides
from configs.engine_config import EngineConfig


def parse_serve_flags(*argv: str) -> AppConfig:
    """What `pagedserve serve` makes of these flags (the model is not checked)."""
    args = subcommand_parsers(build_parser())["serve"].parse_args(list(argv))
    return build_app_config(None, config_overrides(args, args.config_flags))


def test_vllm_lora_flags_set_the_lora_section():
    module_b = json.dumps({"name": "b", "path": "/adapters/b", "base_model_name": "base"})
    config = parse_serve_flags(
        "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32", "--lora-modules", "a=/adapters/a", module_b
    )
    lora = config.lora
    assert (lora.enable_lora, lora.max_loras, lora.max_lora_rank) == (True, 3, 32)
    assert [module.model_dump() for module in lora.lora_modules] == [
        {"name": "a", "path": "/adapters/a", "base_model_name": None},
        {"name": "b", "path": "/adapters/b", "base_model_name": "base"},
    ]
    default = parse_serve_flags().lora
    assert (default.enable_lora, default.max_loras, default.max_lora_rank, default.lora_modules) == (False, 1, 16, [])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora-modules", "no-path"], "must be NAME=PATH"),
        (["--lora-modules", "{not json"], "not valid JSON"),
        (["--max-loras", "0"], "max_loras"),
    ],
)
def test_bad_lora_flags_are_refused_naming_them(argv, message, capsys):
    with pytest.raises((SystemExit, ValueError)) as raised:
        parse_serve_flags("--enable-lora", *argv)
    text = capsys.readouterr().err if raised.type is SystemExit else str(raised.value)
    assert message in text


def test_lora_modules_need_lora_enabled_and_distinct_names():
    with pytest.raises(ValueError, match="lora_modules needs enable_lora"):
        EngineConfig(lora_modules=["a=/adapters/a"])
    with pytest.raises(ValueError, match=r"\['a'\] repeat"):
        EngineConfig(enable_lora=True, lora_modules=["a=/adapters/a", {"name": "a", "path": "/adapters/other"}])
    # vLLM's LLM(...) keywords land in the section; the YAML's short form is accepted too.
    config = EngineConfig(enable_lora=True, max_loras=2, lora_modules=["a=/adapters/a"])
    assert (config.lora.max_loras, config.lora.lora_modules[0].path) == (2, "/adapters/a")
