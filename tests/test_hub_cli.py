"""`pagedserve` on a Hugging Face hub id, as a user runs it: `serve org/name` offline from a hub cache laid by hand
(tests/hub_cache.py) answers as HF transformers does on the snapshot, `fetch-model` prints the snapshot, and a
model that cannot be had is one line and exit status 2."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from model_executor.hub import HF_ENV_VARS
from tests.fault_helpers import wait_until
from tests.hub_cache import lay_tiny_llama
from tests.process_helpers import free_port_for_direct_ingress, ray_processes_of, start_pagedserve

REPO = "pagedserve-test/tiny-llama"
PAGEDSERVE = str(Path(sys.executable).with_name("pagedserve"))
PROMPT = [17, 2300, 981, 45, 6]


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> tuple[Path, Path, Path]:
    """(HF_HOME, the main snapshot, the v1 snapshot): the tiny Llama laid into `$HF_HOME/hub`."""
    home = tmp_path_factory.mktemp("hf-home")
    main = lay_tiny_llama(home / "hub", tiny_model_dir, refs=("main",))
    v1 = lay_tiny_llama(home / "hub", tiny_model_dir, refs=("v1",))
    return home, main, v1


def offline_env(home: Path) -> dict[str, str]:
    """The hub's variables of this process dropped, HF_HOME the laid cache, no network."""
    env = {name: value for name, value in os.environ.items() if name not in HF_ENV_VARS and name != "RAY_ADDRESS"}
    return {**env, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}


def pagedserve(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PAGEDSERVE, *args], env=env, capture_output=True, text=True, timeout=300, check=False)


def wait_for_health(server: subprocess.Popen, base: str, log_path: Path, timeout_s: float = 300) -> None:
    """/health answers 200; a server that exits first fails at once, with its log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, log_path.read_text()[-5000:]
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise AssertionError(f"pagedserve serve not up within {timeout_s:.0f}s\n{log_path.read_text()[-5000:]}")


@pytest.mark.serve
@pytest.mark.subprocess
def test_serve_a_hub_id_offline_answers_as_hf_does_on_its_snapshot(tmp_path, hf_home, hf_reference):
    home, main, _ = hf_home
    port = free_port_for_direct_ingress()
    server, ray_tmpdir, log_path = start_pagedserve(
        tmp_path, port, model=REPO, env={"HF_HOME": home.as_posix(), "HF_HUB_OFFLINE": "1"}, app_name="hub"
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(server, base, log_path)
        models = httpx.get(f"{base}/v1/models", timeout=30).json()
        assert [model["id"] for model in models["data"]] == [REPO]
        body = {"model": REPO, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        response = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        choice, usage = response.json()["choices"][0], response.json()["usage"]
        expected = hf_reference.greedy(main, PROMPT, 8)
        from transformers import AutoTokenizer

        assert choice["text"] == AutoTokenizer.from_pretrained(main).decode(expected)
        assert usage["completion_tokens"] == len(expected)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=120) == 0, log_path.read_text()[-3000:]
    finally:
        if server.poll() is None:
            server.kill()
    wait_until(lambda: not ray_processes_of(ray_tmpdir), 30, "every process of its Ray gone")


@pytest.mark.subprocess
def test_fetch_model_prints_the_snapshot_and_serve_pins_the_commit(hf_home):
    home, main, v1 = hf_home
    env = offline_env(home)
    for argv, expected in (([REPO], main), ([REPO, "--revision", "v1"], v1)):
        completed = pagedserve("fetch-model", *argv, env=env)
        assert completed.returncode == 0, completed.stderr
        assert Path(completed.stdout.splitlines()[-1]) == expected
    elsewhere = {**env, "HF_HOME": str(home.parent / "nowhere")}
    completed = pagedserve("fetch-model", REPO, "--download-dir", str(home / "hub"), env=elsewhere)
    assert completed.returncode == 0 and Path(completed.stdout.splitlines()[-1]) == main, completed.stderr

    dry_run = pagedserve("serve", f"{REPO}@v1", "--dry-run", env=env)
    assert dry_run.returncode == 0, dry_run.stderr
    model = yaml.safe_load(dry_run.stdout)["model"]
    assert (model["name"], model["revision"], model["served_model_name"]) == (REPO, v1.name, f"{REPO}@v1")


@pytest.mark.subprocess
def test_a_hub_id_that_cannot_be_had_is_one_line_and_exit_2(hf_home):
    home, _, _ = hf_home
    env = offline_env(home)
    for argv in (["fetch-model", "pagedserve-test/no-such-model"], ["serve", "pagedserve-test/no-such-model"]):
        completed = pagedserve(*argv, env=env)
        assert completed.returncode == 2 and completed.stdout == ""
        assert completed.stderr == (
            f"error: pagedserve-test/no-such-model: it is not (fully) in the hub cache at {home / 'hub'} and "
            "HF_HUB_OFFLINE=1: run `pagedserve fetch-model pagedserve-test/no-such-model` with network, or unset "
            "HF_HUB_OFFLINE\n"
        )
    conflict = pagedserve("serve", f"{REPO}@v1", "--revision", "main", "--dry-run", env=env)
    assert conflict.returncode == 2
    assert conflict.stderr.startswith(f"error: model '{REPO}@v1' names revision 'v1' and the revision given is")
