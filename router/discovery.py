"""Worker discovery for the router: which prefill/decode workers exist, and which of them are healthy.

A discovery source gives the candidates per role: `StaticDiscovery` (--prefill-workers/--decode-workers) or
`KubernetesDiscovery` (list+watch of the worker Services' EndpointSlices, ready endpoints only). A `WorkerPool`
per role (``worker_pool.py``) routes only to candidates passing gRPC health checks (and not failing the
router's RPCs), so a worker that stops serving leaves before Kubernetes notices and comes back when it answers
SERVING again. Wiring:
``source.subscribe(lambda role, addrs: pools[role].set_members(addrs)); source.start(); pool.start()``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)
SERVICE_NAME_LABEL = "kubernetes.io/service-name"  # links an EndpointSlice to its Service
MembershipCallback = Callable[[str, frozenset[str]], None]


class DiscoveryError(ValueError):
    """Bad discovery configuration (reported to the operator, never a stack trace)."""


def parse_address(text: str) -> str:
    """Validate one ``host:port`` (IPv6 as ``[addr]:port``) and return it normalised."""
    text = text.strip()
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DiscoveryError(f"worker address {text!r} is not host:port with a port in 1..65535")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise DiscoveryError(f"worker address {text!r}: write IPv6 hosts in brackets, e.g. [::1]:50051")
    return f"{host}:{int(port)}"


def parse_worker_list(text: str | None) -> frozenset[str]:
    """Parse the comma-separated ``--prefill-workers`` / ``--decode-workers`` flag value."""
    if not text:
        return frozenset()
    return frozenset(parse_address(part) for part in text.split(",") if part.strip())


def _fire(callbacks: Iterable[Callable[..., None]], role: str, members: Any) -> None:
    for callback in callbacks:
        try:
            callback(role, members)
        except Exception:  # a faulty subscriber must not kill the watch or health thread
            log.exception("membership callback failed for role %s", role)


class DiscoverySource:
    """Current worker set per role plus change callbacks (run outside the lock, only on real changes)."""

    def __init__(self, roles: Iterable[str]) -> None:
        self._lock = threading.Lock()
        self._sets: dict[str, frozenset[str]] = {role: frozenset() for role in roles}
        self._callbacks: list[MembershipCallback] = []

    def subscribe(self, callback: MembershipCallback) -> None:
        with self._lock:
            self._callbacks.append(callback)
            current = dict(self._sets)
        for role, addresses in current.items():
            callback(role, addresses)

    def workers(self, role: str) -> frozenset[str]:
        with self._lock:
            if role not in self._sets:
                raise DiscoveryError(f"unknown role {role!r}; expected one of {sorted(self._sets)}")
            return self._sets[role]

    def publish(self, role: str, addresses: frozenset[str]) -> None:
        with self._lock:
            if self._sets.get(role) == addresses:
                return
            self._sets[role] = addresses
            callbacks = list(self._callbacks)
        log.info("discovery: %s workers now %s", role, sorted(addresses))
        _fire(callbacks, role, addresses)

    def start(self) -> None:  # sources that watch something start threads here
        pass

    def stop(self) -> None:
        pass


@dataclass(frozen=True)
class StaticDiscoveryConfig:
    workers: Mapping[str, frozenset[str]]


class StaticDiscovery(DiscoverySource):
    """Fixed worker lists from flags; health checking in `WorkerPool` still applies."""

    def __init__(self, config: StaticDiscoveryConfig) -> None:
        super().__init__(config.workers.keys())
        for role, addresses in config.workers.items():
            self.publish(role, frozenset(parse_address(a) for a in addresses))


@dataclass(frozen=True)
class KubernetesDiscoveryConfig:
    namespace: str
    services: Mapping[str, str]  # role -> Service name whose EndpointSlices list the workers
    port_name: str = "grpc"
    watch_timeout_s: int = 300  # server-side watch expiry; we re-watch from the last resourceVersion
    retry_backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.namespace:
            raise DiscoveryError("kubernetes discovery needs --k8s-namespace")
        for role, service in self.services.items():
            if not service:
                raise DiscoveryError(f"kubernetes discovery needs --k8s-{role}-service")


def ready_addresses(slices: Iterable[Any], port_name: str) -> frozenset[str]:
    """host:port of every ready endpoint in V1EndpointSlice objects (nil `ready` counts as ready, per the API)."""
    out: set[str] = set()
    for eps in slices:
        ports = [p.port for p in eps.ports or [] if p.name == port_name and p.port]
        if eps.address_type not in ("IPv4", "IPv6") or not ports:  # FQDN slices are not pod endpoints
            continue
        for endpoint in eps.endpoints or []:
            conditions = endpoint.conditions
            if conditions is not None and conditions.ready is False:
                continue
            if endpoint.addresses:  # all addresses of one endpoint are fungible; IPv6 needs brackets
                host = endpoint.addresses[0]
                out.add(f"[{host}]:{ports[0]}" if ":" in host else f"{host}:{ports[0]}")
    return frozenset(out)


class KubernetesDiscovery(DiscoverySource):
    """List + watch EndpointSlices per role (one thread each), resyncing on 410 Gone and on errors."""

    def __init__(self, config: KubernetesDiscoveryConfig, api_client: Any) -> None:
        super().__init__(config.services.keys())
        # Imported here: only this source needs the client, so static routing runs without it installed.
        from kubernetes import client, watch

        self._config = config
        self._api = client.DiscoveryV1Api(api_client)
        self._new_watch = watch.Watch
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watches: list[Any] = []
        self._watch_lock = threading.Lock()
        self.relists: dict[str, int] = {role: 0 for role in config.services}  # observability and tests

    def start(self) -> None:
        for role, service in self._config.services.items():
            self._threads.append(threading.Thread(target=self._run, args=(role, service), daemon=True))
            self._threads[-1].start()

    def stop(self) -> None:
        self._stop.set()
        deadline = time.monotonic() + 5
        for thread in self._threads:
            # Repeated: a watch whose request was not sent yet ignores a stop() (its stream() resets the flag).
            while thread.is_alive() and time.monotonic() < deadline:
                with self._watch_lock:
                    for w in self._watches:
                        w.stop()
                thread.join(0.05)

    def _run(self, role: str, service: str) -> None:
        backoff = self._config.retry_backoff_s
        while not self._stop.is_set():
            try:
                self._list_and_watch(role, service)
                backoff = self._config.retry_backoff_s
            except Exception as exc:
                if getattr(exc, "status", None) == 410:
                    log.info("discovery: watch for %s expired (410 Gone); relisting", service)
                    continue
                # Keep the last known set: a flaky API server must not empty the pool.
                log.warning("discovery: %s list/watch failed (%s); retrying in %.1fs", service, exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self._config.max_backoff_s)

    def _list_and_watch(self, role: str, service: str) -> None:
        selector = f"{SERVICE_NAME_LABEL}={service}"
        listed = self._api.list_namespaced_endpoint_slice(self._config.namespace, label_selector=selector)
        self.relists[role] += 1
        slices = {s.metadata.name: s for s in listed.items}
        resource_version = listed.metadata.resource_version
        self.publish(role, ready_addresses(slices.values(), self._config.port_name))
        while not self._stop.is_set():
            w = self._new_watch()
            with self._watch_lock:
                self._watches.append(w)
            try:
                for event in w.stream(
                    self._api.list_namespaced_endpoint_slice,
                    self._config.namespace,
                    label_selector=selector,
                    resource_version=resource_version,
                    allow_watch_bookmarks=True,
                    timeout_seconds=self._config.watch_timeout_s,
                    # A read timeout past the server's expiry catches silently dropped connections.
                    _request_timeout=(10, self._config.watch_timeout_s + 30),
                ):
                    kind = event["type"]
                    if kind in ("ADDED", "MODIFIED"):
                        slices[event["object"].metadata.name] = event["object"]
                    elif kind == "DELETED":
                        slices.pop(event["object"].metadata.name, None)
                    else:
                        continue  # BOOKMARK: only advances the resourceVersion
                    self.publish(role, ready_addresses(slices.values(), self._config.port_name))
            finally:
                with self._watch_lock:
                    self._watches.remove(w)
            # Normal end of a watch (server-side timeout): resume from the newest version seen.
            resource_version = w.resource_version or resource_version


def kubernetes_api_client() -> Any:
    """ApiClient from the pod's service account, else from ~/.kube/config (running the router off-cluster)."""
    try:
        from kubernetes import client
        from kubernetes import config as kube_config
    except ImportError as exc:
        raise DiscoveryError(f"kubernetes discovery needs the kubernetes client package ({exc})") from exc
    try:
        kube_config.load_incluster_config()
    except kube_config.ConfigException:
        try:
            kube_config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))  # read now, not at import
        except (kube_config.ConfigException, OSError) as exc:
            msg = f"kubernetes discovery: no service account token and no usable kubeconfig ({exc})"
            raise DiscoveryError(msg) from exc
    return client.ApiClient()


def discovery_from_flags(kind: str, flags: Mapping[str, Any]) -> DiscoverySource:
    """The source named by the router's `--discovery`; `flags` is e.g. ``vars(args)`` (missing keys = unset)."""
    if kind == "static":
        workers = {role: parse_worker_list(flags.get(f"{role}_workers")) for role in ("prefill", "decode")}
        for role, addresses in workers.items():
            if not addresses:
                raise DiscoveryError(f"--discovery static needs --{role}-workers host:port[,host:port...]")
        return StaticDiscovery(StaticDiscoveryConfig(workers=workers))
    if kind == "kubernetes":
        services = {role: flags.get(f"k8s_{role}_service") or "" for role in ("prefill", "decode")}
        config = KubernetesDiscoveryConfig(namespace=flags.get("k8s_namespace") or "", services=services)
        return KubernetesDiscovery(config, kubernetes_api_client())
    raise DiscoveryError(f"--discovery must be 'static' or 'kubernetes', not {kind!r}")
