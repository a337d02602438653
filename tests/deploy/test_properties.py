"""Properties of the rendered manifests that matter for running pdllm safely, checked on every overlay."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest
import yaml
from k8s_render import (
    K8S,
    K8S_VERSION,
    REPO,
    VARIANTS,
    Rendered,
    containers,
    env_of,
    pod_labels,
    pod_spec,
    selector_matches,
)
from netpol import Pod, allowed

PDLLM_COMPONENTS = ("router", "prefill", "decode")
# The service contract's flags; each may come from the env var PDLLM_<FLAG_UPPER>.
FLAGS = {
    "role", "host", "port", "metrics-port", "model", "kv-url", "device", "dtype", "drain-seconds", "discovery",
    "prefill-workers", "decode-workers", "k8s-namespace", "k8s-prefill-service", "k8s-decode-service",
    "tls-cert", "tls-key", "auth-token",
}  # fmt: skip
ENV_FOR_FLAG = {"PDLLM_" + f.upper().replace("-", "_") for f in FLAGS}


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_container_has_resources_probes_and_runs_locked_down(
    rendered: dict[str, Rendered], variant: str
) -> None:
    for workload in rendered[variant].workloads():
        spec, name = pod_spec(workload), workload["metadata"]["name"]
        pod_sc = spec.get("securityContext", {})
        assert pod_sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", name
        assert spec.get("enableServiceLinks") is False, f"{name}: service links pollute the PDLLM_ env"
        assert "hostPath" not in str(spec.get("volumes", [])), name
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), name
        for c in containers(workload):
            where = f"{variant}: {name}/{c['name']}"
            requests, limits = c["resources"].get("requests", {}), c["resources"].get("limits", {})
            assert {"cpu", "memory"} <= set(requests) and "memory" in limits, where
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert probe in c, f"{where}: no {probe}"
            sc = c["securityContext"]
            assert (sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))) is True, where
            assert sc.get("runAsUser", pod_sc.get("runAsUser", 0)) != 0, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add"), where
            assert not sc.get("privileged"), where
            assert c["image"].split(":")[-1] not in ("", "latest") and ":" in c["image"], where


@pytest.mark.parametrize("variant", VARIANTS)
def test_pdllm_pods_probe_grpc_health_and_drain_within_grace(
    rendered: dict[str, Rendered], variant: str
) -> None:
    r = rendered[variant]
    config = r.config()
    port, drain = int(config["PDLLM_PORT"]), int(config["PDLLM_DRAIN_SECONDS"])
    for component in PDLLM_COMPONENTS:
        workload = r.component(component)
        spec = pod_spec(workload)
        (c,) = spec["containers"]
        assert c["args"][:3] == ["serve", "--role", component]
        assert {"name": "grpc", "containerPort": port, "protocol": "TCP"} in c["ports"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if "tls" in variant:  # the kubelet's gRPC probe cannot speak TLS: exec the image's TLS probe
                command = c[probe]["exec"]["command"]
                assert command[:2] == ["python", "/opt/pdllm/bin/healthcheck.py"] and "grpc" not in c[probe]
                ca = command[command.index("--ca") + 1]
                tls_mount = {m["mountPath"]: m for m in c["volumeMounts"]}["/etc/pdllm/tls"]
                assert ca.startswith("/etc/pdllm/tls/") and tls_mount["readOnly"] is True
                assert r.config()["PDLLM_TLS_CERT"].startswith("/etc/pdllm/tls/")
            else:
                assert c[probe]["grpc"]["port"] == port, (
                    f"{component} {probe} must hit the gRPC health service"
                )
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "model load needs minutes"
        pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert spec["terminationGracePeriodSeconds"] >= pre_stop + drain + 5, component
        # The root filesystem is read-only: HOME and TMP must be writable volumes.
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        for path in ("/tmp", "/home/pdllm"):
            assert "emptyDir" in volumes[mounts[path]], f"{component}: {path} is not an emptyDir"


@pytest.mark.parametrize("variant", VARIANTS)
def test_env_is_the_service_contract(rendered: dict[str, Rendered], variant: str) -> None:
    r = rendered[variant]
    config_names = {c["metadata"]["name"] for c in r.of_kind("ConfigMap")}
    secret_names = {s["metadata"]["name"] for s in r.of_kind("Secret")}
    unknown = set(r.config()) - ENV_FOR_FLAG
    assert not unknown, f"ConfigMap keys that are no pdllm flag: {unknown}"
    external_secrets = set()
    for component in PDLLM_COMPONENTS:
        (c,) = pod_spec(r.component(component))["containers"]
        assert not set(env_of(c)) - ENV_FOR_FLAG, f"{component}: env vars that are no pdllm flag"
        for source in c["envFrom"]:
            assert source["configMapRef"]["name"] in config_names
        token = env_of(c)["PDLLM_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        if token["name"] not in secret_names:
            external_secrets.add(token["name"])
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref and ref["name"] not in secret_names:
                external_secrets.add(ref["name"])
    for workload in r.workloads():
        for volume in pod_spec(workload).get("volumes", []):
            if "secret" in volume and volume["secret"]["secretName"] not in secret_names:
                external_secrets.add(volume["secret"]["secretName"])
    # cpu-dev works out of the box; elsewhere the Secrets the README tells you to create.
    expected = {"cpu-dev": set(), "gpu": {"pdllm-auth"}}.get(variant, {"pdllm-auth", "pdllm-kv", "pdllm-tls"})
    readme = (REPO / "deploy" / "README.md").read_text()
    assert all(
        f"create secret generic {name}" in readme or f"create secret tls {name}" in readme
        for name in expected
    )
    assert external_secrets == expected


@pytest.mark.parametrize("variant", VARIANTS)
def test_gpus_are_requested_by_workers_only(rendered: dict[str, Rendered], variant: str) -> None:
    r = rendered[variant]
    gpu_users = set()
    for workload in r.workloads():
        spec = pod_spec(workload)
        for c in containers(workload):
            requests, limits = c["resources"].get("requests", {}), c["resources"].get("limits", {})
            if "nvidia.com/gpu" in requests or "nvidia.com/gpu" in limits:
                assert requests.get("nvidia.com/gpu") == limits.get("nvidia.com/gpu") == "1"
                gpu_users.add(pod_labels(workload)["app.kubernetes.io/component"])
        on_gpu_nodes = "nodeSelector" in spec or "tolerations" in spec
        assert on_gpu_nodes == (pod_labels(workload)["app.kubernetes.io/component"] in gpu_users)
    # The device each pdllm process will use (an `env` entry overrides the ConfigMap) matches its GPU request.
    for component in PDLLM_COMPONENTS:
        (c,) = pod_spec(r.component(component))["containers"]
        device = env_of(c).get("PDLLM_DEVICE", {}).get("value", r.config()["PDLLM_DEVICE"])
        assert device == ("cuda" if component in gpu_users else "cpu"), f"{variant}: {component} on {device}"
    if variant.startswith("gpu"):
        assert gpu_users == {"prefill", "decode"}
        assert r.config()["PDLLM_DEVICE"] == "cuda"
        for component in ("prefill", "decode"):
            shm = {v["name"]: v for v in pod_spec(r.component(component))["volumes"]}["dshm"]["emptyDir"]
            assert shm["medium"] == "Memory"
    else:
        assert gpu_users == set() and r.config()["PDLLM_DEVICE"] == "cpu"


@pytest.mark.parametrize("variant", VARIANTS)
def test_rbac_router_reads_endpointslices_and_nothing_else(
    rendered: dict[str, Rendered], variant: str
) -> None:
    r = rendered[variant]
    assert not r.of_kind("ClusterRole") and not r.of_kind("ClusterRoleBinding")
    (role,) = r.of_kind("Role")
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    (binding,) = r.of_kind("RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "pdllm-router-discovery",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "pdllm-router", "namespace": r.namespace()}
    ]
    for workload in r.workloads():
        spec = pod_spec(workload)
        if pod_labels(workload)["app.kubernetes.io/component"] == "router":
            assert spec["serviceAccountName"] == "pdllm-router"
        else:  # no API token in any other pod
            assert (
                spec["serviceAccountName"] != "pdllm-router" and spec["automountServiceAccountToken"] is False
            )


@pytest.mark.parametrize("variant", VARIANTS)
def test_router_discovery_points_at_the_rendered_worker_services(
    rendered: dict[str, Rendered], variant: str
) -> None:
    r = rendered[variant]
    (router,) = pod_spec(r.component("router"))["containers"]
    env = env_of(router)
    assert env["PDLLM_DISCOVERY"]["value"] == "kubernetes"
    assert env["PDLLM_K8S_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    port = int(r.config()["PDLLM_PORT"])
    for role in ("prefill", "decode"):
        service = r.get("Service", env[f"PDLLM_K8S_{role.upper()}_SERVICE"]["value"])
        # Headless, so its EndpointSlices list every ready pod and the router balances per request.
        assert service["spec"]["clusterIP"] == "None"
        assert not service["spec"].get("publishNotReadyAddresses", False)
        assert selector_matches({"matchLabels": service["spec"]["selector"]}, pod_labels(r.component(role)))
        others = [w for w in r.workloads() if w is not r.component(role)]
        assert not any(
            selector_matches({"matchLabels": service["spec"]["selector"]}, pod_labels(w)) for w in others
        )
        # router.discovery reads the EndpointSlice port named "grpc".
        (grpc_port,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
        (container,) = pod_spec(r.component(role))["containers"]
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert named[grpc_port["targetPort"]] == grpc_port["port"] == port


@pytest.mark.parametrize("variant", VARIANTS)
def test_kv_url_reaches_redis(rendered: dict[str, Rendered], variant: str) -> None:
    r = rendered[variant]
    if "external-redis" in variant:
        for role in ("prefill", "decode"):
            (c,) = pod_spec(r.component(role))["containers"]
            assert env_of(c)["PDLLM_KV_URL"]["valueFrom"]["secretKeyRef"] == {
                "name": "pdllm-kv",
                "key": "url",
            }
        return
    match = re.fullmatch(r"redis://([a-z0-9-]+):(\d+)/\d+", r.config()["PDLLM_KV_URL"])
    assert match, r.config()["PDLLM_KV_URL"]
    service = r.get("Service", match.group(1))
    assert int(match.group(2)) in [p["port"] for p in service["spec"]["ports"]]
    assert selector_matches({"matchLabels": service["spec"]["selector"]}, pod_labels(r.component("redis")))


def _pods(r: Rendered) -> dict[str, Pod]:
    pods = {}
    for workload in r.workloads():
        ports = {p["name"]: p["containerPort"] for c in containers(workload) for p in c.get("ports", [])}
        pods[pod_labels(workload)["app.kubernetes.io/component"]] = Pod(pod_labels(workload), ports)
    pods["stranger"] = Pod({"app": "something-else"}, {})
    # A pod labelled like pdllm but no router (a debug pod, a future component): no egress policy applies.
    pods["pdllm-other"] = Pod({"app.kubernetes.io/name": "pdllm", "app.kubernetes.io/component": "tools"}, {})
    pods["other-namespace"] = Pod(
        {"app.kubernetes.io/component": "router", "app.kubernetes.io/name": "pdllm"}, {}, False
    )
    return pods


@pytest.mark.parametrize("variant", VARIANTS)
def test_network_policies_admit_only_the_pdllm_flows(rendered: dict[str, Rendered], variant: str) -> None:
    r = rendered[variant]
    policies, pods = r.of_kind("NetworkPolicy"), _pods(r)
    for pod in pods.values():
        if pod.in_namespace:
            assert selector_matches(
                r.get("NetworkPolicy", "pdllm-default-deny")["spec"]["podSelector"], pod.labels
            )
    expect = {  # (source, destination, port): allowed
        ("stranger", "router", 50051): True,
        ("other-namespace", "router", 50051): True,
        ("router", "prefill", 50051): True,
        ("router", "decode", 50051): True,
        ("stranger", "prefill", 50051): False,
        ("other-namespace", "decode", 50051): False,
        ("prefill", "decode", 50051): False,
        ("pdllm-other", "decode", 50051): False,
        ("pdllm-other", "prefill", 50051): False,
        ("pdllm-other", "router", 50051): True,
        ("decode", "prefill", 50051): False,
        ("stranger", "prefill", 9400): True,  # metrics for Prometheus
        ("prefill", "router", 9400): False,  # workers have no egress but Redis and DNS
        ("prefill", "stranger", 443): False,
    }
    if "external-redis" not in variant:
        expect |= {
            ("prefill", "redis", 6379): True,
            ("decode", "redis", 6379): True,
            ("router", "redis", 6379): False,
            ("stranger", "redis", 6379): False,
            ("pdllm-other", "redis", 6379): False,
            ("redis", "stranger", 80): False,
        }
    for (src, dst, port), verdict in expect.items():
        assert allowed(policies, pods[src], pods[dst], port) is verdict, f"{variant}: {src} -> {dst}:{port}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_scaling_disruption_spread_and_metrics(rendered: dict[str, Rendered], variant: str) -> None:
    r = rendered[variant]
    metrics_port = r.config()["PDLLM_METRICS_PORT"]
    for component in PDLLM_COMPONENTS:
        workload = r.component(component)
        assert "replicas" not in workload["spec"], "autoscalers own replica counts"
        labels, spec = pod_labels(workload), pod_spec(workload)
        (pdb,) = [
            p for p in r.of_kind("PodDisruptionBudget") if selector_matches(p["spec"]["selector"], labels)
        ]
        assert pdb["spec"].get("maxUnavailable") == 1
        spreads = spec["topologySpreadConstraints"]
        assert {s["topologyKey"] for s in spreads} == {
            "topology.kubernetes.io/zone",
            "kubernetes.io/hostname",
        }
        assert all(selector_matches(s["labelSelector"], labels) for s in spreads)
        notes = workload["spec"]["template"]["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics"
        (c,) = spec["containers"]
        assert {"name": "metrics", "containerPort": int(notes["prometheus.io/port"]), "protocol": "TCP"} in c[
            "ports"
        ]
        assert notes["prometheus.io/port"] == metrics_port
    (hpa,) = r.of_kind("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "pdllm-router",
    }
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    scaled = {s["spec"]["scaleTargetRef"]["name"]: s for s in r.of_kind("ScaledObject")}
    if not variant.startswith("gpu"):
        assert scaled == {}, "cpu-dev must run on clusters without KEDA"
        return
    assert set(scaled) == {"pdllm-prefill", "pdllm-decode"}
    for name, obj in scaled.items():
        role = pod_labels(r.get("Deployment", name))["app.kubernetes.io/component"]
        (trigger,) = obj["spec"]["triggers"]
        assert trigger["type"] == "prometheus"
        query = trigger["metadata"]["query"]
        assert re.fullmatch(
            rf'sum\(pdllm_queue_depth\{{role="{role}", namespace="{r.namespace()}"\}}\)', query
        )
        assert obj["spec"]["minReplicaCount"] >= 1
    if "podmonitor" in variant:
        (monitor,) = r.of_kind("PodMonitor")
        assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
        for component in PDLLM_COMPONENTS:
            assert selector_matches(monitor["spec"]["selector"], pod_labels(r.component(component)))
        redis_labels = {"app.kubernetes.io/name": "pdllm", "app.kubernetes.io/component": "redis"}
        assert not selector_matches(monitor["spec"]["selector"], redis_labels)


def test_model_volume_is_read_only_for_services_and_the_loader_writes_it(
    rendered: dict[str, Rendered],
) -> None:
    r = rendered["gpu"]
    (pvc,) = r.of_kind("PersistentVolumeClaim")
    model_dir = r.config()["PDLLM_MODEL"]
    for component in PDLLM_COMPONENTS:
        spec = pod_spec(r.component(component))
        (volume,) = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
        assert volume["persistentVolumeClaim"] == {"claimName": pvc["metadata"]["name"], "readOnly": True}
        (c,) = spec["containers"]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == volume["name"]]
        assert mount["readOnly"] is True and model_dir.startswith(mount["mountPath"] + "/")
    loader = yaml.safe_load((K8S / "tools" / "model-loader.yaml").read_text())
    kubernetes_validate.validate(loader, K8S_VERSION, strict=True)
    (claim,) = [v["persistentVolumeClaim"] for v in loader["spec"]["volumes"] if "persistentVolumeClaim" in v]
    assert claim["claimName"] == pvc["metadata"]["name"] and not claim.get("readOnly")
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    (c,) = loader["spec"]["containers"]
    assert (
        c["securityContext"]["readOnlyRootFilesystem"] is True
        and loader["spec"]["securityContext"]["runAsUser"] == 10001
    )
    assert (
        c["image"].rsplit(":", 1)[0]
        == pod_spec(r.component("prefill"))["containers"][0]["image"].rsplit(":", 1)[0]
    )
