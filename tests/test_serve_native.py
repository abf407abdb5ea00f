"""pagedserve as a Ray Serve user runs it, with the Serve CLI on a real `ray start --head` of its own:
`serve run serve_app.app:build_app key=value ...` (flat vLLM-named args, as strings), `serve run configs/serve.yaml`
and `serve deploy configs/serve.yaml`. The application's name and route prefix are Serve's: two applications
never share an engine, whatever their args say."""

from __future__ import annotations

import json
import secrets
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.fault_helpers import wait_until
from tests.helpers import free_ports
from tests.k8s_schema import REPO, VENV_BIN
from tests.process_helpers import LocalRayHead, token_auth_head_env

SERVE_CONFIG = REPO / "configs" / "serve.yaml"
READY_TIMEOUT_S = 240
# Sized for a 2-core box; everything else is what the caller under test passes.
SMALL = {"num_kv_blocks": 64, "worker_num_cpus": 0.5, "num_threads": 1, "ingress_num_cpus": 0.1}


@dataclass
class ServeCluster:
    head: LocalRayHead
    http_port: int

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def run(self, *args: str, timeout: float = READY_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        """A Ray CLI command (`serve run ...`, `ray list ...`) against this head, from the repository root."""
        return subprocess.run(
            [str(VENV_BIN / args[0]), *args[1:]],
            cwd=REPO,
            env=self.head.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def delete_app(self, name: str) -> None:
        """`serve.delete` from a driver: the Serve CLI deletes only what `serve deploy` declared."""
        code = f"from ray import serve; serve.delete({name!r})"
        result = self.run("python", "-c", code, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]

    def engine_actor_names(self) -> set[str]:
        result = self.run("ray", "list", "actors", "--filter", "class_name=EngineActor", "--filter", "state=ALIVE",
                          "--format", "json", "--limit", "1000", timeout=120)  # fmt: skip
        assert result.returncode == 0, result.stderr[-2000:]
        return {actor["name"] for actor in json.loads(result.stdout)}


@pytest.fixture(scope="module")
def serve_cluster(tiny_model_dir: Path) -> Iterator[ServeCluster]:
    """A Ray head of our own with its dashboard (`serve deploy` talks to it) and Serve started on a free port
    (`serve run IMPORT_PATH` would otherwise start it on 8000); the tiny model exists before any replica."""
    temp_dir = Path(tempfile.mkdtemp(prefix="raysn-", dir="/tmp"))  # short: Ray's unix sockets live under it
    token = secrets.token_hex(32)
    head = LocalRayHead(temp_dir, token_auth_head_env(token))
    try:
        head.wait_for_dashboard({"Authorization": f"Bearer {token}"})
        cluster = ServeCluster(head, free_ports(1)[0])
        started = cluster.run("serve", "start", "--http-host", "127.0.0.1", "--http-port", str(cluster.http_port))
        assert started.returncode == 0, started.stderr[-2000:]
        yield cluster
    finally:
        head.shut_down()


def model_ids(url: str, headers: dict[str, str] | None = None) -> list[str]:
    response = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    return [model["id"] for model in response.json()["data"]]


def complete(url: str, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    payload = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True, **body}
    return httpx.post(f"{url}/v1/completions", json=payload, headers=headers, timeout=60)


def test_builder_args_as_serve_run_passes_them_take_the_schemas_types() -> None:
    """`serve run serve_app.app:build_app k=v ...` hands the builder strings only; nested sections and a preset
    (`config=...`) under flat overrides work as well; a bad value or key fails naming it."""
    from configs.app_config import AppConfig

    config = AppConfig.from_serve_args(
        {
            "config": "tiny-tp2-pp2",
            "model": "/models/llama",
            "served_model_name": "123",
            "tensor_parallel_size": "1",
            "enforce_eager": "true",
            "dtype": "half",
            "kv_cache_memory_gib": "null",
            "request_timeout_s": "2.5",
            "cors_allow_origins": '["*"]',
            "speculative_config": "{num_speculative_tokens: 3}",
            "cache": {"block_size": 32},
        }
    )
    model = config.model
    assert (model.name, model.served_model_name, model.dtype) == ("/models/llama", "123", "float16")
    assert (config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size) == (1, 2)  # PP: the preset's
    assert config.runtime.cuda_graphs == "off" and config.cache.kv_cache_memory_gib is None
    assert config.cache.block_size == 32 and config.serve.request_timeout_s == 2.5
    assert config.serve.cors_allow_origins == ["*"] and config.scheduler.speculative_config.num_speculative_tokens == 3
    assert config.serve.route_prefix == "/tiny"  # the preset's, for `pagedserve serve`; Serve's wins under Serve
    for bad, named in (({"tensor_parallel_size": "two"}, "tensor_parallel_size"), ({"blok_size": "3"}, "blok_size")):
        with pytest.raises(ValueError, match=named):
            AppConfig.from_serve_args(bad)


@pytest.mark.serve
@pytest.mark.subprocess
def test_serve_run_import_path_with_flat_string_args_and_apps_named_by_serve(serve_cluster: ServeCluster) -> None:
    """`serve run serve_app.app:build_app k=v ...` twice, under two Serve names and route prefixes, args that
    name neither: every value arrives as a string and takes its key's type; each app has its own engine actor,
    named after its Serve name, and deleting one leaves the other serving."""
    common = [f"{key}={value}" for key, value in SMALL.items()]
    # A string for an int (max_logprobs), a bool alias (enforce_eager), null, and a flat serve key (api_key).
    common += ["model=tiny-random-llama", "max_logprobs=2", "enforce_eager=true", "kv_cache_memory_gib=null"]
    for name in ("native-a", "native-b"):
        result = serve_cluster.run(
            "serve", "run", "serve_app.app:build_app", *common, f"served_model_name={name}-model",
            f"api_key=key-{name}", "--name", name, "--route-prefix", f"/{name}", "--non-blocking",
        )  # fmt: skip
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]

    for name in ("native-a", "native-b"):
        url, auth = f"{serve_cluster.base}/{name}", {"Authorization": f"Bearer key-{name}"}
        assert model_ids(url, auth) == [f"{name}-model"]
        assert complete(url, auth).json()["usage"]["completion_tokens"] == 3
        assert complete(url).status_code == 401  # api_key=... from the command line
        too_many = complete(url, auth, logprobs=3)  # max_logprobs=2, given as the string "2"
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "logprobs", too_many.text
    assert {"native-a-engine-0", "native-b-engine-0"} <= serve_cluster.engine_actor_names()

    serve_cluster.delete_app("native-a")
    # Its replica detaches as it stops, and an engine without an ingress ends itself with its workers.
    wait_until(lambda: "native-a-engine-0" not in serve_cluster.engine_actor_names(), 60, "native-a's engine gone")
    assert "native-b-engine-0" in serve_cluster.engine_actor_names()
    b_auth = {"Authorization": "Bearer key-native-b"}
    assert complete(f"{serve_cluster.base}/native-b", b_auth).status_code == 200
    serve_cluster.delete_app("native-b")


def serve_config_for_this_box(serve_cluster: ServeCluster, **args: Any) -> Path:
    """configs/serve.yaml as it is (runtime_env included), on this head's HTTP port, with the tiny model."""
    config = yaml.safe_load(SERVE_CONFIG.read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": serve_cluster.http_port}
    (app,) = config["applications"]
    app["args"].update({"model": "tiny-random-llama", "kv_cache_memory_gib": None, **SMALL, **args})
    path = serve_cluster.head.temp_dir / f"serve-{len(args)}-{secrets.token_hex(4)}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.mark.serve
@pytest.mark.subprocess
def test_serve_run_then_serve_deploy_of_the_serve_config(serve_cluster: ServeCluster) -> None:
    """`serve run configs/serve.yaml` deploys the app under the file's name and route; `serve deploy` of the same
    file with another served_model_name updates it in place (its engine is replaced for the new config)."""
    (app,) = yaml.safe_load(SERVE_CONFIG.read_text())["applications"]
    assert "app_name" not in app["args"].get("serve", {})  # the app's name is the file's `name`
    url = serve_cluster.base + app["route_prefix"].rstrip("/")

    ran = serve_cluster.run("serve", "run", str(serve_config_for_this_box(serve_cluster)), "--non-blocking")
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
    wait_until(lambda: model_ids(url) == ["tiny-random-llama"], READY_TIMEOUT_S, "serve run's app answering")
    assert complete(url).json()["usage"]["completion_tokens"] == 3
    assert f"{app['name']}-engine-0" in serve_cluster.engine_actor_names()

    updated = serve_config_for_this_box(serve_cluster, served_model_name="updated")
    deployed = serve_cluster.head.cli("deploy", str(updated))
    assert deployed.returncode == 0, deployed.stdout[-2000:] + deployed.stderr[-2000:]
    wait_until(lambda: model_ids(url) == ["updated"], READY_TIMEOUT_S, "serve deploy's update answering")
    assert complete(url, model="updated").json()["model"] == "updated"
    status = serve_cluster.head.cli("status")
    assert yaml.safe_load(status.stdout)["applications"][app["name"]]["status"] == "RUNNING", status.stdout
