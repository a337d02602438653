"""KubernetesDiscovery against a loopback server speaking the EndpointSlice list/watch API."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from k8s_fake import FakeApiServer, make_slice, recorded_list, wait_until
from kubernetes import client

from pdllm.router.discovery import (
    DiscoveryError,
    KubernetesDiscovery,
    KubernetesDiscoveryConfig,
    discovery_from_flags,
    ready_addresses,
)


def test_recorded_slices_keep_ready_endpoints_only() -> None:
    api = client.ApiClient()
    listed = api._ApiClient__deserialize(recorded_list(), "V1EndpointSliceList")
    got = ready_addresses(listed.items, port_name="grpc")
    # 10.4.2.9 is not ready, 10.4.3.22 is terminating (ready=false); empty conditions mean "unknown" = ready.
    assert got == frozenset({"10.4.1.17:50051", "10.4.3.40:50051", "[fd00:10:4::1b]:50051"})
    assert ready_addresses(listed.items, port_name="metrics") == frozenset(
        {"10.4.1.17:9400", "10.4.3.40:9400", "[fd00:10:4::1b]:9400"}
    )
    assert ready_addresses(listed.items, port_name="nope") == frozenset()


@pytest.fixture
def discovery(apiserver: FakeApiServer) -> Iterator[KubernetesDiscovery]:
    apiserver.apply(
        make_slice("pdllm-prefill-aaaaa", "pdllm-prefill", [("10.0.0.1", True), ("10.0.0.2", False)])
    )
    apiserver.apply(make_slice("pdllm-decode-bbbbb", "pdllm-decode", [("10.0.1.1", True)]))
    apiserver.apply(make_slice("other-ccccc", "other-service", [("10.9.9.9", True)]))
    config = KubernetesDiscoveryConfig(
        namespace="pdllm",
        services={"prefill": "pdllm-prefill", "decode": "pdllm-decode"},
        watch_timeout_s=30,
        retry_backoff_s=0.05,
        max_backoff_s=0.2,
    )
    disc = KubernetesDiscovery(config, apiserver.api_client())
    events: list[tuple[str, frozenset[str]]] = []
    disc.subscribe(lambda role, addrs: events.append((role, addrs)))
    disc.events = events  # type: ignore[attr-defined]
    disc.start()
    yield disc
    disc.stop()


def test_initial_list_watch_add_not_ready_remove(
    apiserver: FakeApiServer, discovery: KubernetesDiscovery
) -> None:
    assert wait_until(lambda: discovery.workers("prefill") == {"10.0.0.1:50051"})
    assert wait_until(lambda: discovery.workers("decode") == {"10.0.1.1:50051"})
    # Selector comes from the Service name label, the only link between a Service and its slices.
    lists = [q for q in apiserver.requests if "watch" not in q]
    assert {q["labelSelector"][0] for q in lists} == {
        "kubernetes.io/service-name=pdllm-prefill",
        "kubernetes.io/service-name=pdllm-decode",
    }

    apiserver.apply(
        make_slice("pdllm-prefill-aaaaa", "pdllm-prefill", [("10.0.0.1", True), ("10.0.0.2", True)])
    )
    assert wait_until(lambda: discovery.workers("prefill") == {"10.0.0.1:50051", "10.0.0.2:50051"})

    apiserver.apply(make_slice("pdllm-prefill-ddddd", "pdllm-prefill", [("10.0.0.3", None)]))
    assert wait_until(
        lambda: discovery.workers("prefill") == {"10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"}
    )

    apiserver.apply(
        make_slice("pdllm-prefill-aaaaa", "pdllm-prefill", [("10.0.0.1", False), ("10.0.0.2", True)])
    )
    assert wait_until(lambda: discovery.workers("prefill") == {"10.0.0.2:50051", "10.0.0.3:50051"})

    apiserver.delete("pdllm-prefill-ddddd")
    assert wait_until(lambda: discovery.workers("prefill") == {"10.0.0.2:50051"})
    apiserver.delete("pdllm-decode-bbbbb")
    assert wait_until(lambda: discovery.workers("decode") == frozenset())

    # A slice of another Service never leaks in, and callbacks saw each distinct set exactly once in order.
    prefill_sets = [addrs for role, addrs in discovery.events if role == "prefill"]  # type: ignore[attr-defined]
    assert prefill_sets == [
        frozenset(),
        {"10.0.0.1:50051"},
        {"10.0.0.1:50051", "10.0.0.2:50051"},
        {"10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"},
        {"10.0.0.2:50051", "10.0.0.3:50051"},
        {"10.0.0.2:50051"},
    ]
    assert discovery.relists == {"prefill": 1, "decode": 1}


def test_watch_expiry_rewatches_from_last_version_without_relisting(
    apiserver: FakeApiServer, discovery: KubernetesDiscovery
) -> None:
    assert wait_until(lambda: discovery.workers("prefill") == {"10.0.0.1:50051"})
    assert wait_until(lambda: len(apiserver.watch_requests()) == 2)
    apiserver.apply(make_slice("pdllm-prefill-aaaaa", "pdllm-prefill", [("10.0.0.5", True)]))
    assert wait_until(lambda: discovery.workers("prefill") == {"10.0.0.5:50051"})
    last_rv = apiserver.rv

    apiserver.expire_watches()  # the API server closes every watch (its timeout)
    assert wait_until(lambda: len(apiserver.watch_requests()) >= 4)
    rewatch = [q for q in apiserver.watch_requests()[2:] if "pdllm-prefill" in q["labelSelector"][0]]
    assert rewatch and rewatch[0]["resourceVersion"] == [str(last_rv)]
    assert discovery.relists == {"prefill": 1, "decode": 1}

    apiserver.apply(make_slice("pdllm-prefill-aaaaa", "pdllm-prefill", [("10.0.0.6", True)]))
    assert wait_until(lambda: discovery.workers("prefill") == {"10.0.0.6:50051"})


def test_410_gone_triggers_relist_and_resync(
    apiserver: FakeApiServer, discovery: KubernetesDiscovery
) -> None:
    assert wait_until(lambda: discovery.workers("prefill") == {"10.0.0.1:50051"})
    assert wait_until(lambda: len(apiserver.watch_requests()) == 2)
    # Changes the client never sees through its watch; then history is compacted past its version.
    apiserver.set_hold(True)
    apiserver.apply(
        make_slice("pdllm-prefill-aaaaa", "pdllm-prefill", [("10.0.0.7", True), ("10.0.0.8", True)])
    )
    apiserver.apply(make_slice("pdllm-decode-eeeee", "pdllm-decode", [("10.0.1.2", True)]))
    apiserver.compact()
    apiserver.set_hold(False)
    apiserver.expire_watches()

    assert wait_until(lambda: discovery.workers("prefill") == {"10.0.0.7:50051", "10.0.0.8:50051"})
    assert wait_until(lambda: discovery.workers("decode") == {"10.0.1.1:50051", "10.0.1.2:50051"})
    assert discovery.relists == {"prefill": 2, "decode": 2}
    # After the resync the watch resumes from the fresh list's version and keeps delivering.
    apiserver.delete("pdllm-decode-eeeee")
    assert wait_until(lambda: discovery.workers("decode") == {"10.0.1.1:50051"})


def test_api_errors_keep_last_known_workers_then_recover(
    apiserver: FakeApiServer, discovery: KubernetesDiscovery
) -> None:
    assert wait_until(lambda: discovery.workers("decode") == {"10.0.1.1:50051"})
    apiserver.fail_with = 503
    apiserver.expire_watches()
    assert wait_until(lambda: discovery.relists["decode"] == 1 and len(apiserver.requests) > 8)
    assert discovery.workers("decode") == {"10.0.1.1:50051"}  # an API outage must not empty the pool
    apiserver.fail_with = None
    apiserver.apply(make_slice("pdllm-decode-bbbbb", "pdllm-decode", [("10.0.1.9", True)]))
    assert wait_until(lambda: discovery.workers("decode") == {"10.0.1.9:50051"})


def test_bad_configuration_is_a_clear_error(apiserver: FakeApiServer) -> None:
    with pytest.raises(DiscoveryError, match="k8s-namespace"):
        KubernetesDiscoveryConfig(namespace="", services={"prefill": "x"})
    with pytest.raises(DiscoveryError, match="--k8s-decode-service"):
        discovery_from_flags("kubernetes", {"k8s_namespace": "ns", "k8s_prefill_service": "p"})
    with pytest.raises(DiscoveryError, match="'static' or 'kubernetes'"):
        discovery_from_flags("dns", {})
    disc = KubernetesDiscovery(
        KubernetesDiscoveryConfig(namespace="ns", services={"prefill": "p"}), apiserver.api_client()
    )
    with pytest.raises(DiscoveryError, match="unknown role"):
        disc.workers("decode")


def test_flags_build_a_working_discovery_from_kubeconfig(
    apiserver: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off-cluster (no service account), the router falls back to the kubeconfig, as `kubectl` would."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    # Loading a kubeconfig replaces the client library's process-wide default configuration: restore it.
    monkeypatch.setattr(client.Configuration, "_default", client.Configuration._default)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(DiscoveryError, match="no usable kubeconfig"):
        discovery_from_flags(
            "kubernetes", {"k8s_namespace": "pdllm", "k8s_prefill_service": "p", "k8s_decode_service": "d"}
        )

    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": apiserver.url}}],
        "users": [{"name": "router", "user": {"token": "t"}}],
        "contexts": [
            {"name": "fake", "context": {"cluster": "fake", "user": "router", "namespace": "pdllm"}}
        ],
        "current-context": "fake",
    }
    (tmp_path / "config").write_text(json.dumps(kubeconfig))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "config"))
    apiserver.apply(make_slice("pdllm-prefill-aaaaa", "pdllm-prefill", [("10.0.0.1", True)]))
    apiserver.apply(make_slice("pdllm-decode-bbbbb", "pdllm-decode", [("10.0.1.1", True)]))
    flags = {
        "k8s_namespace": "pdllm",
        "k8s_prefill_service": "pdllm-prefill",
        "k8s_decode_service": "pdllm-decode",
    }
    source = discovery_from_flags("kubernetes", flags)
    source.start()
    try:
        assert wait_until(lambda: source.workers("prefill") == {"10.0.0.1:50051"})
        assert wait_until(lambda: source.workers("decode") == {"10.0.1.1:50051"})
    finally:
        source.stop()
