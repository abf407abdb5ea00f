"""The linear kernel's crossover against oneDNN: how it is decided, measured and cached per machine."""

from __future__ import annotations

import json

import pytest
import torch

from cuda_ext import cpu_ops, linear_crossover
from cuda_ext.linear_crossover import OVERRIDE_ENV, crossover_rows, kernel_max_rows, measure_kernel_max_rows

pytestmark = pytest.mark.skipif(cpu_ops.load_cpu_ops() is None, reason="needs a C++ compiler for the CPU kernels")


def test_the_crossover_is_the_last_row_count_of_an_unbroken_run_of_wins() -> None:
    # (rows, oneDNN ms, ours ms), unordered: a win past the first loss (noise at 64) does not extend the run.
    timings = [(16, 10.0, 11.0), (1, 10.0, 7.0), (64, 10.0, 9.0), (8, 10.0, 10.0)]
    assert crossover_rows(timings) == 8
    assert crossover_rows([(1, 5.0, 6.0), (8, 5.0, 4.0)]) == 0
    assert crossover_rows([(1, 5.0, 4.0), (8, 5.0, 4.0)]) == 8
    # Within the tie margin (5%) ours still counts: 10.4 against 10 is a tie, 10.6 a loss.
    assert crossover_rows([(1, 10.0, 7.0), (8, 10.0, 10.4), (16, 10.0, 10.6)]) == 8


def test_measuring_times_both_paths_and_stops_after_the_first_loss() -> None:
    rows, timings = measure_kernel_max_rows(
        cpu_ops.load_cpu_ops(), shapes=[(256, 128), (128, 256)], row_counts=(4, 1, 2, 8), repeats=3
    )
    assert [count for count, _, _ in timings] == [1, 2, 4, 8][: len(timings)]
    assert all(onednn > 0 and ours > 0 for _, onednn, ours in timings)
    assert rows == crossover_rows(timings)
    # No count measured but the last was a loss; the last is either not one or where it stopped.
    assert not any(linear_crossover.loses(onednn, ours) for _, onednn, ours in timings[:-1])
    assert len(timings) == 4 or linear_crossover.loses(timings[-1][1], timings[-1][2])


@pytest.fixture
def fresh_crossover(monkeypatch, tmp_path):
    """kernel_max_rows with its in-process memo cleared and its on-disk cache in tmp_path."""
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    monkeypatch.setattr(cpu_ops, "build_directory", lambda: tmp_path)
    kernel_max_rows.cache_clear()
    yield tmp_path / linear_crossover.CACHE_FILE
    kernel_max_rows.cache_clear()


def test_a_cached_crossover_is_used_for_this_thread_count(fresh_crossover) -> None:
    threads = torch.get_num_threads()
    kernels = linear_crossover.kernel_source_hash()
    fresh_crossover.write_text(json.dumps({"kernels": kernels, str(threads): 5, str(threads + 1): 77}))
    assert kernel_max_rows(cpu_ops.load_cpu_ops()) == 5


def test_a_crossover_measured_with_other_kernels_is_measured_again(fresh_crossover, monkeypatch) -> None:
    threads = str(torch.get_num_threads())
    fresh_crossover.write_text(json.dumps({"kernels": "an older build", threads: 5}))
    monkeypatch.setattr(linear_crossover, "measure_kernel_max_rows", lambda ops: (40, [(40, 1.0, 1.0)]))
    assert kernel_max_rows(cpu_ops.load_cpu_ops()) == 40
    assert json.loads(fresh_crossover.read_text()) == {"kernels": linear_crossover.kernel_source_hash(), threads: 40}


def test_a_missing_crossover_is_measured_once_and_cached(fresh_crossover, monkeypatch) -> None:
    calls = []

    def measure(ops):
        calls.append(ops)
        return 24, [(24, 1.0, 0.9), (32, 1.0, 1.1)]

    monkeypatch.setattr(linear_crossover, "measure_kernel_max_rows", measure)
    ops = cpu_ops.load_cpu_ops()
    assert kernel_max_rows(ops) == 24
    cached = {"kernels": linear_crossover.kernel_source_hash(), str(torch.get_num_threads()): 24}
    assert json.loads(fresh_crossover.read_text()) == cached
    kernel_max_rows.cache_clear()
    assert kernel_max_rows(ops) == 24  # from the file this time
    assert len(calls) == 1


def test_the_environment_overrides_the_measurement(fresh_crossover, monkeypatch) -> None:
    monkeypatch.setenv(OVERRIDE_ENV, "3")
    assert kernel_max_rows(cpu_ops.load_cpu_ops()) == 3
    assert not fresh_crossover.exists()


def test_linears_take_our_kernel_up_to_the_crossover_and_onednn_past_it(fresh_crossover, monkeypatch) -> None:
    from model_executor.layers.linear import apply_linear, pack_weight_for_cpu

    monkeypatch.setenv(OVERRIDE_ENV, "4")
    ops = cpu_ops.load_cpu_ops()
    used, linear_tokens = [], ops.linear_tokens

    def recording_linear_tokens(out, x, weight):
        used.append(x.shape[0])
        return linear_tokens(out, x, weight)

    monkeypatch.setattr(ops, "linear_tokens", recording_linear_tokens)
    weight = torch.randn(32, 16)
    packed = pack_weight_for_cpu(weight)
    for rows in (1, 4, 5, 12):
        x = torch.randn(rows, 16)
        out = apply_linear(x, weight, packed, linear_kernel_ops=ops)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, weight), atol=1e-4, rtol=1e-5)
    assert used == [1, 4]


def test_a_machine_where_onednn_cannot_be_timed_gets_the_fallback_uncached(fresh_crossover, monkeypatch) -> None:
    def measure(ops):
        raise RuntimeError("no mkldnn here")

    monkeypatch.setattr(linear_crossover, "measure_kernel_max_rows", measure)
    assert kernel_max_rows(cpu_ops.load_cpu_ops()) == linear_crossover.FALLBACK
    assert not fresh_crossover.exists()
