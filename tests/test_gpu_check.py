"""The GPU check's CPU side: `benchmarks/gpu_bench.py` runs its whole offline path on the tiny shape and prints the
table it will print on a GPU, the report merges offline and HTTP results, and `gpu_check.sh` parses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_bench

REPO = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 300


@pytest.mark.subprocess
def test_offline_tiny_on_cpu_prints_a_row_per_stream_count_with_hf_and_roofline(tmp_path: Path) -> None:
    json_out = tmp_path / "tiny.json"
    command = [sys.executable, "-m", "benchmarks.gpu_bench", "offline", "--shape", "tiny", "--device", "cpu"]
    command += ["--streams", "1,3", "--input-len", "8", "--output-len", "4", "--work-dir", str(tmp_path)]
    command += ["--json-out", str(json_out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]

    table_rows = [line for line in done.stdout.splitlines() if line.startswith("| tiny | offline |")]
    assert [row.split("|")[3].strip() for row in table_rows] == ["1", "3"]
    one_stream = [cell.strip() for cell in table_rows[0].split("|")]
    assert one_stream[7].endswith("x"), "the one-stream row carries ours/roofline"
    result = json.loads(json_out.read_text())
    assert result["shape"] == "tiny" and result["device"] == "cpu"
    assert result["copy_bandwidth_gb_s"] > 0 and result["roofline_tok_per_s"] > 0
    # Llama 3's vocabulary with an untied embedding: the embedding is written but not read per decode step.
    embedding_bytes = 128256 * 64 * 4
    assert result["weight_bytes"] - result["weight_bytes_read_per_step"] == embedding_bytes
    assert [row["streams"] for row in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert row["mode"] == "offline" and row["ours_tok_per_s"] > 0 and row["hf_tok_per_s"] > 0
        assert row["hf_tokens_per_stream"] == 4
    assert not list(tmp_path.glob("tiny-random-*")), "the random model's directory is removed"


@pytest.mark.parametrize("shape", sorted(gpu_bench.SHAPES))
def test_every_shape_builds_its_config_with_the_weights_std(shape: str) -> None:
    config = gpu_bench.shape_config(shape, torch.bfloat16)
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_key_value_heads", "vocab_size"):
        assert getattr(config, name) == gpu_bench.SHAPES[shape][name]
    assert config.initializer_range == gpu_bench.WEIGHT_STD
    assert config.dtype == torch.bfloat16


def test_report_gives_http_rows_the_offline_hf_figure_and_notes_a_skipped_http_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    facts = {
        "device": "cuda",
        "device_name": "NVIDIA H100 80GB HBM3",
        "dtype": "bfloat16",
        "weight_bytes_read_per_step": 2.0e9,
        "copy_bandwidth_gb_s": 3000.0,
        "roofline_tok_per_s": 1500.0,
    }
    offline = {
        **facts,
        "shape": "smollm2",
        "rows": [
            {"mode": "offline", "streams": 1, "ours_tok_per_s": 750.0, "hf_tok_per_s": 25.0},
            {"mode": "offline", "streams": 256, "ours_tok_per_s": 30000.0, "hf_error": "out of memory"},
        ],
    }
    http = {**facts, "shape": "smollm2", "rows": [{"mode": "HTTP", "streams": 1, "ours_tok_per_s": 500.0}]}
    skipped = {"shape": "llama3-8b", "device": "cuda", "rows": [], "skipped": "ray not installed on this machine"}
    paths = []
    for name, result in {"offline": offline, "http": http, "skipped": skipped}.items():
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(result))
    merged, table_file = tmp_path / "results.json", tmp_path / "table.md"

    assert gpu_bench.main(["report", *map(str, paths), "--json-out", str(merged), "--table-out", str(table_file)]) == 0

    table = capsys.readouterr().out
    assert table.strip() == table_file.read_text().strip()
    assert "| smollm2 | offline | 1 | 750.0 | 25.0 | 30.00x | 0.50x |" in table
    assert "| smollm2 | offline | 256 | 30,000.0 | out of memory | - |  |" in table
    assert "| smollm2 | HTTP | 1 | 500.0 | 25.0 | 20.00x | 0.33x |" in table
    assert "llama3-8b HTTP: skipped: ray not installed on this machine" in table
    assert [result["shape"] for result in json.loads(merged.read_text())] == ["smollm2", "smollm2", "llama3-8b"]


def test_gpu_check_script_parses() -> None:
    done = subprocess.run(
        ["bash", "-n", str(REPO / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr


def test_the_trimmed_ray_wheel_keeps_the_rest_and_a_record_of_it(tmp_path):
    import zipfile

    from benchmarks.gpu_wheels import trim_wheel

    source, target = tmp_path / "ray.whl", tmp_path / "trimmed.whl"
    names = ["ray/__init__.py", "ray/serve/api.py", "ray/jars/ray.jar", "ray/rllib/algo.py", "ray/ui.js.map"]
    record = "".join(f"{name},sha256=x,1\n" for name in names) + "ray-2.dist-info/RECORD,,\n"
    with zipfile.ZipFile(source, "w") as wheel:
        for name in names:
            wheel.writestr(name, "x")
        wheel.writestr("ray-2.dist-info/RECORD", record)
    trim_wheel(source, target)
    with zipfile.ZipFile(target) as wheel:
        kept = sorted(wheel.namelist())
        rows = wheel.read("ray-2.dist-info/RECORD").decode().splitlines()
    assert kept == ["ray-2.dist-info/RECORD", "ray/__init__.py", "ray/serve/api.py"]
    assert [row.split(",")[0] for row in rows] == ["ray/__init__.py", "ray/serve/api.py", "ray-2.dist-info/RECORD"]
