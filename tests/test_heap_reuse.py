"""The model worker keeps freed memory for its next step (executor.heap.keep_freed_memory).

Each check runs in a fresh interpreter: glibc's allocator state (its moving mmap threshold, its arenas) is per
process and set by everything that process allocated before.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.subprocess,
    pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's"),
]

REPO = Path(__file__).resolve().parents[1]

# A model worker (with its own compute thread, as in a Ray actor) is built, then its compute thread allocates and
# frees what prefill steps of varying sizes do: a dozen activations of a few MiB each, row counts changing step to
# step. Prints the thread's page faults in each of 20 steps.
WORKER_STEPS = """
import json, resource, sys
import torch
from configs.engine_config import EngineConfig
from executor.worker import ModelWorker
from model_executor.model_info import load_model_info

config = EngineConfig(model=sys.argv[1], keep_freed_memory=sys.argv[2] == "on")
worker = ModelWorker(load_model_info(sys.argv[1], config, False), config, 0, 0, 1, compute_thread=True)

def steps():
    faults = []
    for step in range(20):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        rows = [512, 300, 480, 128, 450][step % 5]
        activations = [torch.empty(rows, 3072).fill_(1.0) for _ in range(12)]
        del activations
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    return faults

print(json.dumps(worker.compute.call(steps)))
"""


def compute_thread_faults(model_dir: Path, keep_freed_memory: bool) -> list[int]:
    completed = subprocess.run(
        [sys.executable, "-c", WORKER_STEPS, str(model_dir), "on" if keep_freed_memory else "off"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_a_model_workers_steps_reuse_freed_memory_instead_of_faulting_in_new_pages(tiny_model_dir):
    kept = compute_thread_faults(tiny_model_dir, keep_freed_memory=True)
    returned = compute_thread_faults(tiny_model_dir, keep_freed_memory=False)
    # The first two rounds of the five step sizes grow the heap (their first touch faults either way); after
    # that, kept memory is reused and glibc's defaults hand pages back and fault them in again.
    assert sum(kept[10:]) < 256, kept
    assert sum(returned[10:]) > 1024, returned
    assert sum(kept[:10]) > 0  # the measurement sees faults at all
