"""The KubeRay manifests in k8s/: valid against the v1 CRDs, consistent with AppConfig and the cluster's
resources, and the RayService's serveConfigV2 deployed for real with the Serve CLI on a local Ray head."""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement

from configs.app_config import AppConfig
from tests.helpers import free_ports

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
# The CRDs live beside the checkout (../shared/kuberay-crds); KUBERAY_CRD_DIR points elsewhere.
CRD_DIR = Path(os.environ.get("KUBERAY_CRD_DIR", REPO.parent / "shared" / "kuberay-crds"))
VENV_BIN = REPO / ".venv" / "bin"
YAML_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
MANIFESTS = {"RayService": "rayservice.yaml", "RayJob": "rayjob.yaml", "RayCluster": "raycluster.yaml"}
CRD_FILES = {
    "RayService": "ray.io_rayservices.yaml",
    "RayJob": "ray.io_rayjobs.yaml",
    "RayCluster": "ray.io_rayclusters.yaml",
}
# KubeRay's own limits (ray-operator utils): its services append up to "-serve-svc" and RayService/RayJob
# names get 6 more characters for their RayCluster.
MAX_NAME_LENGTH = {"RayCluster": 53, "RayService": 47, "RayJob": 47}
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
GPU = "nvidia.com/gpu"


def load_documents(name: str) -> list[dict[str, Any]]:
    with open(K8S / name) as manifest:
        return [document for document in yaml.load_all(manifest, Loader=YAML_LOADER) if document]


def load_manifest(kind: str) -> dict[str, Any]:
    (document,) = [document for document in load_documents(MANIFESTS[kind]) if document["kind"] == kind]
    return document


def cluster_spec(document: dict[str, Any]) -> dict[str, Any]:
    """The RayCluster spec inside any of the three kinds."""
    spec = document["spec"]
    return {"RayService": lambda: spec["rayClusterConfig"], "RayJob": lambda: spec["rayClusterSpec"]}.get(
        document["kind"], lambda: spec
    )()


def serve_config() -> dict[str, Any]:
    return yaml.safe_load(load_manifest("RayService")["spec"]["serveConfigV2"])


def quantity(value: int | str) -> float:
    """A Kubernetes CPU/GPU quantity as a number ("500m" -> 0.5)."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


# --- Kubernetes structural schemas as jsonschema -------------------------------------------------------------

SUBSCHEMA_MAPS = ("properties", "patternProperties", "definitions")
SUBSCHEMA_LISTS = ("anyOf", "allOf", "oneOf")
SUBSCHEMA_VALUES = ("items", "additionalProperties", "not")


def kubernetes_strict(schema: dict[str, Any]) -> dict[str, Any]:
    """A CRD's openAPIV3Schema as the API server applies it under strict field validation (kubectl's default).

    Unknown fields are rejected (instead of pruned) wherever a schema lists properties and does not preserve
    unknown fields; `nullable` admits null; int-or-string means integer or string, with any `pattern` only
    constraining strings, which is also JSON Schema's reading. CEL rules (x-kubernetes-validations) cannot be
    evaluated here: see cel_guarded_fields.
    """
    node = dict(schema)
    for key in SUBSCHEMA_MAPS:
        if key in node:
            node[key] = {name: kubernetes_strict(child) for name, child in node[key].items()}
    for key in SUBSCHEMA_LISTS:
        if key in node:
            node[key] = [kubernetes_strict(child) for child in node[key]]
    for key in SUBSCHEMA_VALUES:
        if isinstance(node.get(key), dict):
            node[key] = kubernetes_strict(node[key])
    if node.get("nullable") and "type" in node:
        node["type"] = [node["type"], "null"]
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (
        "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        node["additionalProperties"] = False
    return node


FORMATS = jsonschema.FormatChecker(formats=())


@FORMATS.checks("int32")
def is_int32(value: object) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@FORMATS.checks("int64")
def is_int64(value: object) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


def crd_schema(kind: str) -> dict[str, Any]:
    with open(CRD_DIR / CRD_FILES[kind]) as crd_file:
        crd = yaml.load(crd_file, Loader=YAML_LOADER)
    assert crd["spec"]["names"]["kind"] == kind
    (version,) = [version for version in crd["spec"]["versions"] if version["name"] == "v1"]
    assert version["served"] and version["storage"]
    return version["schema"]["openAPIV3Schema"]


@pytest.fixture(scope="module")
def crd_schemas() -> dict[str, dict[str, Any]]:
    """The raw v1 schemas, loaded once per module (about 1 MB of YAML each)."""
    if not CRD_DIR.is_dir():
        pytest.skip(f"KubeRay CRDs not found in {CRD_DIR} (set KUBERAY_CRD_DIR)")
    return {kind: crd_schema(kind) for kind in MANIFESTS}


@pytest.fixture(scope="module")
def validators(crd_schemas: dict[str, dict[str, Any]]) -> dict[str, jsonschema.Draft7Validator]:
    result = {}
    for kind, schema in crd_schemas.items():
        strict = kubernetes_strict(schema)
        jsonschema.Draft7Validator.check_schema(strict)
        result[kind] = jsonschema.Draft7Validator(strict, format_checker=FORMATS)
    return result


def schema_errors(validator: jsonschema.Draft7Validator, document: dict[str, Any]) -> list[str]:
    errors = sorted(validator.iter_errors(document), key=lambda error: list(map(str, error.absolute_path)))
    return [f"{'.'.join(map(str, error.absolute_path)) or '<root>'}: {error.message[:300]}" for error in errors]


def cel_guarded_fields(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Fields set in `value` whose schema carries CEL rules, which only the API server can evaluate."""
    found = [path] if schema.get("x-kubernetes-validations") else []
    if isinstance(value, dict):
        for key, child in value.items():
            child_schema = schema.get("properties", {}).get(key) or schema.get("additionalProperties")
            if isinstance(child_schema, dict):
                found += cel_guarded_fields(child_schema, child, f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, child in enumerate(value):
            found += cel_guarded_fields(schema["items"], child, f"{path}[{index}]")
    return found


# --- 1. schema validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", MANIFESTS)
def test_manifest_validates_against_crd(
    kind: str, validators: dict[str, jsonschema.Draft7Validator], crd_schemas: dict[str, dict[str, Any]]
) -> None:
    document = load_manifest(kind)
    assert document["apiVersion"] == "ray.io/v1"
    assert schema_errors(validators[kind], document) == []
    # The rules the schema check cannot evaluate: none may apply to what these manifests set.
    assert cel_guarded_fields(crd_schemas[kind]["properties"]["spec"], document["spec"], "spec") == []
    # ObjectMeta is not in the CRD schema; KubeRay's own name checks are.
    name = document["metadata"]["name"]
    assert DNS_1035_LABEL.match(name) and len(name) <= MAX_NAME_LENGTH[kind], name


def misspell_spec_field(document: dict[str, Any]) -> None:
    document["spec"]["shutdownAfterJobFinish"] = True  # not a field of any of the three specs


def unknown_container_field(document: dict[str, Any]) -> None:
    cluster_spec(document)["headGroupSpec"]["template"]["spec"]["containers"][0]["resource"] = {}


def integer_ray_start_param(document: dict[str, Any]) -> None:
    cluster_spec(document)["headGroupSpec"]["rayStartParams"]["num-gpus"] = 0  # rayStartParams are strings


def malformed_quantity(document: dict[str, Any]) -> None:
    cluster_spec(document)["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "memory"
    ] = "16 GB"


def missing_group_name(document: dict[str, Any]) -> None:
    del cluster_spec(document)["workerGroupSpecs"][0]["groupName"]


def int32_overflow(document: dict[str, Any]) -> None:
    cluster_spec(document)["workerGroupSpecs"][0]["replicas"] = 2**31


@pytest.mark.parametrize(
    "breakage",
    [
        misspell_spec_field,
        unknown_container_field,
        integer_ray_start_param,
        malformed_quantity,
        missing_group_name,
        int32_overflow,
    ],
)
@pytest.mark.parametrize("kind", MANIFESTS)
def test_broken_manifest_fails_validation(
    kind: str, breakage: Callable[[dict[str, Any]], None], validators: dict[str, jsonschema.Draft7Validator]
) -> None:
    document = copy.deepcopy(load_manifest(kind))
    breakage(document)
    assert schema_errors(validators[kind], document), f"{breakage.__name__} was accepted"


@pytest.mark.parametrize("kind", MANIFESTS)
def test_cluster_groups_as_kuberay_checks_them(kind: str) -> None:
    spec = cluster_spec(load_manifest(kind))
    assert spec["rayVersion"] == "2.60.0"
    groups = spec["workerGroupSpecs"]
    assert len({group["groupName"] for group in groups}) == len(groups)
    for group in groups:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    ports = {port["name"]: port["containerPort"] for port in head["ports"]}
    # KubeRay's port names: its head service and the serve service find the ports by these names.
    assert ports == {"gcs-server": 6379, "dashboard": 8265, "client": 10001, "serve": 8000}
    for container in [head] + [group["template"]["spec"]["containers"][0] for group in groups]:
        assert container["image"].startswith(f"rayproject/ray:{spec['rayVersion']}-py311")
        assert container["resources"]["requests"] == container["resources"]["limits"]


# --- 2. the Serve application, resources and runtime envs ----------------------------------------------------


def test_serve_config_is_a_pagedserve_app() -> None:
    from ray.serve import Application
    from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

    config = serve_config()
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
    # The app's Serve name and route are the ones the AppConfig (engine actor names, routing) assumes.
    assert (app["name"], app["route_prefix"]) == (args.serve.app_name, args.serve.route_prefix)
    assert isinstance(builder(app["args"]), Application)


def gpu_workers(kind: str) -> tuple[dict[str, Any], dict[str, Any]]:
    spec = cluster_spec(load_manifest(kind))
    (group,) = [
        group
        for group in spec["workerGroupSpecs"]
        if GPU in group["template"]["spec"]["containers"][0]["resources"]["limits"]
    ]
    return spec["headGroupSpec"], group


@pytest.mark.parametrize("kind", ["RayService", "RayCluster"])
def test_gpu_workers_and_a_gpu_free_head(kind: str) -> None:
    head, group = gpu_workers(kind)
    resources = group["template"]["spec"]["containers"][0]["resources"]
    gpus = int(resources["limits"][GPU])
    assert gpus >= 1 and int(resources["requests"][GPU]) == gpus
    # Ray must advertise exactly the GPUs Kubernetes granted the pod.
    assert group["rayStartParams"]["num-gpus"] == str(gpus)
    assert head["rayStartParams"]["num-gpus"] == "0"
    head_resources = head["template"]["spec"]["containers"][0]["resources"]
    assert all(GPU not in head_resources.get(section, {}) for section in ("requests", "limits"))


def test_rayservice_fits_its_app() -> None:
    """One engine replica = TP x PP bundles of {CPU: worker_num_cpus, GPU: 1}; the ingress replicas need CPUs
    on the workers too, since the head advertises none."""
    args = AppConfig.model_validate(serve_config()["applications"][0]["args"])
    head, group = gpu_workers("RayService")
    assert head["rayStartParams"].get("num-cpus") == "0"
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    bundles = args.parallel.tensor_parallel_size * args.parallel.pipeline_parallel_size
    gpus_per_pod, cpus_per_pod = int(limits[GPU]), quantity(limits["cpu"])
    if args.parallel.placement_strategy == "STRICT_PACK":
        assert gpus_per_pod >= bundles, "STRICT_PACK puts every bundle on one pod"
    assert gpus_per_pod * group["replicas"] >= bundles
    bundles_per_pod = min(bundles, gpus_per_pod)
    assert cpus_per_pod * group["replicas"] >= (
        bundles * args.parallel.worker_num_cpus + args.serve.ingress_replicas * args.serve.ingress_num_cpus
    )
    assert cpus_per_pod >= bundles_per_pod * args.parallel.worker_num_cpus


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
    return {
        "RayService": serve_config()["applications"][0]["runtime_env"],
        "RayJob": yaml.safe_load(load_manifest("RayJob")["spec"]["runtimeEnvYAML"]),
    }


@pytest.mark.parametrize("kind", ["RayService", "RayJob"])
def test_runtime_env_installs_the_project_dependencies(kind: str) -> None:
    from ray.runtime_env import RuntimeEnv

    runtime_env = runtime_envs()[kind]
    parsed = RuntimeEnv(**runtime_env)  # Ray's own validation: URI scheme and suffix, pip options
    assert parsed["working_dir"].startswith("https://") and parsed["working_dir"].endswith(".zip")
    packages = {Requirement(package).name: Requirement(package) for package in parsed["pip"]["packages"]}
    # Ray comes with the image; a pip-installed one could differ from the cluster's.
    assert "ray" not in packages
    assert set(project_requirements()) <= set(packages), "runtime_env pip misses a pyproject dependency"
    (torch_pin,) = packages["torch"].specifier
    assert torch_pin.operator == "==" and torch_pin.version.split("+")[0] == pinned_torch()


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


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((K8S / "grafana-dashboard.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


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


class LocalRayHead:
    """`ray start --head --block` in its own session and temp dir: stopping it touches no other Ray on the box
    (`ray stop` would stop every Ray of this user)."""

    def __init__(self, temp_dir: Path, env: dict[str, str]):
        ports = free_ports(7)
        self.gcs_port, self.dashboard_port = ports[:2]
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        self.temp_dir, self.env = temp_dir, {**env, "RAY_ADDRESS": f"127.0.0.1:{self.gcs_port}"}
        command = [
            str(VENV_BIN / "ray"),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={self.gcs_port}",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}",
            # Every other fixed default port could collide with another test's Ray on this machine.
            f"--ray-client-server-port={ports[2]}",
            f"--dashboard-agent-listen-port={ports[3]}",
            f"--dashboard-agent-grpc-port={ports[4]}",
            f"--metrics-export-port={ports[5]}",
            f"--runtime-env-agent-port={ports[6]}",
            "--num-cpus=8",
            "--num-gpus=0",
            f"--object-store-memory={256 * 2**20}",
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
        ]
        self.log = (temp_dir / "ray-start.log").open("w")
        self.process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(VENV_BIN / "serve"), *args, "--address", self.dashboard],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def wait_for_dashboard(self, headers: dict[str, str], timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log_tail()
            try:
                if httpx.get(f"{self.dashboard}/api/version", headers=headers, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise AssertionError(f"the Ray dashboard did not answer within {timeout:.0f}s\n{self.log_tail()}")

    def log_tail(self) -> str:
        self.log.flush()
        return (self.temp_dir / "ray-start.log").read_text()[-3000:]

    def serve_logs_tail(self) -> str:
        """The end of every Serve replica's log: why an application did not come up."""
        logs = sorted((self.temp_dir / "session_latest" / "logs" / "serve").glob("replica_*.log"))
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}" for log in logs)

    def stop(self) -> None:
        # SIGTERM makes `ray start --block` stop the processes it started; SIGKILL to its group mops up the rest.
        if self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)
        self.log.close()


@pytest.fixture
def local_ray_head(tiny_model_dir: Path) -> Iterator[LocalRayHead]:
    """A Ray head of our own; the tiny model is built before it, so replicas never race to build it."""
    # A short path: Ray's unix sockets live under the temp dir and sun_path holds 107 bytes.
    temp_dir = Path(tempfile.mkdtemp(prefix="rayk8s-", dir="/tmp"))
    token = secrets.token_hex(32)
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        # A token of our own for this head and its CLI calls: no shared ~/.ray/auth_token, no open cluster.
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
        # Teardown: SIGTERM would otherwise drain the node for Serve first, which only matters with live traffic.
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
        # No working_dir: Serve imports serve_app from the checkout.
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    env.pop("RAY_ADDRESS", None)
    head = LocalRayHead(temp_dir, env)
    try:
        head.wait_for_dashboard({"Authorization": f"Bearer {token}"})
        yield head
    finally:
        try:
            with contextlib.suppress(subprocess.TimeoutExpired):
                head.cli("shutdown", "-y", timeout=60)
        finally:
            head.stop()
            shutil.rmtree(temp_dir, ignore_errors=True)


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
