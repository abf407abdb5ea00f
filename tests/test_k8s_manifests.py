"""The KubeRay manifests in k8s/: valid against the v1 CRDs (and broken copies rejected), named as KubeRay
requires, and with cluster resources (GPU workers, a GPU-free head) that fit the RayServices' apps; the hub
example's token, cache claim and GPU worker group sized for its autoscaling engine replicas."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
import yaml

from configs.app_config import AppConfig
from tests.k8s_schema import (
    CRD_DIR,
    DNS_1035_LABEL,
    GPU,
    MANIFESTS,
    MAX_NAME_LENGTH,
    cel_guarded_fields,
    cluster_spec,
    load_crd_schemas,
    load_documents,
    quantity,
    schema_errors,
    strict_validators,
)

HUB_SERVICE = "rayservice-hub.yaml"
# Every KubeRay resource in k8s/ as (kind, file): the three kinds' manifests and the hub-model RayService.
KUBERAY_FILES = [*MANIFESTS.items(), ("RayService", HUB_SERVICE)]


def load_resource(kind: str, file: str) -> dict[str, Any]:
    """The one document of `kind` in k8s/`file`."""
    (document,) = [document for document in load_documents(file) if document["kind"] == kind]
    return document


def app_args(file: str) -> AppConfig:
    """The pagedserve config of a RayService's (single) Serve application."""
    (app,) = yaml.safe_load(load_resource("RayService", file)["spec"]["serveConfigV2"])["applications"]
    return AppConfig.model_validate(app["args"])


@pytest.fixture(scope="module")
def crd_schemas() -> dict[str, dict[str, Any]]:
    """The raw v1 schemas, loaded once per module (about 1 MB of YAML each)."""
    if not CRD_DIR.is_dir():
        pytest.skip(f"KubeRay CRDs not found in {CRD_DIR} (set KUBERAY_CRD_DIR)")
    return load_crd_schemas()


@pytest.fixture(scope="module")
def validators(crd_schemas: dict[str, dict[str, Any]]) -> dict[str, jsonschema.Draft7Validator]:
    return strict_validators(crd_schemas)


# --- 1. schema validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "file"), KUBERAY_FILES, ids=[file for _, file in KUBERAY_FILES])
def test_manifest_validates_against_crd(
    kind: str, file: str, validators: dict[str, jsonschema.Draft7Validator], crd_schemas: dict[str, dict[str, Any]]
) -> None:
    document = load_resource(kind, file)
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
@pytest.mark.parametrize(("kind", "file"), KUBERAY_FILES, ids=[file for _, file in KUBERAY_FILES])
def test_broken_manifest_fails_validation(
    kind: str,
    file: str,
    breakage: Callable[[dict[str, Any]], None],
    validators: dict[str, jsonschema.Draft7Validator],
) -> None:
    document = copy.deepcopy(load_resource(kind, file))
    breakage(document)
    assert schema_errors(validators[kind], document), f"{breakage.__name__} was accepted"


@pytest.mark.parametrize(("kind", "file"), KUBERAY_FILES, ids=[file for _, file in KUBERAY_FILES])
def test_cluster_groups_as_kuberay_checks_them(kind: str, file: str) -> None:
    spec = cluster_spec(load_resource(kind, file))
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


# --- 2. cluster resources for the Serve application ----------------------------------------------------------


def gpu_workers(kind: str, file: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The head group and the (single) worker group whose pods get GPUs."""
    spec = cluster_spec(load_resource(kind, file))
    (group,) = [
        group
        for group in spec["workerGroupSpecs"]
        if GPU in group["template"]["spec"]["containers"][0]["resources"]["limits"]
    ]
    return spec["headGroupSpec"], group


GPU_FILES = [
    ("RayService", MANIFESTS["RayService"]),
    ("RayCluster", MANIFESTS["RayCluster"]),
    ("RayService", HUB_SERVICE),
]


@pytest.mark.parametrize(("kind", "file"), GPU_FILES, ids=[file for _, file in GPU_FILES])
def test_gpu_workers_and_a_gpu_free_head(kind: str, file: str) -> None:
    head, group = gpu_workers(kind, file)
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
    args = app_args(MANIFESTS["RayService"])
    head, group = gpu_workers("RayService", MANIFESTS["RayService"])
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


# --- 3. the hub-model RayService: token, cache claim, autoscaling GPU engines --------------------------------


def pod_specs(file: str) -> dict[str, dict[str, Any]]:
    """Every pod template of a manifest's cluster by group name ("head" for the head group)."""
    spec = cluster_spec(load_resource("RayService", file))
    pods = {"head": spec["headGroupSpec"]["template"]["spec"]}
    pods.update({group["groupName"]: group["template"]["spec"] for group in spec["workerGroupSpecs"]})
    return pods


def test_hub_pods_share_the_token_and_the_cache_claim() -> None:
    """Every pod may resolve the hub id (the ingress and the scheduler read config and tokenizer, the workers the
    weights): each gets HF_TOKEN from one Secret and the hub cache from one ReadWriteMany claim."""
    args = app_args(HUB_SERVICE)
    (claim,) = [document for document in load_documents(HUB_SERVICE) if document["kind"] == "PersistentVolumeClaim"]
    assert "ReadWriteMany" in claim["spec"]["accessModes"], "pods on different nodes mount the cache at once"
    pods = pod_specs(HUB_SERVICE)
    assert len(pods) >= 3  # the head and at least two worker groups
    token_sources = set()
    for group_name, pod in pods.items():
        (container,) = pod["containers"]
        env = {variable["name"]: variable for variable in container.get("env", [])}
        secret_ref = env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
        token_sources.add((secret_ref["name"], secret_ref["key"]))
        assert "value" not in env["HF_TOKEN"], f"{group_name}: the token must not be written in the manifest"
        assert "HF_HUB_OFFLINE" not in env, f"{group_name}: a hub model is downloaded on first use"
        claims = {
            volume["name"]: volume["persistentVolumeClaim"]["claimName"]
            for volume in pod["volumes"]
            if "persistentVolumeClaim" in volume
        }
        cache_mounts = [
            mount["mountPath"]
            for mount in container["volumeMounts"]
            if claims.get(mount["name"]) == claim["metadata"]["name"]
        ]
        assert len(cache_mounts) == 1, f"{group_name} does not mount {claim['metadata']['name']}"
        (cache_mount,) = cache_mounts
        assert env["HF_HOME"]["value"] == cache_mount, group_name
        assert args.model.download_dir.startswith(cache_mount + "/"), group_name
        # The rayproject images run as uid 1000, gid 100: the claim must be writable for that group.
        assert pod["securityContext"]["fsGroup"] == 100, group_name
    assert len(token_sources) == 1, token_sources


def test_hub_gpu_pods_hold_one_engine_replica() -> None:
    """An engine replica is a STRICT_PACK placement group of TP x PP {CPU: worker_num_cpus, GPU: 1} bundles: each
    GPU pod holds exactly one, and no CPU left over for an ingress replica that would keep an idle pod alive."""
    args = app_args(HUB_SERVICE)
    assert (args.model.device, args.model.dtype, args.parallel.tensor_parallel_size) == ("cuda", "bfloat16", 2)
    assert args.parallel.placement_strategy == "STRICT_PACK"
    _, group = gpu_workers("RayService", HUB_SERVICE)
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    world_size = args.parallel.tensor_parallel_size * args.parallel.pipeline_parallel_size
    assert int(limits[GPU]) == world_size
    assert group["rayStartParams"]["num-gpus"] == str(world_size)
    ray_cpus = quantity(group["rayStartParams"]["num-cpus"])
    assert ray_cpus == world_size * args.parallel.worker_num_cpus
    assert quantity(limits["cpu"]) >= ray_cpus, "Ray may not advertise more CPUs than the pod gets"


def test_hub_gpu_group_scales_with_the_engine_replicas() -> None:
    spec = cluster_spec(load_resource("RayService", HUB_SERVICE))
    assert spec["enableInTreeAutoscaling"] is True
    options = spec["autoscalerOptions"]
    assert options["idleTimeoutSeconds"] > 0 and options["upscalingMode"] in ("Default", "Aggressive", "Conservative")
    engines = app_args(HUB_SERVICE).serve.engine_autoscaling
    assert engines is not None and engines.max_replicas > engines.min_replicas
    _, group = gpu_workers("RayService", HUB_SERVICE)
    # Each engine replica needs a pod of its own.
    assert group["maxReplicas"] >= engines.max_replicas
    initial = engines.min_replicas if engines.initial_replicas is None else engines.initial_replicas
    assert group["replicas"] >= initial
    # A CUDA engine decides its device from the GPUs the cluster has when it starts: the first one needs a pod.
    assert group["minReplicas"] >= max(engines.min_replicas, 1)


def test_hub_ingress_replicas_fit_the_cpu_group() -> None:
    """The head advertises no CPUs and the GPU pods none spare: the ingress replicas scale on the CPU group."""
    serve = app_args(HUB_SERVICE).serve
    assert serve.autoscaling_config is not None
    head, gpu_group = gpu_workers("RayService", HUB_SERVICE)
    assert head["rayStartParams"]["num-cpus"] == "0"
    (cpu_group,) = [
        group
        for group in cluster_spec(load_resource("RayService", HUB_SERVICE))["workerGroupSpecs"]
        if group["groupName"] != gpu_group["groupName"]
    ]
    resources = cpu_group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert GPU not in resources, "ingress scaling must not start GPU pods"
    ray_cpus = quantity(cpu_group["rayStartParams"].get("num-cpus", resources["cpu"]))
    replicas_per_pod = int(ray_cpus // serve.ingress_num_cpus)
    assert replicas_per_pod * cpu_group["minReplicas"] >= serve.autoscaling_config["min_replicas"]
    assert replicas_per_pod * cpu_group["maxReplicas"] >= serve.autoscaling_config["max_replicas"]
