"""`pagedserve serve` flags generated from the config schema: one flag per key of every section (`model`, `cache`,
`scheduler`, `parallel`, `runtime`, `serve`), named as vLLM names it, its help the field's description and default.
Precedence: flags > the `--config` YAML > the schema's defaults."""

from __future__ import annotations

import argparse
import json
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from configs.app_config import CONFIG_DIR, AppConfig, ServeConfig, resolve_config_path
from configs.engine_config import ENGINE_SECTIONS, VLLM_KEYWORD_ALIASES
from configs.sections import DTYPE_ALIASES, Section, parse_lora_module

CONFIG_SECTIONS: dict[str, type[Section]] = {**ENGINE_SECTIONS, "serve": ServeConfig}

# Flags named by vLLM where its name is not the kebab-case of our key.
FLAG_NAMES: dict[tuple[str, str], tuple[str, ...]] = {
    ("model", "name"): ("--model",),
    ("parallel", "tensor_parallel_size"): ("--tensor-parallel-size", "-tp"),
    ("parallel", "pipeline_parallel_size"): ("--pipeline-parallel-size", "-pp"),
    # vLLM's data parallelism is several engines behind one API server: our engine replicas.
    ("serve", "engine_replicas"): ("--num-engine-replicas",),
}
# Flags parsed their own way: vLLM's `--lora-modules a=/path b=/path` (or a JSON object per adapter).
SPECIAL_FLAG_KWARGS: dict[tuple[str, str], Callable[[], dict[str, Any]]] = {
    ("lora", "lora_modules"): lambda: {"type": _lora_module, "nargs": "+", "metavar": "NAME=PATH"},
}
# Other spellings a Literal key accepts (its validator maps them to ours), offered as choices.
CHOICE_ALIASES: dict[tuple[str, str], dict[str, str]] = {("model", "dtype"): DTYPE_ALIASES}
# Spellings of "no value" for an optional number (`--request-timeout-s none`): a flag can undo a YAML value.
NONE_SPELLINGS = ("none", "null")


class ConfigError(ValueError):
    """A config, flag value or model the user must fix: the CLI prints it as one line and exits 2."""


@dataclass(frozen=True)
class ConfigFlag:
    """One generated flag: where its value goes in the config. `values_by_flag` maps a vLLM alias's value to ours
    (`--enforce-eager` -> runtime.cuda_graphs "off")."""

    option_strings: tuple[str, ...]
    dest: str
    section: str
    key: str
    values_by_flag: dict[Any, Any] | None = None

    @property
    def config_key(self) -> str:
        return f"{self.section}.{self.key}"

    @property
    def name(self) -> str:
        return self.option_strings[0]


def kebab(key: str) -> str:
    return "--" + key.replace("_", "-")


def _strip_none(annotation: Any) -> tuple[Any, bool]:
    """(the annotation without None, whether None was allowed)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        members = [member for member in typing.get_args(annotation) if member is not type(None)]
        if len(members) == 1:
            return members[0], True
    return annotation, False


def _json_value(expected: type, what: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise argparse.ArgumentTypeError(f"invalid JSON ({error.msg} at column {error.colno}): {text!r}") from None
        if value is not None and not isinstance(value, expected):
            raise argparse.ArgumentTypeError(f"expected {what} or null, got {text!r}")
        return value

    parse.__name__ = "JSON"  # argparse names the type in its own messages
    return parse


def _string_list(text: str) -> list[str]:
    """A JSON list, or comma-separated values (`--cors-allow-origins https://a.example,https://b.example`)."""
    if text.lstrip().startswith("["):
        return _json_value(list, "a JSON list")(text)
    return [part.strip() for part in text.split(",") if part.strip()]


def _lora_module(text: str) -> dict[str, Any]:
    try:
        return parse_lora_module(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


_lora_module.__name__ = "LoRA module"


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse_or_none(text: str) -> Any:
        return None if text.strip().lower() in NONE_SPELLINGS else parse(text)

    parse_or_none.__name__ = parse.__name__
    return parse_or_none


def _default_text(field: FieldInfo) -> str:
    default = field.get_default(call_default_factory=True)
    return json.dumps(default) if isinstance(default, list | dict) else str(default)


def _help(field: FieldInfo, default_note: str = "") -> str:
    description = (field.description or "").rstrip()
    # argparse %-formats help strings.
    return f"{description} (default: {_default_text(field)}{default_note})".replace("%", "%%").strip()


def _argument_kwargs(section: str, key: str, field: FieldInfo) -> dict[str, Any]:
    """add_argument keywords for one field, by its type."""
    annotation, nullable = _strip_none(field.annotation)
    kwargs: dict[str, Any] = {"help": _help(field)}
    special = SPECIAL_FLAG_KWARGS.get((section, key))
    if special is not None:
        return {**kwargs, **special()}
    if annotation is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
        return kwargs
    if typing.get_origin(annotation) is typing.Literal:
        choices = []
        aliases = CHOICE_ALIASES.get((section, key), {})
        for value in typing.get_args(annotation):
            choices += [value, *(alias for alias, target in aliases.items() if target == value)]
        kwargs["choices"] = choices
    elif (isinstance(annotation, type) and issubclass(annotation, BaseModel)) or typing.get_origin(annotation) is dict:
        kwargs.update(type=_json_value(dict, "a JSON object"), metavar="JSON")
    elif typing.get_origin(annotation) is list:
        kwargs.update(type=_string_list, metavar="A,B,...")
    elif annotation in (int, float):
        kwargs["type"] = _optional(annotation) if nullable else annotation
        if nullable:
            kwargs["help"] = _help(field, default_note="; the value `none` means None")
    elif annotation is str:
        kwargs["type"] = str
    else:
        raise TypeError(f"no flag type for {section}.{key}: {field.annotation}")
    return kwargs


def _alias_flags() -> Iterator[tuple[ConfigFlag, dict[str, Any]]]:
    """vLLM's boolean flags that set one of our keys to a value (`--enforce-eager` == runtime.cuda_graphs off)."""
    for alias, (section, key, values_by_theirs) in VLLM_KEYWORD_ALIASES.items():
        described = "; ".join(
            f"{kebab(('' if theirs else 'no_') + alias)} sets {section}.{key} {ours}"
            for theirs, ours in values_by_theirs.items()
        )
        flag = ConfigFlag((kebab(alias),), alias, section, key, values_by_theirs)
        yield flag, {"action": argparse.BooleanOptionalAction, "help": f"vLLM's name: {described}."}


def config_flags() -> list[tuple[ConfigFlag, dict[str, Any]]]:
    """Every schema key's flag with its add_argument keywords, section by section, in the schema's order."""
    flags: list[tuple[ConfigFlag, dict[str, Any]]] = []
    for section, model in CONFIG_SECTIONS.items():
        for key, field in model.model_fields.items():
            option_strings = FLAG_NAMES.get((section, key), (kebab(key),))
            flag = ConfigFlag(option_strings, f"{section}.{key}", section, key)
            flags.append((flag, _argument_kwargs(section, key, field)))
        flags += [(flag, kwargs) for flag, kwargs in _alias_flags() if flag.section == section]
    names = [name for flag, _ in flags for name in flag.option_strings]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise RuntimeError(f"two schema keys make the same flag: {duplicates}")
    return flags


def add_config_flags(parser: argparse.ArgumentParser) -> list[ConfigFlag]:
    """Add one flag per schema key, grouped by section; returns them for `config_overrides`."""
    groups = {
        section: parser.add_argument_group(f"{section} section", (model.__doc__ or "").split("\n\n")[0].strip())
        for section, model in CONFIG_SECTIONS.items()
    }
    added = []
    for flag, kwargs in config_flags():
        if "choices" not in kwargs and "action" not in kwargs and "metavar" not in kwargs:
            kwargs["metavar"] = flag.name.lstrip("-").replace("-", "_").upper()  # not the dotted dest
        # SUPPRESS: a flag the user did not give leaves no attribute, so the YAML's value stands.
        groups[flag.section].add_argument(*flag.option_strings, dest=flag.dest, default=argparse.SUPPRESS, **kwargs)
        added.append(flag)
    return added


def config_overrides(args: argparse.Namespace, flags: list[ConfigFlag]) -> dict[tuple[str, str], Any]:
    """The (section, key) values the user gave as flags; two flags that set one key differently are an error."""
    overrides: dict[tuple[str, str], Any] = {}
    given_by: dict[tuple[str, str], str] = {}
    for flag in flags:
        if not hasattr(args, flag.dest):
            continue
        value = getattr(args, flag.dest)
        if flag.values_by_flag is not None:
            value = flag.values_by_flag[value]
        target = (flag.section, flag.key)
        if target in overrides and overrides[target] != value:
            raise ConfigError(
                f"{given_by[target]} and {flag.name} disagree on {flag.config_key} "
                f"({overrides[target]!r} against {value!r}): give one"
            )
        overrides[target] = value
        given_by[target] = flag.name
    return overrides


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The YAML's values, sections nested (flat engine keys, as EngineConfig accepts them, moved into theirs)."""
    resolved = resolve_config_path(path)
    try:
        text = resolved.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} not found (a path, or a preset name in {CONFIG_DIR})") from None
    except OSError as error:
        raise ConfigError(f"cannot read config file {str(path)!r}: {error.strerror}") from None
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error)
        raise ConfigError(f"config file {str(resolved)!r} is not valid YAML: {problem}{where}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"config file {str(resolved)!r} must hold a mapping of sections, not {type(values).__name__}")
    try:
        return AppConfig._nest_flat_keys(values)
    except ValueError as error:
        raise ConfigError(f"config file {str(resolved)!r}: {error}") from None


def format_validation_error(error: ValidationError) -> str:
    """Pydantic's errors as `section.key: message`, on one line."""
    problems = []
    for detail in error.errors(include_url=False):
        message = detail["msg"].removeprefix("Value error, ")
        location = ".".join(str(part) for part in detail["loc"])
        problems.append(f"{location}: {message}" if location else message)
    return "; ".join(problems)


def build_app_config(config_path: str | None, overrides: dict[tuple[str, str], Any]) -> AppConfig:
    """The YAML (if any), then the flags over it, validated. Raises ConfigError with a one-line message."""
    values = read_config_file(config_path) if config_path else {}
    for (section, key), value in overrides.items():
        current = values.get(section)
        if current is None:
            values[section] = current = {}
        if isinstance(current, dict):  # anything else is the YAML's error, which validation names
            current[key] = value
    try:
        return AppConfig.model_validate(values)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error)) from None
