"""`pagedserve soak`: deploy the app, drive it past capacity with random disconnects for a bounded time, and fail
if anything leaks.

1. Deploy (embedded Ray, or RAY_ADDRESS) and warm up.
2. Measure capacity: a burst of `2 x max_num_seqs` streamed requests at once, completed requests per second.
3. Load: Poisson arrivals at `capacity_factor x capacity` for `duration_s`, through the `pagedserve bench` client
   (`cluster.bench.client.send_request`); a `disconnect_fraction` of them hang up at a random moment (queued or
   mid-stream), the rest give up after `request_timeout_s`.
4. After the load: the engine must be idle again with every KV block free, no per-request state left in the
   engine or the ingress, a normal request must succeed, and neither the scheduler actor's nor the ingress
   replica's resident memory may grow by more than `max_rss_growth_mib`.

`run_soak` returns the report (a dict, `passed` included); the CLI prints it and exits 1 when the soak failed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import random
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from cluster.bench.client import RequestRecord, client_session, first_model_id, send_request
from cluster.bench.config import BenchConfig
from cluster.bench.workload import synthetic_prompts
from configs.app_config import AppConfig
from executor.outputs import EngineStats

logger = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 120.0
RAY_CALL_TIMEOUT_S = 30.0


@dataclass
class SoakConfig:
    """Soak settings; the CLI flags of `pagedserve soak` map one to one onto these fields."""

    duration_s: float = 180.0  # arrivals stop after this; requests in flight then finish or time out
    capacity_factor: float = 1.5  # offered load as a multiple of the measured capacity
    disconnect_fraction: float = 0.2  # requests that hang up at a random moment
    input_len: int = 32  # random words per prompt
    output_len: int = 64  # max_tokens, with ignore_eos
    request_timeout_s: float = 60.0  # a client gives up (and hangs up) after this
    max_rss_growth_mib: float = 100.0  # per process: the scheduler actor and the ingress replica
    seed: int = 0
    output_json: str | None = None


def request_outcome(record: RequestRecord) -> str:
    """'completed', or what went wrong: 'HTTP 503', 'stream 504', 'timeout', 'ReadError', ..."""
    if record.success:
        return "completed"
    if match := re.match(r"HTTP (\d+)", record.error):
        return f"HTTP {match.group(1)}"
    if record.error.startswith("error chunk: "):
        # The bench client keeps the chunk's first 500 characters: read the code, not the JSON.
        code = re.search(r'"code": (\d+)', record.error)
        return f"stream {code.group(1) if code else 'error'}"
    if record.error.startswith("timed out"):
        return "timeout"
    return record.error.split(":", 1)[0] or "unknown"


async def one_request(
    session: aiohttp.ClientSession,
    bench: BenchConfig,
    model: str,
    prompt: str,
    hang_up_after: float | None,
    origin: float,
) -> str:
    """Send one streamed request; hang up after `hang_up_after` seconds when given."""
    request = send_request(session, bench, model, prompt, bench.output_len, origin)
    if hang_up_after is None:
        return request_outcome(await request)
    try:
        # Cancelling the request closes its connection: the server sees a client that went away.
        return request_outcome(await asyncio.wait_for(request, hang_up_after))
    except TimeoutError:
        return "disconnected"


async def measure_capacity(session: aiohttp.ClientSession, bench: BenchConfig, model: str, burst: int) -> float:
    """Completed requests per second for a burst sent all at once (the engine's batch kept full)."""
    prompts = synthetic_prompts(burst, bench.input_len, bench.seed + 7)
    origin = time.perf_counter()
    records = await asyncio.gather(
        *(send_request(session, bench, model, prompt, bench.output_len, origin) for prompt in prompts)
    )
    elapsed = time.perf_counter() - origin
    completed = sum(record.success for record in records)
    if not completed:
        raise RuntimeError(f"no request of the capacity burst succeeded: {records[0].error}")
    return completed / elapsed


async def offer_load(
    session: aiohttp.ClientSession, bench: BenchConfig, model: str, soak: SoakConfig, rate: float
) -> tuple[Counter, float]:
    """Poisson arrivals at `rate` for `soak.duration_s`; returns the outcome counts and the load's wall time."""
    rng = random.Random(soak.seed)
    expected_s = max(1.0, soak.output_len / 20)  # a rough request length, to spread hang-ups over its life
    tasks: list[asyncio.Task] = []
    origin = time.perf_counter()
    deadline = origin + soak.duration_s
    index = 0
    while time.perf_counter() < deadline:
        prompt = synthetic_prompts(1, soak.input_len, soak.seed * 1_000_003 + index)[0]
        hang_up_after = rng.uniform(0.01, 2 * expected_s) if rng.random() < soak.disconnect_fraction else None
        tasks.append(asyncio.create_task(one_request(session, bench, model, prompt, hang_up_after, origin)))
        index += 1
        await asyncio.sleep(rng.expovariate(rate))
    outcomes = Counter(await asyncio.gather(*tasks))
    return outcomes, time.perf_counter() - origin


def wait_until_idle(engines: list[Any]) -> list[EngineStats]:
    """Every engine's stats once none runs or queues anything; raises TimeoutError after IDLE_TIMEOUT_S."""
    import ray

    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        stats = ray.get([engine.stats.remote() for engine in engines], timeout=RAY_CALL_TIMEOUT_S)
        if all(engine_stats.num_running == engine_stats.num_waiting == 0 for engine_stats in stats):
            return stats
        if time.monotonic() > deadline:
            raise TimeoutError(f"engines still busy after {IDLE_TIMEOUT_S:.0f} s: {stats}")
        time.sleep(0.5)


def ingress_state(app_name: str) -> dict[str, int]:
    """The ingress replica's per-request state and RSS, asked through the application's handle."""
    from ray import serve

    handle = serve.get_app_handle(app_name)
    if not handle.is_initialized:
        # Serve's throughput-optimized mode (the embedded Ray of `pagedserve soak`) defaults handles to routing on
        # the caller's running event loop; this is a sync process, so the router gets Serve's own loop thread.
        handle._init(_run_router_in_separate_loop=True)
    return handle.request_state.remote().result(timeout_s=RAY_CALL_TIMEOUT_S)


def snapshot(config: AppConfig, engines: list[Any]) -> dict[str, Any]:
    stats = wait_until_idle(engines)
    return {
        "free_blocks": sum(engine_stats.num_free_blocks for engine_stats in stats),
        "kv_blocks": sum(engine_stats.num_kv_blocks for engine_stats in stats),
        "engine_rss_mib": max(engine_stats.rss_bytes for engine_stats in stats) / 2**20,
        "engine_request_state": sum(
            engine_stats.num_tracked_requests + engine_stats.num_undelivered_outputs for engine_stats in stats
        ),
        "ingress": ingress_state(config.serve.app_name),
    }


async def soak_load(base_url: str, config: AppConfig, soak: SoakConfig) -> dict[str, Any]:
    """Warm-up, capacity, load, and the final normal request; the HTTP half of the soak."""
    bench = BenchConfig(
        base_url=base_url,
        input_len=soak.input_len,
        output_len=soak.output_len,
        timeout=soak.request_timeout_s,
        seed=soak.seed,
        disable_tqdm=True,
    )
    async with client_session(max_connections=None) as session:
        model = await first_model_id(session, base_url)
        capacity = await measure_capacity(session, bench, model, min(2 * config.scheduler.max_num_seqs, 64))
        rate = soak.capacity_factor * capacity
        logger.info("capacity %.2f req/s; offering %.2f req/s for %.0f s", capacity, rate, soak.duration_s)
        outcomes, load_s = await offer_load(session, bench, model, soak, rate)
        final = await send_request(session, bench, model, "one last ordinary request", 8, time.perf_counter())
    return {"model": model, "capacity": capacity, "rate": rate, "outcomes": outcomes, "load_s": load_s, "final": final}


def run_soak(config: AppConfig, soak: SoakConfig, base_url: str | None = None) -> dict[str, Any]:
    """Soak an application that is deployed (base_url given) or deploy it here; returns the report."""
    from cluster.serve import deploy, engine_actors

    if base_url is None:
        base_url = deploy(config)
    engines = engine_actors(config)
    asyncio.run(soak_load(base_url, config, dataclasses.replace(soak, duration_s=0.0)))  # warm-up pass
    before = snapshot(config, engines)
    load = asyncio.run(soak_load(base_url, config, soak))
    after = snapshot(config, engines)
    outcomes: Counter = load["outcomes"]
    errored = {name: count for name, count in sorted(outcomes.items()) if name not in ("completed", "disconnected")}
    rss_growth = {
        "engine": after["engine_rss_mib"] - before["engine_rss_mib"],
        "ingress": (after["ingress"]["rss_bytes"] - before["ingress"]["rss_bytes"]) / 2**20,
    }
    leftovers = after["engine_request_state"] + sum(
        after["ingress"][name] for name in ("detokenizers", "output_queues", "pending_aborts")
    )
    failures = []
    if after["free_blocks"] != before["free_blocks"] or after["free_blocks"] != after["kv_blocks"]:
        failures.append(f"KV blocks leaked: {before['free_blocks']} free before, {after['free_blocks']} after")
    if leftovers:
        failures.append(f"request state left: engine {after['engine_request_state']}, ingress {after['ingress']}")
    for process, growth in rss_growth.items():
        if growth > soak.max_rss_growth_mib:
            failures.append(f"{process} RSS grew {growth:.1f} MiB (bound {soak.max_rss_growth_mib:.0f})")
    if not load["final"].success:
        failures.append(f"a normal request after the soak failed: {load['final'].error}")
    report = {
        "model": load["model"],
        "duration_s": soak.duration_s,
        "load_s": load["load_s"],
        "capacity_req_per_s": load["capacity"],
        "offered_req_per_s": load["rate"],
        "requests_sent": sum(outcomes.values()),
        "completed": outcomes.get("completed", 0),
        "errored": errored,
        "disconnected": outcomes.get("disconnected", 0),
        "free_kv_blocks_before": before["free_blocks"],
        "free_kv_blocks_after": after["free_blocks"],
        "kv_blocks": after["kv_blocks"],
        "engine_rss_mib_before": before["engine_rss_mib"],
        "engine_rss_mib_after": after["engine_rss_mib"],
        "ingress_rss_mib_before": before["ingress"]["rss_bytes"] / 2**20,
        "ingress_rss_mib_after": after["ingress"]["rss_bytes"] / 2**20,
        "max_rss_growth_mib": soak.max_rss_growth_mib,
        "request_state_left": leftovers,
        "failures": failures,
        "passed": not failures,
    }
    if soak.output_json:
        path = Path(soak.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
    return report


def format_soak_report(report: dict[str, Any]) -> str:
    def row(label: str, value: Any) -> str:
        return f"{label:<44}{value}"

    lines = [
        "{s:=^64}".format(s=" pagedserve soak "),
        row("Model:", report["model"]),
        row("Load time (s):", f"{report['load_s']:.1f} (arrivals for {report['duration_s']:.0f})"),
        row("Capacity (req/s, measured):", f"{report['capacity_req_per_s']:.2f}"),
        row("Offered load (req/s):", f"{report['offered_req_per_s']:.2f}"),
        row("Requests sent:", report["requests_sent"]),
        row("Completed:", report["completed"]),
        row("Errored, by status:", json.dumps(report["errored"]) if report["errored"] else "none"),
        row("Disconnected by the client:", report["disconnected"]),
        row("Free KV blocks before / after:", f"{report['free_kv_blocks_before']} / {report['free_kv_blocks_after']}"),
        row(
            "Scheduler actor RSS before / after (MiB):",
            f"{report['engine_rss_mib_before']:.1f} / {report['engine_rss_mib_after']:.1f}",
        ),
        row(
            "Ingress replica RSS before / after (MiB):",
            f"{report['ingress_rss_mib_before']:.1f} / {report['ingress_rss_mib_after']:.1f}",
        ),
        row("RSS growth bound (MiB per process):", f"{report['max_rss_growth_mib']:.0f}"),
        row("Request state left behind:", report["request_state_left"]),
        row("Result:", "PASS" if report["passed"] else "FAIL"),
        *[f"  - {failure}" for failure in report["failures"]],
        "=" * 64,
    ]
    return "\n".join(lines)


def soak_config_from_args(args: Any) -> SoakConfig:
    names = {config_field.name for config_field in dataclasses.fields(SoakConfig)}
    values = {name: value for name, value in vars(args).items() if name in names and value is not None}
    soak = SoakConfig(**values)
    if soak.duration_s < 0 or not 0 <= soak.disconnect_fraction <= 1 or soak.capacity_factor <= 0:
        raise ValueError("duration_s >= 0, 0 <= disconnect_fraction <= 1 and capacity_factor > 0 are required")
    if not math.isfinite(soak.max_rss_growth_mib):
        raise ValueError("max_rss_growth_mib must be finite")
    return soak
