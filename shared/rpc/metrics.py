"""Standard RPC metrics on a caller-owned Prometheus registry, and the /metrics HTTP endpoint.

No global registry: several roles run in one process in all-in-one mode and tests start many servers,
so each server registers its collectors on the registry it is given.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import Metric

# Generation requests run from milliseconds (cache hits, errors) to minutes (long contexts on CPU).
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)


class RpcMetrics:
    """Counters and histograms the server interceptor maintains, labelled by role (router/prefill/...)."""

    def __init__(self, registry: CollectorRegistry, role: str) -> None:
        self.role = role
        self.requests = Counter(
            "pdllm_rpc_requests",
            "Finished RPCs by method and status code.",
            ["role", "method", "code"],
            registry=registry,
        )
        self.errors = Counter(
            "pdllm_rpc_errors",
            "RPCs that finished with a status other than OK, by method and code.",
            ["role", "method", "code"],
            registry=registry,
        )
        self.latency = Histogram(
            "pdllm_rpc_latency_seconds",
            "Wall time from the start of an RPC handler to its last response.",
            ["role", "method"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.first_message = Histogram(
            "pdllm_rpc_first_message_seconds",
            "Time to the first message of a server-streaming RPC (TTFT at the router).",
            ["role", "method"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.in_flight = Gauge("pdllm_rpc_in_flight", "RPCs being handled.", ["role"], registry=registry)
        self.queue_depth = Gauge(
            "pdllm_queue_depth",
            "Requests admitted but not finished (set by the role when it has its own queue).",
            ["role"],
            registry=registry,
        )
        self.draining = Gauge(
            "pdllm_draining", "1 while the server drains before exit.", ["role"], registry=registry
        )
        self._lock = threading.Lock()
        self._active = 0

    def started(self, track_queue_depth: bool) -> None:
        with self._lock:
            self._active += 1
            active = self._active
        self.in_flight.labels(self.role).set(active)
        if track_queue_depth:
            self.queue_depth.labels(self.role).set(active)

    def rejected(self, method: str, code: str) -> None:
        """A call refused before its handler ran (draining, malformed request)."""
        self.requests.labels(self.role, method, code).inc()
        self.errors.labels(self.role, method, code).inc()

    def finished(self, method: str, code: str, seconds: float, track_queue_depth: bool) -> None:
        with self._lock:
            self._active -= 1
            active = self._active
        self.in_flight.labels(self.role).set(active)
        if track_queue_depth:
            self.queue_depth.labels(self.role).set(active)
        self.requests.labels(self.role, method, code).inc()
        if code != "OK":
            self.errors.labels(self.role, method, code).inc()
        self.latency.labels(self.role, method).observe(seconds)


class MergedRegistries:
    """A collector over several registries whose metrics share names (each server's ``pdllm_rpc_*``, told
    apart by their ``role`` label): same-named families are merged into one, so a single endpoint can
    serve all of them (``serve --role all``: router, prefill and decode in one process)."""

    def __init__(self, registries: list[CollectorRegistry]) -> None:
        self._registries = list(registries)

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for registry in self._registries:
            for family in registry.collect():
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type)
                into.samples.extend(family.samples)
        yield from merged.values()


@dataclass
class MetricsEndpoint:
    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_metrics_endpoint(registry: CollectorRegistry, host: str, port: int) -> MetricsEndpoint:
    """Serve `registry` at http://host:port/metrics (port 0 picks a free port); a port that cannot be bound
    raises ValueError naming the flag (two roles on one machine both default to 9400)."""
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ValueError(
            f"--metrics-port {port}: cannot listen on {host}:{port} ({exc.strerror or exc}); "
            "give each process its own port, or -1 for no metrics endpoint"
        ) from exc
    return MetricsEndpoint(server=server, thread=thread)
