"""The RayService's serveConfigV2 deployed for real with the Serve CLI on a local Ray head, sized for a CPU box,
and answering OpenAI requests with the metrics the Grafana dashboard queries."""

from __future__ import annotations

import copy
import os
import re
import secrets
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from configs.app_config import AppConfig
from tests.helpers import free_ports
from tests.k8s_schema import REPO, dashboard_exprs, serve_config
from tests.process_helpers import LocalRayHead, token_auth_head_env

# --- 3. the serveConfigV2 deployed on a real local Ray head --------------------------------------------------


def cpu_applications(model: str, port: int) -> dict[str, Any]:
    """The manifest's Serve config, sized for this CPU box; code comes from the checkout, not a URL."""
    applications = copy.deepcopy(serve_config()["applications"])
    for app in applications:
        app["runtime_env"] = {}
        args = app["args"]
        args["model"].update(name=model, device="cpu", dtype="float32")
        args["cache"].update(num_kv_blocks=64)
        args["parallel"].update(worker_num_cpus=0.5, num_threads=1)
        args["serve"].update(ingress_replicas=1)  # one tokenizer process on 2 cores is enough
        AppConfig.model_validate(args)
    return {"http_options": {"host": "127.0.0.1", "port": port}, "applications": applications}


@pytest.fixture
def local_ray_head(tiny_model_dir: Path) -> Iterator[LocalRayHead]:
    """A Ray head of our own; the tiny model is built before it, so replicas never race to build it."""
    # A short path: Ray's unix sockets live under the temp dir and sun_path holds 107 bytes.
    temp_dir = Path(tempfile.mkdtemp(prefix="rayk8s-", dir="/tmp"))
    token = secrets.token_hex(32)
    env = token_auth_head_env(token)
    # No working_dir: Serve imports serve_app from the checkout.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    head = LocalRayHead(temp_dir, env)
    try:
        head.wait_for_dashboard({"Authorization": f"Bearer {token}"})
        yield head
    finally:
        head.shut_down()


def application_status(head: LocalRayHead, app_name: str) -> tuple[str, str]:
    result = head.cli("status", timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    status = (yaml.safe_load(result.stdout) or {}).get("applications", {}).get(app_name, {})
    return status.get("status", "NOT_STARTED"), result.stdout


@pytest.mark.serve
@pytest.mark.subprocess
def test_serve_config_deploys_with_the_serve_cli(local_ray_head: LocalRayHead) -> None:
    from model_executor.tiny_model import TINY_ALIAS

    started = time.monotonic()
    http_port = free_ports(1)[0]
    config = cpu_applications(TINY_ALIAS, http_port)
    config_path = local_ray_head.temp_dir / "serve-config.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    deploy = local_ray_head.cli("deploy", str(config_path))
    assert deploy.returncode == 0, deploy.stdout[-2000:] + deploy.stderr[-2000:]

    app_name = config["applications"][0]["name"]
    deadline, status, report = time.monotonic() + 180, "NOT_STARTED", ""
    while time.monotonic() < deadline:
        status, report = application_status(local_ray_head, app_name)
        if status in ("RUNNING", "DEPLOY_FAILED", "UNHEALTHY"):
            break
        time.sleep(2)
    assert status == "RUNNING", f"{report}\n{local_ray_head.serve_logs_tail()}"
    print(f"serve deploy -> RUNNING in {time.monotonic() - started:.1f}s")

    base = f"http://127.0.0.1:{http_port}"
    with httpx.Client(base_url=base, timeout=60) as client:
        models = client.get("/v1/models")
        assert models.status_code == 200, models.text
        model_ids = [model["id"] for model in models.json()["data"]]
        assert model_ids == [TINY_ALIAS]
        completion = client.post(
            "/v1/completions",
            json={"model": TINY_ALIAS, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True},
        )
        assert completion.status_code == 200, completion.text
        body = completion.json()
        assert isinstance(body["choices"][0]["text"], str) and body["usage"]["completion_tokens"] == 4
        print(f"/v1/models {model_ids}; completion {body['choices'][0]['text']!r} {body['usage']}")
        # The dashboard's metric names, as this deployment exposes them after one request.
        exposed = client.get("/metrics").text
    # Every family the dashboard queries is exposed; counters appear once first incremented, so only the
    # ones this request must have moved are required to carry samples.
    for expr in dashboard_exprs():
        for name in re.findall(r"vllm:[a-z0-9_]+", expr):
            family = re.sub(r"_(bucket|sum|count)$", "", name)  # a histogram's TYPE line names its base
            assert f"# TYPE {family} " in exposed, f"{family} missing from /metrics"
    for sample in (
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
        "vllm:request_success_total",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
    ):
        assert re.search(rf'^{re.escape(sample)}\{{.*model_name="{TINY_ALIAS}"', exposed, re.MULTILINE), sample
