"""`pagedserve` command line: fetch-model, serve, bench (HTTP), bench-offline, soak."""

from __future__ import annotations

import argparse
import logging
import sys

logger = logging.getLogger("pagedserve")


def cmd_fetch_model(args: argparse.Namespace) -> int:
    from model_executor.model_fetch import resolve_model

    model_dir = resolve_model(args.model)
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


def cmd_serve(args: argparse.Namespace) -> int:
    from cluster.serve import serve_forever
    from configs.app_config import AppConfig

    config = AppConfig.from_yaml(args.config) if args.config else AppConfig()
    settings = (("host", args.host), ("port", args.port), ("api_key", args.api_key))
    overrides = {key: value for key, value in settings if value is not None}
    if overrides:
        config = config.model_copy(update={"serve": config.serve.model_copy(update=overrides)})
    serve_forever(config)
    return 0


def cmd_soak(args: argparse.Namespace) -> int:
    """Exit status 1 when the soak found a leak or the server stopped serving."""
    from cluster.bench.soak import format_soak_report, run_soak, soak_config_from_args
    from cluster.serve import shutdown, start_ray
    from configs.app_config import AppConfig

    config = AppConfig.from_yaml(args.config) if args.config else AppConfig()
    if args.port is not None:
        config = config.model_copy(update={"serve": config.serve.model_copy(update={"port": args.port})})
    soak = soak_config_from_args(args)
    owns_ray = start_ray(config)
    try:
        report = run_soak(config, soak)
    finally:
        shutdown(config, grace_s=10.0, owns_ray=owns_ray)
    print(format_soak_report(report))  # the report is the command's output
    return 0 if report["passed"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    commands = parser.add_subparsers(dest="command", required=True)

    fetch = commands.add_parser("fetch-model", help="download and convert a model alias, print its directory")
    fetch.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    fetch.set_defaults(handler=cmd_fetch_model)

    bench = commands.add_parser("bench-offline", help="LLM.generate vs HF transformers generate, same prompts")
    bench.add_argument("--model", default="smollm2-135m-instruct")
    bench.add_argument("--num-prompts", type=int, default=64)
    bench.add_argument("--prompt-words", type=int, default=48, help="words per synthetic prompt")
    bench.add_argument("--max-tokens", type=int, default=128)
    bench.add_argument("--max-num-seqs", type=int, default=64)
    bench.add_argument("--max-num-batched-tokens", type=int, default=512)
    bench.add_argument("--hf-batch-sizes", default="8,16,32,64", help="static batch sizes tried for HF")
    bench.add_argument("--skip-hf", action="store_true", help="only measure pagedserve")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--output-json", default=None)
    bench.set_defaults(handler=cmd_bench_offline)

    bench_serve = commands.add_parser("bench", help="online serving benchmark against an OpenAI-compatible endpoint")
    bench_serve.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    bench_serve.add_argument("--model", default=None, help="default: the first id from GET /models")
    bench_serve.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    bench_serve.add_argument("--num-prompts", type=int, default=64)
    bench_serve.add_argument("--input-len", type=int, default=48, help="random words per prompt (after the prefix)")
    bench_serve.add_argument("--output-len", type=int, default=64, help="max_tokens, sent with ignore_eos")
    bench_serve.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson arrivals in req/s; inf sends all at once"
    )
    bench_serve.add_argument("--max-concurrency", type=int, default=None, help="default: unlimited")
    bench_serve.add_argument("--shared-prefix-words", type=int, default=0, help="same N-word prefix on every prompt")
    bench_serve.add_argument(
        "--seed", type=int, default=0, help="prompts and arrivals; change it between runs on a prefix-caching server"
    )
    bench_serve.add_argument("--output-json", default=None)
    bench_serve.add_argument("--api-key", default=None, help="sent as a Bearer token")
    bench_serve.add_argument("--timeout", type=float, default=600.0, help="seconds per request before it fails")
    bench_serve.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed request")
    bench_serve.add_argument("--disable-tqdm", action="store_true")
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
    bench_serve.set_defaults(handler=cmd_bench)

    serve = commands.add_parser("serve", help="serve the OpenAI API on Ray Serve until Ctrl-C")
    serve.add_argument("--config", default=None, help="a YAML preset (path, or a name under configs/)")
    serve.add_argument("--host", default=None, help="overrides serve.host")
    serve.add_argument("--port", type=int, default=None, help="overrides serve.port")
    serve.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (also $PAGEDSERVE_API_KEY)")
    serve.set_defaults(handler=cmd_serve)

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
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--output-json", default=None)
    soak.set_defaults(handler=cmd_soak)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
