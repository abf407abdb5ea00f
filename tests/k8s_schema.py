"""Shared by the tests/test_k8s_*.py modules: the KubeRay manifests in k8s/ as loaded documents, and the v1
CRDs' structural schemas as jsonschema validators (what the API server checks under strict field validation),
and the Grafana dashboard's PromQL expressions."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import yaml

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


def load_crd_schemas() -> dict[str, dict[str, Any]]:
    """The raw v1 schemas of the three kinds (about 1 MB of YAML each); CRD_DIR must exist."""
    return {kind: crd_schema(kind) for kind in MANIFESTS}


def strict_validators(crd_schemas: dict[str, dict[str, Any]]) -> dict[str, jsonschema.Draft7Validator]:
    """One validator per kind for kubernetes_strict(schema), itself checked as a valid Draft 7 schema first."""
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


# --- the Grafana dashboard -----------------------------------------------------------------------------------


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((K8S / "grafana-dashboard.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
