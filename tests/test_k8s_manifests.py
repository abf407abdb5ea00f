"""The KubeRay manifests in k8s/: valid against the v1 CRDs (and broken copies rejected), named as KubeRay
requires, and with cluster resources (GPU workers, a GPU-free head) that fit the RayService's app."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

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
    load_manifest,
    quantity,
    schema_errors,
    serve_config,
    strict_validators,
)


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


# --- 2. cluster resources for the Serve application ----------------------------------------------------------


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
