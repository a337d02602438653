"""Evaluate NetworkPolicy objects the way the API defines them, for pods of one namespace.

A pod is isolated for a direction when any policy of that direction selects it; then a connection is allowed
only if some selecting policy has a rule whose peers match the other pod and whose ports match the port.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from k8s_render import selector_matches

Obj = dict[str, Any]


@dataclass(frozen=True)
class Pod:
    labels: dict[str, str]
    named_ports: dict[str, int]
    in_namespace: bool = True  # False: a pod in some other namespace
    namespace_labels: dict[str, str] = field(default_factory=dict)


def _selecting(policies: list[Obj], pod: Pod, direction: str) -> list[Obj]:
    if not pod.in_namespace:
        return []
    return [
        p
        for p in policies
        if direction in p["spec"].get("policyTypes", ["Ingress"])
        and selector_matches(p["spec"]["podSelector"], pod.labels)
    ]


def _peer_matches(peer: Obj, other: Pod) -> bool:
    if "ipBlock" in peer:
        return True  # whether an ipBlock covers pod IPs is up to the CNI; treat it as covering them
    ns_sel, pod_sel = peer.get("namespaceSelector"), peer.get("podSelector")
    if ns_sel is None and not other.in_namespace:
        return False  # a bare podSelector selects pods of the policy's own namespace only
    if ns_sel is not None and not selector_matches(ns_sel, other.namespace_labels):
        return False
    return pod_sel is None or selector_matches(pod_sel, other.labels)


def _port_matches(rule: Obj, port: int, target: Pod) -> bool:
    ports = rule.get("ports")
    if not ports:
        return True
    for p in ports:
        wanted = p.get("port")
        if isinstance(wanted, str):
            wanted = target.named_ports.get(wanted)
        if wanted is None or wanted == port:
            return True
    return False


def allowed(policies: list[Obj], src: Pod, dst: Pod, port: int) -> bool:
    """Whether `src` may open a TCP connection to `dst`:`port` (egress of src, then ingress of dst)."""
    egress = _selecting(policies, src, "Egress")
    if egress and not any(
        _rule_allows(rule, "to", dst, port, dst) for pol in egress for rule in pol["spec"].get("egress", [])
    ):
        return False
    ingress = _selecting(policies, dst, "Ingress")
    return not ingress or any(
        _rule_allows(rule, "from", src, port, dst)
        for pol in ingress
        for rule in pol["spec"].get("ingress", [])
    )


def _rule_allows(rule: Obj, peers_key: str, other: Pod, port: int, target: Pod) -> bool:
    peers = rule.get(peers_key)
    peers_ok = not peers or any(_peer_matches(peer, other) for peer in peers)
    return peers_ok and _port_matches(rule, port, target)
