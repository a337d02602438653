"""Every overlay renders with `kubectl kustomize` and every object validates against the Kubernetes OpenAPI
schemas offline (kubernetes-validate, strict: unknown fields are errors). Objects of CRDs the schema set does
not cover (KEDA ScaledObject, Prometheus Operator PodMonitor) are checked against the fields we rely on."""

from __future__ import annotations

import copy
import re
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from k8s_render import K8S, K8S_VERSION, VARIANTS, Rendered

# Minimal structural schemas for the CRD objects we ship, written from the CRDs' documented fields
# (keda.sh/v1alpha1 ScaledObject, monitoring.coreos.com/v1 PodMonitor): what we set must be there and typed.
_NAME = {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("keda.sh/v1alpha1", "ScaledObject"): {
        "type": "object",
        "required": ["metadata", "spec"],
        "properties": {
            "metadata": {"type": "object", "required": ["name", "namespace"]},
            "spec": {
                "type": "object",
                "required": ["scaleTargetRef", "triggers"],
                "additionalProperties": False,
                "properties": {
                    "scaleTargetRef": {
                        "type": "object",
                        "required": ["name"],
                        "additionalProperties": False,
                        "properties": {
                            "apiVersion": {"type": "string"},
                            "kind": {"type": "string"},
                            "name": _NAME,
                        },
                    },
                    "minReplicaCount": {"type": "integer", "minimum": 0},
                    "maxReplicaCount": {"type": "integer", "minimum": 1},
                    "pollingInterval": {"type": "integer", "minimum": 1},
                    "cooldownPeriod": {"type": "integer", "minimum": 0},
                    "advanced": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {"horizontalPodAutoscalerConfig": {"type": "object"}},
                    },
                    "triggers": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["type", "metadata"],
                            # Trigger metadata values are strings in the CRD, even numbers.
                            "properties": {"type": {"type": "string"}, "metadata": _STR_MAP},
                        },
                    },
                },
            },
        },
    },
    ("monitoring.coreos.com/v1", "PodMonitor"): {
        "type": "object",
        "required": ["metadata", "spec"],
        "properties": {
            "spec": {
                "type": "object",
                "required": ["selector", "podMetricsEndpoints"],
                "additionalProperties": False,
                "properties": {
                    "selector": {"type": "object"},
                    "podMetricsEndpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "port": {"type": "string"},
                                "path": {"type": "string"},
                                "interval": {"type": "string", "pattern": "^[0-9]+[smh]$"},
                            },
                        },
                    },
                },
            }
        },
    },
}


def validate(obj: dict[str, Any]) -> None:
    schema = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if schema is not None:
        jsonschema.validate(obj, schema)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_object_validates(rendered: dict[str, Rendered], variant: str) -> None:
    objects = rendered[variant].objects
    assert len(objects) > 20
    for obj in objects:
        try:
            validate(obj)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            pytest.fail(f"{variant}: {obj['kind']}/{obj['metadata']['name']}: {exc.message}")


def test_core_objects_present_in_every_overlay(rendered: dict[str, Rendered]) -> None:
    for variant in VARIANTS:
        r = rendered[variant]
        for kind, name in [
            ("Deployment", "pdllm-router"),
            ("Deployment", "pdllm-prefill"),
            ("Deployment", "pdllm-decode"),
            ("Service", "pdllm-router"),
            ("Service", "pdllm-prefill"),
            ("Service", "pdllm-decode"),
            ("ServiceAccount", "pdllm-router"),
            ("Role", "pdllm-router-discovery"),
            ("RoleBinding", "pdllm-router-discovery"),
            ("HorizontalPodAutoscaler", "pdllm-router"),
            ("NetworkPolicy", "pdllm-default-deny"),
        ]:
            r.get(kind, name)
        has_redis = r.maybe("StatefulSet", "pdllm-redis") is not None
        assert has_redis == ("external-redis" not in variant)


def test_validator_rejects_what_a_cluster_would(rendered: dict[str, Rendered]) -> None:
    """The checks above can fail: typos, wrong types and CRD mistakes are caught."""
    deployment = copy.deepcopy(rendered["gpu"].get("Deployment", "pdllm-prefill"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"grpc": {"port": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    deployment = copy.deepcopy(rendered["gpu"].get("Deployment", "pdllm-prefill"))
    deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "150"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    scaled = copy.deepcopy(rendered["gpu"].get("ScaledObject", "pdllm-decode"))
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 4
    with pytest.raises(jsonschema.ValidationError):
        validate(scaled)
    scaled["spec"]["triggers"] = []
    with pytest.raises(jsonschema.ValidationError):
        validate(scaled)


def test_readme_names_only_existing_paths_and_objects(rendered: dict[str, Rendered]) -> None:
    readme = (K8S.parent / "README.md").read_text()
    paths = set(re.findall(r"(?<![\w.])((?:deploy/)?k8s/(?:overlays|components)/[a-z-]+)", readme))
    assert len(paths) >= 6
    for path in paths:
        assert (K8S.parent / path.removeprefix("deploy/")).is_dir(), f"README names missing {path}"
    for component in re.findall(r"\bcomponents/([a-z-]+)", readme):
        assert (K8S / "components" / component / "kustomization.yaml").is_file(), component
    names = {o["metadata"]["name"] for r in rendered.values() for o in r.objects}
    for kind, name in re.findall(r"`(HorizontalPodAutoscaler|Deployment|Service)/([a-z-]+)`", readme):
        assert name in names, f"README names {kind}/{name}, which no overlay renders"
    for name in re.findall(r"(?:deploy|svc)/(pdllm-[a-z]+)", readme):
        assert name in names, f"README names {name}, which no overlay renders"
