"""vLLM's periodic engine stats line: what it says about a real engine, silence when idle, and the scheduler actor
logging it on its own timer."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import pytest
import ray

from configs.engine_config import EngineConfig
from configs.sampling_params import SamplingParams
from executor.engine_actor import EngineActor
from executor.stats_logger import (
    DEFAULT_STATS_LOG_INTERVAL_S,
    STATS_LOG_INTERVAL_ENV,
    LoggingStatLogger,
    stats_log_interval_s,
)

STATS_LINE = re.compile(
    r"Engine (?P<engine>\d{3}): Avg prompt throughput: (?P<prompt>[\d.]+) tokens/s, "
    r"Avg generation throughput: (?P<generation>[\d.]+) tokens/s, Running: (?P<running>\d+) reqs, "
    r"Waiting: (?P<waiting>\d+) reqs, (?P<device>CPU|GPU) KV cache usage: (?P<kv>[\d.]+)%, "
    r"Prefix cache hit rate: (?P<hits>[\d.]+)%"
    r"(, Draft acceptance rate: (?P<rate>[\d.]+)% \((?P<accepted>\d+) of (?P<drafted>\d+) drafts\))?$"
)


def stats_records(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "executor.stats_logger"]


def test_the_line_reports_the_interval_and_nothing_when_idle(make_llm, tiny_model_dir, caplog):
    llm = make_llm(tiny_model_dir, block_size=4)
    core = llm.engine.core
    stats_logger = LoggingStatLogger()
    caplog.set_level(logging.INFO, logger="executor.stats_logger")
    assert stats_logger.log(core) is None  # nothing ran yet

    # Two requests with the same 8-token prompt: the second finds the first's two full blocks cached.
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    llm.generate([prompt, prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    line = stats_logger.log(core)
    assert stats_records(caplog) == [line]
    fields = STATS_LINE.fullmatch(line)
    assert fields is not None, line
    assert fields["engine"] == "000" and fields["device"] == "CPU"
    assert float(fields["prompt"]) > 0 and float(fields["generation"]) > 0
    assert (fields["running"], fields["waiting"], fields["kv"]) == ("0", "0", "0.0")
    assert float(fields["hits"]) > 0
    assert fields["rate"] is None  # no speculative decoding, no draft figures

    # Idle since the last line: nothing is logged.
    assert stats_logger.log(core) is None
    assert len(stats_records(caplog)) == 1

    # A request still running is reported, with its KV blocks in use.
    llm.engine.add_request("running", [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True))
    llm.engine.step()
    llm.engine.step()
    fields = STATS_LINE.fullmatch(stats_logger.log(core))
    assert fields["running"] == "1" and float(fields["kv"]) > 0
    assert float(fields["generation"]) > 0
    llm.engine.abort_request(["running"])


def test_speculative_decoding_adds_the_draft_acceptance_rate(make_llm, tiny_model_dir):
    llm = make_llm(tiny_model_dir, speculative_config={"num_speculative_tokens": 3, "disable_by_batch_size": None})
    stats_logger = LoggingStatLogger(engine_index=2)
    # A repeating prompt: n-gram lookup always finds a continuation to propose.
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.generate([[5, 6, 7] * 6], params, use_tqdm=False)
    fields = STATS_LINE.fullmatch(stats_logger.log(llm.engine.core))
    assert fields is not None and fields["engine"] == "002"
    stats = llm.engine.core.stats()
    assert int(fields["drafted"]) == stats.num_draft_tokens > 0
    assert int(fields["accepted"]) == stats.num_accepted_draft_tokens
    assert float(fields["rate"]) == pytest.approx(100 * stats.num_accepted_draft_tokens / stats.num_draft_tokens, 0.1)


def test_the_interval_comes_from_the_environment(monkeypatch, caplog):
    monkeypatch.delenv(STATS_LOG_INTERVAL_ENV, raising=False)
    assert stats_log_interval_s() == DEFAULT_STATS_LOG_INTERVAL_S == 10.0
    monkeypatch.setenv(STATS_LOG_INTERVAL_ENV, "0.5")
    assert stats_log_interval_s() == 0.5
    for bad in ("soon", "0", "-3", "nan", "inf"):
        monkeypatch.setenv(STATS_LOG_INTERVAL_ENV, bad)
        caplog.clear()
        assert stats_log_interval_s() == DEFAULT_STATS_LOG_INTERVAL_S
        assert STATS_LOG_INTERVAL_ENV in caplog.text


def actor_log_file(pid: int) -> Path:
    """The stderr file Ray writes for the worker process `pid` of this session."""
    logs_dir = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    (path,) = logs_dir.glob(f"worker-*-{pid}.err")
    return path


def stats_lines(path: Path) -> list[str]:
    return [line for line in path.read_text(errors="replace").splitlines() if "Avg prompt throughput" in line]


def test_the_scheduler_actor_logs_while_busy_and_is_silent_when_idle(ray_cluster, tiny_model_dir):
    interval_s = 0.5
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, worker_num_cpus=0.5, num_threads=1)
    engine = (
        ray.remote(EngineActor)
        .options(num_cpus=0, runtime_env={"env_vars": {STATS_LOG_INTERVAL_ENV: str(interval_s)}})
        .remote(config)
    )
    try:
        ray.get(engine.engine_info.remote(), timeout=120)
        log_file = actor_log_file(ray.get(engine.topology.remote(), timeout=30).engine_pid)
        time.sleep(3 * interval_s)
        assert stats_lines(log_file) == []  # started, but nothing to do yet

        params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
        ray.get(engine.add_request.remote("client", "busy", [5, 6, 7], params), timeout=30)
        deadline = time.monotonic() + 60
        while not any(
            (fields := STATS_LINE.search(line)) and fields["running"] == "1" and float(fields["generation"]) > 0
            for line in stats_lines(log_file)
        ):
            assert time.monotonic() < deadline, f"no stats line of the running request: {stats_lines(log_file)}"
            outputs = ray.get(engine.get_outputs.remote("client"), timeout=30)
            assert not any(output.finish_reason for output in outputs), "finished before a stats line showed it"
        assert all(STATS_LINE.search(line) for line in stats_lines(log_file))
        ray.get(engine.abort.remote(["busy"]), timeout=30)

        # Idle: at most the line of the interval the request ended in, then silence.
        time.sleep(2 * interval_s)
        settled = len(stats_lines(log_file))
        time.sleep(4 * interval_s)
        assert len(stats_lines(log_file)) == settled
    finally:
        ray.get(engine.shutdown.remote(), timeout=30)
        ray.kill(engine)
