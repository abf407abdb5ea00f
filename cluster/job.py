"""Ray job entry points: `python -m cluster.job deploy|batch --config configs/X.yaml ...`.

Run them with `ray job submit --address http://HEAD:8265 --working-dir . -- python -m cluster.job ...`; inside a
job, Ray sets RAY_ADDRESS and this attaches to that cluster; run by hand, it starts an embedded Ray.

- deploy: deploys (or updates) the Serve application and exits once it answers.
- batch: offline inference over a JSONL file of OpenAI request bodies, through the same ingress and engine
  actors as HTTP (via a Serve DeploymentHandle, no HTTP hop). Results are written in input order; a failing line
  is recorded with its error instead of killing the job; a rerun skips lines already done.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from configs.app_config import AppConfig

logger = logging.getLogger("pagedserve.job")

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def load_config(path: str | None) -> AppConfig:
    config = AppConfig.from_yaml(path) if path else AppConfig()
    if os.environ.get("RAY_ADDRESS"):
        # In a cluster the HTTP proxy must listen beyond localhost.
        config = config.model_copy(update={"serve": config.serve.model_copy(update={"host": "0.0.0.0"})})
    return config


def deploy(config: AppConfig) -> str:
    from cluster.serve import deploy as deploy_app

    url = deploy_app(config)
    logger.info("deployed %s: %s", config.serve.app_name, url)
    return url


def parse_line(line: str, index: int) -> tuple[str, str, dict[str, Any]]:
    """(id, route, body) from a JSONL line: an OpenAI request body, or an OpenAI Batch API entry
    (`{"custom_id", "url", "body"}`). The route follows `url`, or `messages` (chat) vs `prompt` (completions)."""
    entry = json.loads(line)
    if not isinstance(entry, dict):
        raise ValueError("each line must be a JSON object")
    body = entry.get("body", entry) if isinstance(entry.get("body"), dict) else entry
    body = {key: value for key, value in body.items() if key not in ("custom_id", "id", "url", "method")}
    request_id = str(entry.get("custom_id") or entry.get("id") or f"line-{index}")
    route = entry.get("url") or (CHAT if "messages" in body else COMPLETIONS)
    return request_id, route, body


def read_done(output: Path) -> dict[int, dict[str, Any]]:
    """Successful results of earlier runs (final file and the in-progress journal), by input line index."""
    done: dict[int, dict[str, Any]] = {}
    for path in (output, journal_path(output)):
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            if record.get("error") is None:
                done[record["index"]] = record
    return done


def journal_path(output: Path) -> Path:
    return output.with_name(output.name + ".partial")


async def run_batch(config: AppConfig, input_path: Path, output: Path, max_concurrency: int) -> dict[str, int]:
    from ray import serve

    deploy(config)
    handle = serve.get_app_handle(config.serve.app_name)
    lines = [line for line in input_path.read_text().splitlines() if line.strip()]
    results = read_done(output)
    pending = [index for index in range(len(lines)) if index not in results]
    logger.info("%d lines, %d already done, %d to run", len(lines), len(results), len(pending))
    journal = journal_path(output).open("a")
    semaphore = asyncio.Semaphore(max_concurrency)
    progress = tqdm(total=len(lines), initial=len(results), desc="batch", unit="req", file=sys.stderr)

    async def run_one(index: int) -> None:
        record: dict[str, Any] = {"index": index}
        try:
            request_id, route, body = parse_line(lines[index], index)
            record["id"] = request_id
            async with semaphore:
                status, response = await handle.process_body.remote(route, body)
            record["status"] = status
            if status == 200:
                record["response"], record["error"] = response, None
            else:
                record["error"] = response.get("error", response)
        except Exception as error:  # one bad line must not kill the job
            record.setdefault("id", f"line-{index}")
            record["error"] = {"message": f"{type(error).__name__}: {error}", "type": "BatchLineError"}
        results[index] = record
        journal.write(json.dumps(record) + "\n")
        journal.flush()
        progress.update(1)

    try:
        await asyncio.gather(*(run_one(index) for index in pending))
    finally:
        journal.close()
        progress.close()
    staging = output.with_name(output.name + ".tmp")
    with staging.open("w") as output_file:
        for index in sorted(results):
            output_file.write(json.dumps(results[index]) + "\n")
    os.replace(staging, output)
    journal_path(output).unlink(missing_ok=True)
    failed = sum(1 for record in results.values() if record.get("error") is not None)
    summary = {"lines": len(lines), "ran": len(pending), "failed": failed, "succeeded": len(results) - failed}
    logger.info("batch finished: %s -> %s", summary, output)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.job", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    deploy_parser = commands.add_parser("deploy", help="deploy or update the Serve application, exit when healthy")
    deploy_parser.add_argument("--config", default=None)
    batch_parser = commands.add_parser("batch", help="offline inference over a JSONL of OpenAI request bodies")
    batch_parser.add_argument("--config", default=None)
    batch_parser.add_argument("--input", required=True, type=Path)
    batch_parser.add_argument("--output", required=True, type=Path)
    batch_parser.add_argument("--max-concurrency", type=int, default=64)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(args.config)
    from cluster.serve import start_ray

    start_ray(config)
    if args.command == "deploy":
        deploy(config)
        return 0
    summary = asyncio.run(run_batch(config, args.input, args.output, args.max_concurrency))
    return 0 if summary["lines"] else 1


if __name__ == "__main__":
    sys.exit(main())
