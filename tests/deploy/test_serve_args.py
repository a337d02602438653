"""The rendered manifests start roles that `pdllm serve` accepts: args + env (ConfigMap, env) parse cleanly."""

from __future__ import annotations

import os

import pytest
from k8s_render import VARIANTS, Rendered, containers, pod_spec

from pdllm.shared.app.serve import build_parser
from pdllm.shared.rpc.options import server_config_from_args


def _environment(rendered: Rendered, container: dict) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        env.update(rendered.get("ConfigMap", name)["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var.get("valueFrom", {}):
            env[var["name"]] = "pdllm"  # the pod's namespace, filled in by the kubelet
    return {k: v for k, v in env.items() if k != "PDLLM_AUTH_TOKEN"}  # a Secret: not needed to parse


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_role_parses_its_args_and_env(rendered, monkeypatch, tmp_path, variant: str) -> None:
    objects = rendered[variant]
    roles = set()
    for deployment in objects.of_kind("Deployment"):
        for container in containers(deployment):
            args = container.get("args", [])
            if args[:1] != ["serve"]:
                continue
            for key in [k for k in os.environ if k.startswith("PDLLM_")]:
                monkeypatch.delenv(key)
            for key, value in _environment(objects, container).items():
                if key in ("PDLLM_TLS_CERT", "PDLLM_TLS_KEY"):  # mounted from a Secret in the pod
                    value = str(tmp_path / value.rsplit("/", 1)[-1])
                    (tmp_path / value.rsplit("/", 1)[-1]).write_text("pem")
                monkeypatch.setenv(key, value)
            parsed = build_parser().parse_args(args[1:])
            config = server_config_from_args(parsed, parsed.role)
            roles.add(parsed.role)
            assert config.host == "0.0.0.0" and config.port > 0
            assert parsed.model, "workers and router need the model directory (tokenizer, weights)"
            if parsed.role == "router":
                assert parsed.discovery == "kubernetes"
                assert parsed.k8s_prefill_service and parsed.k8s_decode_service and parsed.k8s_namespace
            else:
                assert parsed.kv_url.startswith("redis://")
                want_gpu = "nvidia.com/gpu" in str(container.get("resources", {}))
                assert (parsed.device == "cuda") == want_gpu, pod_spec(deployment).get("nodeSelector")
    assert roles == {"router", "prefill", "decode"}
