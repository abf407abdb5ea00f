"""Ray job entry points: `python -m cluster.job deploy|batch --config configs/X.yaml ...`.

Run them with `ray job submit --address http://HEAD:8265 --working-dir . -- python -m cluster.job ...`; inside a
job, Ray sets RAY_ADDRESS and this attaches to that cluster; run by hand, it starts an embedded Ray.

- deploy: deploys (or updates) the Serve application and exits once it answers.
- batch: an OpenAI Batch API input file run offline, through the same ingress and engine actors as HTTP (via a Serve
  DeploymentHandle, no HTTP hop). Each input line is `{"custom_id", "method": "POST", "url": "/v1/chat/completions"
  or "/v1/completions", "body"}`; each result is one output line `{"id", "custom_id", "response": {"status_code",
  "request_id", "body"}, "error"}`, appended as it finishes (so in completion order: match lines by custom_id). A
  request the server refused keeps its status and OpenAI error body in `response`; a line that is no request (not
  JSON, no custom_id, unknown url) gets `response: null` and `error: {code, message, line}`. The input is streamed
  with a bounded window of requests in flight. A rerun with the same --output skips the custom_ids that succeeded
  and runs the failed ones again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from configs.app_config import AppConfig

logger = logging.getLogger("pagedserve.job")

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
BATCH_URLS = (CHAT, COMPLETIONS)
# Requests in flight per engine slot: enough that the engine's queue never runs dry between two results.
WINDOW_PER_SEQ = 2
# Without a terminal (a job log) the bar prints whole lines.
LOG_BAR_FORMAT = "{desc}: {n_fmt}/{total_fmt} requests [{elapsed}<{remaining}{postfix}]\n"


class BatchLineError(ValueError):
    """An input line that is no request: reported on its own output line, the job goes on."""

    def __init__(self, code: str, message: str, custom_id: str | None = None):
        super().__init__(message)
        self.code = code
        self.custom_id = custom_id


class BatchInputError(ValueError):
    """The input as a whole cannot run (a duplicate custom_id, no requests): the job stops before it sends any."""


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


def parse_line(line: str | bytes, line_number: int) -> tuple[str, str, dict[str, Any]]:
    """(custom_id, url, body) of one OpenAI Batch input line, or BatchLineError saying what is wrong with it."""
    try:
        entry = json.loads(line)
    except ValueError as error:  # JSONDecodeError, or bytes that are not UTF-8
        raise BatchLineError("invalid_json", f"line {line_number} is not JSON: {error}") from None
    if not isinstance(entry, dict):
        raise BatchLineError("invalid_request", f"line {line_number} is a JSON {type(entry).__name__}, not an object")
    custom_id = entry.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BatchLineError(
            "missing_custom_id",
            f"line {line_number} has no custom_id (a non-empty string); each line is an OpenAI Batch request "
            '{"custom_id": ..., "method": "POST", "url": ..., "body": {...}}',
        )
    method = entry.get("method", "POST")
    if method != "POST":
        raise BatchLineError("invalid_method", f"line {line_number}: method must be POST, not {method!r}", custom_id)
    url = entry.get("url")
    if url not in BATCH_URLS:
        raise BatchLineError(
            "invalid_url", f"line {line_number}: url must be one of {list(BATCH_URLS)}, not {url!r}", custom_id
        )
    body = entry.get("body")
    if not isinstance(body, dict):
        raise BatchLineError("invalid_body", f"line {line_number}: body must be a JSON object (the request)", custom_id)
    return custom_id, url, body


def batch_record(
    custom_id: str | None, response: dict[str, Any] | None = None, error: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One output line, OpenAI's BatchRequestOutput."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}


def request_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line) of every non-blank line, read lazily."""
    with path.open("rb") as lines:
        for line_number, line in enumerate(lines, 1):
            if line.strip():
                yield line_number, line


def line_custom_id(line: bytes, line_number: int) -> str | None:
    try:
        return parse_line(line, line_number)[0]
    except BatchLineError as error:
        return error.custom_id


def first_line_of(path: Path, custom_id: str) -> int:
    return next(number for number, line in request_lines(path) if line_custom_id(line, number) == custom_id)


def succeeded_custom_id(line: bytes) -> str | None:
    """The custom_id of an output line that records a 200 response; None for a failure or a line cut short."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("error") is not None:
        return None
    response, custom_id = record.get("response"), record.get("custom_id")
    if not isinstance(response, dict) or response.get("status_code") != 200 or not isinstance(custom_id, str):
        return None
    return custom_id


def kept_output_lines(output: Path) -> Iterator[tuple[str | None, bytes]]:
    """(custom_id, line) of each line of an earlier run's output, custom_id None where the line is to be dropped: a
    failure (it runs again), a line a kill cut short, a custom_id seen already."""
    seen: set[str] = set()
    with output.open("rb") as lines:
        for line in lines:
            custom_id = succeeded_custom_id(line)
            if custom_id is not None and custom_id not in seen:
                seen.add(custom_id)
                yield custom_id, line
            else:
                yield None, line


def read_done(output: Path) -> tuple[set[str], bool]:
    """custom_ids an earlier run with this output finished, and whether the file holds other lines (failures, a line
    a kill cut short) to drop before this run appends."""
    done: set[str] = set()
    dropped = 0
    ends_with_newline = True
    if output.exists():
        for custom_id, line in kept_output_lines(output):
            ends_with_newline = line.endswith(b"\n")
            if custom_id is None:
                dropped += 1
            else:
                done.add(custom_id)
        logger.info("%s: %d custom_ids done in earlier runs, %d failed or cut lines", output, len(done), dropped)
    return done, bool(dropped) or not ends_with_newline


def drop_unfinished(output: Path) -> None:
    """Streams the earlier output into a file of its succeeded lines only, so that each custom_id run again is
    appended once."""
    staging = output.with_name(output.name + ".tmp")
    with staging.open("wb") as kept:
        for custom_id, line in kept_output_lines(output):
            if custom_id is not None:
                kept.write(line if line.endswith(b"\n") else line + b"\n")
    os.replace(staging, output)


@dataclass
class BatchPlan:
    """What a run will do, known before it sends anything."""

    input_path: Path
    output: Path
    requests: int
    done: set[str]
    already_done: int


def plan_batch(input_path: Path, output: Path) -> BatchPlan:
    """One streaming pass over the input before any request runs: counts the requests (the progress bar's total)
    and refuses a duplicate custom_id, as OpenAI refuses such a file, since results are matched (and resumed) by it."""
    if not input_path.is_file():
        raise BatchInputError(f"--input {input_path}: no such file")
    if not output.parent.is_dir():
        raise BatchInputError(f"--output {output}: directory {output.parent} does not exist")
    if output.exists() and output.resolve() == input_path.resolve():
        raise BatchInputError("--output must not be the --input file")
    done, has_unfinished = read_done(output)
    logger.info("reading %s (%.1f MiB)", input_path, input_path.stat().st_size / 2**20)
    seen: set[str] = set()
    requests = already_done = 0
    for line_number, line in request_lines(input_path):
        requests += 1
        custom_id = line_custom_id(line, line_number)
        if custom_id is None:
            continue
        if custom_id in seen:
            first = first_line_of(input_path, custom_id)
            raise BatchInputError(
                f"duplicate custom_id {custom_id!r} on lines {first} and {line_number} of {input_path}: "
                "each request needs its own custom_id"
            )
        seen.add(custom_id)
        already_done += custom_id in done
    if not requests:
        raise BatchInputError(f"--input {input_path} has no requests")
    if has_unfinished:
        drop_unfinished(output)
    return BatchPlan(input_path, output, requests, done, already_done)


class BatchProgress:
    """tqdm on stderr: requests done / total, and output tokens per second of this run."""

    def __init__(self, total: int, initial: int):
        interactive = sys.stderr.isatty()
        self.bar = tqdm(
            total=total,
            initial=initial,
            desc="batch",
            unit="req",
            file=sys.stderr,
            dynamic_ncols=True,
            # In a job log, fewer updates.
            mininterval=0.5 if interactive else 10.0,
            bar_format=None if interactive else LOG_BAR_FORMAT,
        )
        self.start = time.monotonic()
        self.generated_tokens = 0

    def finished(self, generated_tokens: int) -> None:
        self.generated_tokens += generated_tokens
        self.bar.set_postfix_str(f"{self.tokens_per_s():.1f} tok/s", refresh=False)
        self.bar.update(1)

    def tokens_per_s(self) -> float:
        return self.generated_tokens / max(time.monotonic() - self.start, 1e-6)

    def close(self) -> None:
        self.bar.close()


def completion_tokens(record: dict[str, Any]) -> int:
    response = record["response"]
    if response is None or response["status_code"] != 200:
        return 0
    return int((response["body"].get("usage") or {}).get("completion_tokens") or 0)


async def send(handle: Any, custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One request through the ingress: its HTTP status and body, or an error where no response came back."""
    try:
        status, response_body = await handle.process_body.remote(url, body)
    except Exception as error:  # the replica or Ray failed: no HTTP response exists
        return batch_record(custom_id, error={"code": "request_failed", "message": f"{type(error).__name__}: {error}"})
    response = {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}", "body": response_body}
    return batch_record(custom_id, response=response)


async def run_batch(handle: Any, plan: BatchPlan, max_concurrency: int) -> dict[str, Any]:
    """Streams the input through `handle` with at most `max_concurrency` requests in flight, appending each result
    to the output as it finishes."""
    logger.info(
        "batch: %d requests, %d done in earlier runs, %d to run, %d in flight at most",
        plan.requests,
        plan.already_done,
        plan.requests - plan.already_done,
        max_concurrency,
    )
    window = asyncio.Semaphore(max_concurrency)
    counts = {"succeeded": 0, "failed": 0}
    progress = BatchProgress(plan.requests, plan.already_done)

    with plan.output.open("a", encoding="utf-8") as output:

        def write(record: dict[str, Any]) -> None:
            # One write and a flush per result: a kill loses at most the line being written.
            output.write(json.dumps(record) + "\n")
            output.flush()
            ok = record["error"] is None and record["response"]["status_code"] == 200
            counts["succeeded" if ok else "failed"] += 1
            progress.finished(completion_tokens(record))

        async def run_one(custom_id: str, url: str, body: dict[str, Any]) -> None:
            try:
                record = await send(handle, custom_id, url, body)
            finally:
                window.release()
            write(record)

        try:
            # A result that cannot be written (disk full) cancels the rest and ends the job; the group keeps only the
            # tasks still running.
            async with asyncio.TaskGroup() as in_flight:
                for line_number, line in request_lines(plan.input_path):
                    try:
                        custom_id, url, body = parse_line(line, line_number)
                    except BatchLineError as error:
                        if error.custom_id not in plan.done:
                            error_info = {"code": error.code, "message": str(error), "line": line_number}
                            write(batch_record(error.custom_id, error=error_info))
                        continue
                    if custom_id in plan.done:
                        continue
                    await window.acquire()
                    in_flight.create_task(run_one(custom_id, url, body))
        finally:
            progress.close()
    summary = {
        "requests": plan.requests,
        "already_done": plan.already_done,
        **counts,
        "generated_tokens": progress.generated_tokens,
        "tokens_per_s": round(progress.tokens_per_s(), 1),
    }
    logger.info("batch finished: %s -> %s", summary, plan.output)
    if counts["failed"]:
        logger.warning("%d requests failed (errors in %s); a rerun runs them again", counts["failed"], plan.output)
    return summary


def app_handle(config: AppConfig) -> Any:
    """A handle to the application: the one under serve.app_name as it is (a RayService's, or one `deploy` made),
    else one deployed from `config`."""
    from ray import serve

    name = config.serve.app_name
    app = serve.status().applications.get(name)
    # Deploying over an app that is coming up or unhealthy would replace someone else's configuration.
    if app is not None and app.status not in ("NOT_STARTED", "DEPLOY_FAILED", "DELETING"):
        logger.info("application %r is %s: the batch uses it as deployed", name, app.status.value)
    else:
        deploy(config)
    return serve.get_app_handle(name)


def default_max_concurrency(config: AppConfig) -> int:
    return WINDOW_PER_SEQ * config.scheduler.max_num_seqs * config.serve.engine_replicas


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.job", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    deploy_parser = commands.add_parser("deploy", help="deploy or update the Serve application, exit when healthy")
    deploy_parser.add_argument("--config", default=None)
    batch_parser = commands.add_parser("batch", help="run an OpenAI Batch API input file (JSONL) offline")
    batch_parser.add_argument("--config", default=None, help="deploys this app unless serve.app_name is running")
    batch_parser.add_argument("--input", required=True, type=Path, help="OpenAI Batch input JSONL")
    batch_parser.add_argument("--output", required=True, type=Path, help="results JSONL; a rerun resumes it")
    batch_parser.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help=f"requests in flight at most (default {WINDOW_PER_SEQ} x scheduler.max_num_seqs x serve.engine_replicas)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config)
    except (OSError, ValueError) as error:
        parser.exit(2, f"error: --config {args.config}: {' '.join(str(error).split())}\n")
    from cluster.serve import start_ray

    if args.command == "deploy":
        start_ray(config)
        deploy(config)
        return 0
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.exit(2, "error: --max-concurrency must be at least 1\n")
    try:
        # Before Ray starts: a bad input fails in seconds, not after a deploy.
        plan = plan_batch(args.input, args.output)
    except BatchInputError as error:
        parser.exit(2, f"error: {error}\n")
    start_ray(config)
    handle = app_handle(config)
    asyncio.run(run_batch(handle, plan, args.max_concurrency or default_max_concurrency(config)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
