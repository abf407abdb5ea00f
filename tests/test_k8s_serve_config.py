"""What runs inside the KubeRay manifests: the RayServices' serveConfigV2 as pagedserve apps (the hub example's
with a hub id and autoscaling engines), the runtime envs' dependencies, the RayJob's batch job and its volumes, and
the Grafana dashboard's queries."""

from __future__ import annotations

import importlib
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from configs.app_config import AppConfig
from tests.k8s_schema import K8S, MANIFESTS, REPO, dashboard_exprs, load_documents, load_manifest

HUB_SERVICE = "rayservice-hub.yaml"
SERVICE_FILES = [MANIFESTS["RayService"], HUB_SERVICE]


# --- the Serve application and runtime envs ------------------------------------------------------------------


def serve_config_text(file: str) -> str:
    """The serveConfigV2 text of the RayService in k8s/`file`."""
    (service,) = [document for document in load_documents(file) if document["kind"] == "RayService"]
    return service["spec"]["serveConfigV2"]


def serve_config(file: str) -> dict[str, Any]:
    return yaml.safe_load(serve_config_text(file))


@pytest.mark.parametrize("file", SERVICE_FILES)
def test_serve_config_is_a_pagedserve_app(file: str) -> None:
    from ray.serve import Application
    from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

    config = serve_config(file)
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    # Serve's schema ignores unknown application keys; a typo would silently drop the setting.
    assert set(app) <= set(ServeApplicationSchema.model_fields)
    assert app["import_path"] == "serve_app.app:build_app"
    module_name, attribute = app["import_path"].split(":")
    builder = getattr(importlib.import_module(module_name), attribute)
    args = AppConfig.model_validate(app["args"])
    assert (args.model.device, args.model.dtype) == ("cuda", "bfloat16")
    assert (args.serve.host, args.serve.port) == ("0.0.0.0", 8000)
    # The app takes its name (engine actor names) and route from Serve: the args do not repeat them.
    assert not {"app_name", "route_prefix"} & set(app["args"].get("serve", {}))
    assert isinstance(builder(app["args"]), Application)


def project_requirements() -> dict[str, Requirement]:
    import tomllib

    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    requirements = [Requirement(dependency) for dependency in dependencies]
    return {requirement.name: requirement for requirement in requirements if requirement.name != "ray"}


def pinned_torch() -> str:
    match = re.search(r"^TORCH_VERSION\s*:?=\s*(\S+)", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert match, "Makefile pins torch"
    return match.group(1)


def runtime_envs() -> dict[str, dict[str, Any]]:
    """Each manifest's runtime env, by file."""
    envs = {file: serve_config(file)["applications"][0]["runtime_env"] for file in SERVICE_FILES}
    envs[MANIFESTS["RayJob"]] = yaml.safe_load(load_manifest("RayJob")["spec"]["runtimeEnvYAML"])
    return envs


@pytest.mark.parametrize("file", [*SERVICE_FILES, MANIFESTS["RayJob"]])
def test_runtime_env_installs_the_project_dependencies(file: str) -> None:
    from ray.runtime_env import RuntimeEnv

    runtime_env = runtime_envs()[file]
    parsed = RuntimeEnv(**runtime_env)  # Ray's own validation: URI scheme and suffix, pip options
    assert parsed["working_dir"].startswith("https://") and parsed["working_dir"].endswith(".zip")
    packages = {Requirement(package).name: Requirement(package) for package in parsed["pip"]["packages"]}
    # Ray comes with the image; a pip-installed one could differ from the cluster's.
    assert "ray" not in packages
    assert set(project_requirements()) <= set(packages), "runtime_env pip misses a pyproject dependency"
    (torch_pin,) = packages["torch"].specifier
    assert torch_pin.operator == "==" and torch_pin.version.split("+")[0] == pinned_torch()


def test_hub_serve_config_serves_a_hub_model_with_autoscaling_engines() -> None:
    from ray.serve.config import AutoscalingConfig

    from model_executor.hub import is_hub_id

    (app,) = serve_config(HUB_SERVICE)["applications"]
    args = AppConfig.model_validate(app["args"])
    assert is_hub_id(args.model.name), args.model.name
    assert args.parallel.tensor_parallel_size == 2
    engines = args.serve.engine_autoscaling
    assert engines is not None and (engines.min_replicas, engines.max_replicas) == (1, 4)
    # Serve reads the ingress autoscaling_config as it is: its own schema must take every key.
    ingress = AutoscalingConfig.model_validate(args.serve.autoscaling_config)
    assert ingress.min_replicas >= 1 and ingress.max_replicas > ingress.min_replicas
    # serveConfigV2 is stored in the RayService in plain text: the token comes from a Secret in the pods' env, and
    # nothing may switch the hub off.
    env_vars = app["runtime_env"].get("env_vars", {})
    assert not {"HF_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"} & set(env_vars), env_vars
    assert not re.search(r"\bhf_[A-Za-z0-9]{30,}", serve_config_text(HUB_SERVICE)), "a token in serveConfigV2"


def test_rayjob_runs_the_batch_job_into_a_persistent_volume() -> None:
    from cluster.job import parse_line

    documents = {document["kind"]: document for document in load_documents(MANIFESTS["RayJob"])}
    spec = documents["RayJob"]["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] > 0
    argv = shlex.split(spec["entrypoint"])
    assert argv[:4] == ["python", "-m", "cluster.job", "batch"]
    options = dict(zip(argv[4::2], argv[5::2], strict=True))
    AppConfig.from_yaml(REPO / options["--config"])  # working_dir is the repository root
    # The job driver runs on the head: input and output must be mounted there.
    head = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    mounts = {mount["mountPath"]: mount["name"] for mount in head["containers"][0]["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in head["volumes"]}
    input_path, output_path = Path(options["--input"]), Path(options["--output"])
    input_volume = volumes[mounts[str(input_path.parent)]]["configMap"]
    output_volume = volumes[mounts[str(output_path.parent)]]["persistentVolumeClaim"]
    # Results outlive the cluster that shutdownAfterJobFinishes deletes.
    assert documents["PersistentVolumeClaim"]["metadata"]["name"] == output_volume["claimName"]
    config_map = documents["ConfigMap"]
    assert config_map["metadata"]["name"] == input_volume["name"]
    lines = config_map["data"][input_path.name].splitlines()
    assert lines and all(parse_line(line, index)[2]["model"] for index, line in enumerate(lines))


# --- the Grafana dashboard -----------------------------------------------------------------------------------


def exported_metric_names() -> set[str]:
    """Every sample name the engine's registry can expose."""
    from executor.metrics import EngineMetrics

    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    return {
        family.name + suffix for family in EngineMetrics("m").registry.collect() for suffix in suffixes[family.type]
    }


def test_grafana_dashboard_queries_exported_metrics() -> None:
    dashboard = json.loads((K8S / "grafana-dashboard.json").read_text())
    assert dashboard["schemaVersion"] >= 36
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["model_name"]["datasource"]["uid"] == "${DS_PROMETHEUS}"
    panels = dashboard["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    assert all(panel["datasource"]["uid"] == "${DS_PROMETHEUS}" for panel in panels)
    exported, used = exported_metric_names(), set()
    for expr in dashboard_exprs():
        selectors = re.findall(r"(vllm:[a-z0-9_]+)(\{[^}]*\})?", expr)
        assert selectors, expr
        for name, labels in selectors:
            assert name in exported, f"{name} is not exported by executor/metrics.py"
            assert 'model_name=~"$model_name"' in labels, expr
            used.add(name)
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket"):
        assert name in used
    assert any("histogram_quantile" in expr and "_bucket" in expr for expr in dashboard_exprs())
