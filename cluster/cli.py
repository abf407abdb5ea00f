"""`pagedserve` command line: serve (with vLLM's flags), fetch-model, bench (HTTP), bench-offline, soak."""

from __future__ import annotations

import argparse
import difflib
import importlib.metadata
import logging
import os
import sys
from typing import Any, NoReturn

from configs.app_config import AppConfig
from configs.cli_args import ConfigError, add_config_flags, build_app_config, config_overrides

logger = logging.getLogger("pagedserve")

# uvicorn's --log-level names; "trace" is uvicorn's level 5, below DEBUG.
LOG_LEVELS = {
    "critical": logging.CRITICAL,
    "error": logging.ERROR,
    "warning": logging.WARNING,
    "info": logging.INFO,
    "debug": logging.DEBUG,
    "trace": 5,
}
# What `--dry-run` prints instead of the API key: a key fed back from that output locks clients out, never in.
REDACTED = "<redacted>"


class CliParser(argparse.ArgumentParser):
    """Errors are one line, `error: ...`, exit status 2 (argparse's usage block buries the message). Flags are
    never abbreviated: with flags generated from the schema, a new key would break a command that relied on it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        fail(message)


def fail(message: object) -> NoReturn:
    """One line, `error: ...`, on stderr and exit status 2: what the user must fix, without a traceback."""
    sys.stderr.write(f"error: {' '.join(str(message).split())}\n")
    sys.exit(2)


def package_version() -> str:
    try:
        return importlib.metadata.version("pagedserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (pagedserve is not installed: run `make setup`)"


def cmd_fetch_model(args: argparse.Namespace) -> int:
    """Exit status 2 and one line when the model cannot be had (unknown name, offline and not cached, gated)."""
    from model_executor.model_fetch import resolve_model

    try:
        model_dir = resolve_model(
            args.model, revision=args.revision, download_dir=args.download_dir, weights=True, show_progress=True
        )
    except (ValueError, OSError, RuntimeError) as error:  # RuntimeError: fetching an alias failed
        fail(error)
    # The last line is the directory, so scripts can take it with `tail -n 1`.
    sys.stdout.write(f"{model_dir}\n")
    return 0


def cmd_bench_offline(args: argparse.Namespace) -> int:
    from cluster.bench.offline import run_offline_benchmark

    run_offline_benchmark(args)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Exit status 1 when any request failed, so scripts notice a broken endpoint."""
    from cluster.bench.client import run_client
    from cluster.bench.serving import run_benchmark

    result = run_client(run_benchmark(args))
    return 1 if result["summary"]["failed"] else 0


def check_model(config: AppConfig) -> AppConfig:
    """Resolve the model (fetching an alias once) and read its HF config before Ray starts, so a wrong model or a
    max_model_len above the model's is one line now instead of a failed deployment later. A relative directory
    becomes absolute (Ray's processes have other working directories); clients still see the name as given.

    A hub id is downloaded here with its weights when Ray starts on this node (its workers share this cache; the
    bar shows), else config and tokenizer only; then pinned: `model.name` the repo id, `model.revision` the commit
    resolved now, so every process on every node loads that one commit (each node fetches into its own cache)."""
    from model_executor import hub
    from model_executor.model_fetch import MODEL_ALIASES, hub_commit_for, resolve_model
    from model_executor.tiny_model import TINY_ALIAS

    model = config.model
    name = model.name
    try:
        model_dir = resolve_model(
            name,
            revision=model.revision,
            download_dir=model.download_dir,
            # RAY_ADDRESS: the workers run on the cluster's nodes, which fetch the weights themselves.
            weights=not os.environ.get("RAY_ADDRESS"),
            show_progress=True,
        )
    except (ValueError, OSError, RuntimeError) as error:  # RuntimeError: fetching an alias failed
        raise ConfigError(str(error)) from None
    from model_executor.model_info import load_model_info  # torch and transformers: only once the model exists

    try:
        # Only the length check matters here: which device the workers use is their cluster's business.
        load_model_info(model_dir, config, cuda_available=True, log_dtype_choice=False)
    except (ValueError, OSError, AttributeError) as error:
        raise ConfigError(f"model {name!r}: {error}") from None
    commit = hub_commit_for(name, model_dir)
    if commit is not None:
        update = {"name": hub.split_revision(name)[0], "revision": commit}
    elif name in MODEL_ALIASES or name == TINY_ALIAS or name == str(model_dir):
        return config
    else:
        update = {"name": str(model_dir)}
    if model.served_model_name is None:
        update["served_model_name"] = name
    return config.model_copy(update={"model": model.model_copy(update=update)})


def serve_config(args: argparse.Namespace) -> AppConfig:
    """Flags over the `--config` YAML over the defaults, validated, with the model checked."""
    overrides = config_overrides(args, args.config_flags)
    if args.model_tag is not None:
        flagged = overrides.get(("model", "name"))
        if flagged is not None and flagged != args.model_tag:
            raise ConfigError(f"the model is given twice, as MODEL {args.model_tag!r} and --model {flagged!r}")
        overrides[("model", "name")] = args.model_tag
    return check_model(build_app_config(args.config, overrides))


def dump_config(config: AppConfig) -> str:
    import yaml

    values = config.model_dump(mode="json")
    if values["serve"]["api_key"] is not None:
        values["serve"]["api_key"] = REDACTED
    return yaml.safe_dump(values, sort_keys=False)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        config = serve_config(args)
    except ConfigError as error:
        fail(error)
    if args.dry_run:
        sys.stdout.write(dump_config(config))  # the resolved config is the command's output
        return 0
    from cluster.serve import serve_forever

    serve_forever(config)
    return 0


def cmd_soak(args: argparse.Namespace) -> int:
    """Exit status 1 when the soak found a leak or the server stopped serving."""
    from cluster.bench.soak import format_soak_report, run_soak, soak_config_from_args
    from cluster.serve import shutdown, start_ray

    try:
        config = build_app_config(args.config, {("serve", "port"): args.port} if args.port is not None else {})
    except ConfigError as error:
        fail(error)
    soak = soak_config_from_args(args)
    owns_ray = start_ray(config)
    try:
        report = run_soak(config, soak)
    finally:
        shutdown(config, grace_s=10.0, owns_ray=owns_ray)
    print(format_soak_report(report))  # the report is the command's output
    return 0 if report["passed"] else 1


def add_log_level(parser: argparse.ArgumentParser, default: Any) -> None:
    parser.add_argument(
        "--log-level",
        type=str.lower,
        choices=list(LOG_LEVELS),
        default=default,
        help="Log level of this process, uvicorn's names (default: info).",
    )


def add_serve_parser(commands: Any) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve the OpenAI API on Ray Serve until Ctrl-C",
        description="Serve MODEL's OpenAI API on Ray Serve until Ctrl-C. Flags are named as vLLM's `vllm serve` "
        "names them and override the --config YAML, which overrides the defaults; every config key has one.",
        usage="%(prog)s [MODEL] [options]",
        formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=40),
    )
    serve.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="A model alias (see `pagedserve fetch-model`), a local HF directory or a hub id org/name[@revision]; "
        "the same as --model.",
    )
    serve.add_argument(
        "--config",
        default=None,
        help="A YAML file of config sections (a path, or a preset name under configs/); flags override it.",
    )
    serve.add_argument(
        "--dry-run",
        action="store_true",
        help="Check the model and print the resolved config as YAML, then exit without starting Ray.",
    )
    # SUPPRESS: `pagedserve --log-level X serve` keeps X unless this one is given.
    add_log_level(serve, default=argparse.SUPPRESS)
    serve.set_defaults(handler=cmd_serve, config_flags=add_config_flags(serve))


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="pagedserve", description=__doc__)
    parser.add_argument("--version", action="version", version=package_version(), help="Print the version and exit.")
    add_log_level(parser, default="info")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    add_serve_parser(commands)

    fetch = commands.add_parser(
        "fetch-model",
        help="download a model alias (and convert it) or a hub id's snapshot, print its directory",
        description="Download MODEL and print its local directory (the last line). An alias is fetched and "
        "converted under $PAGEDSERVE_HOME; a Hugging Face hub id org/name[@revision] is downloaded (config, "
        "tokenizer and safetensors weights) into the hub cache, the one `pagedserve serve` reads.",
    )
    fetch.add_argument(
        "model",
        nargs="?",
        default="smollm2-135m-instruct",
        help="A model alias (smollm2-135m-instruct, gemma3-270m, tiny-random-llama) or a hub id "
        "org/name[@revision] (default: smollm2-135m-instruct).",
    )
    fetch.add_argument("--revision", default=None, help="Branch, tag or commit of a hub id (default: its main).")
    fetch.add_argument(
        "--download-dir", default=None, help="The hub cache to download into (default: $HF_HUB_CACHE, $HF_HOME/hub)."
    )
    fetch.set_defaults(handler=cmd_fetch_model)

    bench = commands.add_parser("bench-offline", help="LLM.generate vs HF transformers generate, same prompts")
    bench.add_argument("--model", default="smollm2-135m-instruct", help="alias or HF directory")
    bench.add_argument("--num-prompts", type=int, default=64, help="synthetic prompts, all submitted at once")
    bench.add_argument("--prompt-words", type=int, default=48, help="words per synthetic prompt")
    bench.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt (ignore_eos)")
    bench.add_argument("--max-num-seqs", type=int, default=64, help="the engine's scheduler.max_num_seqs")
    bench.add_argument(
        "--max-num-batched-tokens", type=int, default=512, help="the engine's scheduler.max_num_batched_tokens"
    )
    bench.add_argument("--hf-batch-sizes", default="8,16,32,64", help="static batch sizes tried for HF")
    bench.add_argument("--skip-hf", action="store_true", help="only measure pagedserve")
    bench.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    bench.add_argument("--output-json", default=None, help="also write the results to this JSON file")
    bench.set_defaults(handler=cmd_bench_offline)

    bench_serve = commands.add_parser("bench", help="online serving benchmark against an OpenAI-compatible endpoint")
    bench_serve.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the endpoint's /v1 URL")
    bench_serve.add_argument("--model", default=None, help="default: the first id from GET /models")
    bench_serve.add_argument(
        "--endpoint", choices=["completions", "chat"], default="completions", help="which API the requests use"
    )
    bench_serve.add_argument("--num-prompts", type=int, default=64, help="requests sent")
    bench_serve.add_argument("--input-len", type=int, default=48, help="random words per prompt (after the prefix)")
    bench_serve.add_argument("--output-len", type=int, default=64, help="max_tokens, sent with ignore_eos")
    bench_serve.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="in [0, 1): each request's max_tokens drawn uniformly from output-len * (1 -/+ ratio), as vllm's",
    )
    bench_serve.add_argument("--temperature", type=float, default=0.0, help="sent in every request; 0 is greedy")
    bench_serve.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson arrivals in req/s; inf sends all at once"
    )
    bench_serve.add_argument("--max-concurrency", type=int, default=None, help="default: unlimited")
    bench_serve.add_argument("--shared-prefix-words", type=int, default=0, help="same N-word prefix on every prompt")
    bench_serve.add_argument(
        "--seed", type=int, default=0, help="prompts and arrivals; change it between runs on a prefix-caching server"
    )
    bench_serve.add_argument("--output-json", default=None, help="also write the results to this JSON file")
    bench_serve.add_argument("--api-key", default=None, help="sent as a Bearer token")
    bench_serve.add_argument("--timeout", type=float, default=600.0, help="seconds per request before it fails")
    bench_serve.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed request")
    bench_serve.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    bench_serve.add_argument(
        "--baselines",
        action="store_true",
        help="after the HTTP run, time HF generate and our linear layers alone on the same prompts, print ratios",
    )
    bench_serve.add_argument(
        "--model-dir", default=None, help="HF directory of the served model (default: the served id, if an alias)"
    )
    bench_serve.add_argument(
        "--hf-batch-sizes", default="8,16,32", help="static batch sizes tried for HF, comma-separated"
    )
    bench_serve.add_argument(
        "--roofline-iterations", type=int, default=20, help="timed linears-only decode steps per batch size"
    )
    bench_serve.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="precision of the baselines, the one the server serves (auto: as the engine resolves it on this machine)",
    )
    bench_serve.set_defaults(handler=cmd_bench)

    soak = commands.add_parser(
        "soak", help="deploy, load past capacity with random disconnects, fail on leaked KV blocks or memory"
    )
    soak.add_argument("--config", default=None, help="a YAML preset (path, or a name under configs/)")
    soak.add_argument("--port", type=int, default=None, help="overrides serve.port")
    soak.add_argument("--duration-s", type=float, default=180.0, help="seconds of arrivals")
    soak.add_argument("--capacity-factor", type=float, default=1.5, help="offered load / measured capacity")
    soak.add_argument("--disconnect-fraction", type=float, default=0.2, help="requests that hang up at random")
    soak.add_argument("--input-len", type=int, default=32, help="random words per prompt")
    soak.add_argument("--output-len", type=int, default=64, help="max_tokens, sent with ignore_eos")
    soak.add_argument("--request-timeout-s", type=float, default=60.0, help="a client gives up after this")
    soak.add_argument("--max-rss-growth-mib", type=float, default=100.0, help="per process, else the soak fails")
    soak.add_argument("--seed", type=int, default=0, help="seed of prompts, arrivals and disconnects")
    soak.add_argument("--output-json", default=None, help="also write the report to this JSON file")
    soak.set_defaults(handler=cmd_soak)
    return parser


def subcommand_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return [option for action in parser._actions for option in action.option_strings]


def dashed_flags(argv: list[str]) -> list[str]:
    """`--max_num_seqs=4` -> `--max-num-seqs=4`: vLLM accepts either spelling of a flag."""
    dashed = []
    for arg in argv:
        if arg.startswith("--"):
            flag, equals, value = arg.partition("=")
            arg = flag.replace("_", "-") + equals + value
        dashed.append(arg)
    return dashed


def unrecognized(extras: list[str], candidates: list[str]) -> str:
    """Argparse's message, with the closest valid flag named for each unknown one (3.11's argparse names none)."""
    named = []
    for extra in extras:
        flag = extra.partition("=")[0]
        close = difflib.get_close_matches(flag, candidates, n=1) if flag.startswith("-") else []
        named.append(f"{flag} (did you mean {close[0]}?)" if close else extra)
    return f"unrecognized arguments: {' '.join(named)}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(dashed_flags(sys.argv[1:] if argv is None else argv))
    if extras:
        command = subcommand_parsers(parser).get(args.command)
        candidates = option_strings(parser) + (option_strings(command) if command is not None else [])
        parser.error(unrecognized(extras, candidates))
    logging.basicConfig(level=LOG_LEVELS[args.log_level], format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
