"""`build_server`: the gRPC server every role runs (router, prefill, decode, all-in-one).

Why a thread-pool (sync) server rather than grpc.aio: every handler ends up in blocking torch / Redis
code, which under asyncio would need an executor hop per call anyway, and the sync API gives each call a
real thread on which `context.is_active()` / `add_callback` report client cancellation and deadlines
promptly. Server streaming is a plain generator. The cost is one thread per running call, so the
admission layer caps running service calls (overload -> RESOURCE_EXHAUSTED, never an invisible queue)
and the pool keeps a few threads beyond that cap for health checks.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from pdllm.shared.rpc.interceptors import AdmissionState, AuthInterceptor, ObservabilityInterceptor
from pdllm.shared.rpc.metrics import MergedRegistries, MetricsEndpoint, RpcMetrics, start_metrics_endpoint

_log = logging.getLogger("pdllm.rpc.server")

EXEMPT_THREADS = 4


@dataclass(frozen=True)
class TlsFiles:
    """PEM server certificate (chain) and private key."""

    cert_path: Path
    key_path: Path


@dataclass(frozen=True)
class ServerConfig:
    role: str = "router"
    host: str = "127.0.0.1"
    port: int = 0  # 0 picks a free port; RpcServer.port tells which
    max_workers: int = 64  # handler threads for service calls (health/reflection get a few extra)
    # Service calls running at once; beyond it calls get RESOURCE_EXHAUSTED at once instead of queueing
    # invisibly for a thread. None = max_workers. Health checks are never refused, so probes keep working.
    max_concurrent_rpcs: int | None = None
    max_receive_message_bytes: int = 64 << 20
    max_send_message_bytes: int = 64 << 20
    auth_token: str | None = None  # when set, every non-health method needs `authorization: Bearer <token>`
    tls: TlsFiles | None = None
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: no /metrics endpoint; 0: a free port
    drain_grace_s: float = 120.0
    reflection: bool = True
    # The plumbing sets pdllm_queue_depth to the number of running calls unless the role owns a real queue.
    track_queue_depth: bool = True


@dataclass(frozen=True)
class ServiceSpec:
    name: str  # fully qualified service name, e.g. "pdllm.v1.Generation"
    register: Callable[[grpc.Server], None]


def service_spec(
    servicer: Any, add_to_server: Callable[[Any, grpc.Server], None], full_name: str
) -> ServiceSpec:
    """Bundle a servicer with its generated `add_XServicer_to_server` function."""
    return ServiceSpec(name=full_name, register=lambda server: add_to_server(servicer, server))


def termination_event(context: grpc.ServicerContext) -> threading.Event:
    """An event set when the call ends for any reason (finished, client cancelled, deadline, server stop).

    Hand it to work running off the handler thread (batched engines): once it is set, nobody will read the
    result, so the work can be dropped. A streaming handler's generator is additionally closed
    (GeneratorExit) when grpc stops pulling from it; `context.is_active()` answers the same question by polling.
    """
    event = threading.Event()
    if not context.add_callback(event.set):
        event.set()  # the call had already terminated
    return event


def _address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def check_port(host: str, port: int) -> None:
    """ValueError naming ``--port`` when ``host:port`` cannot be bound (another server listens there);
    port 0 (any free port) always can. A probe socket, bound and closed at once, with the address reuse
    gRPC's own listener uses."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise ValueError(f"--host {host}: cannot resolve it ({err.strerror})") from None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as err:
                raise ValueError(
                    f"--port {port}: cannot listen on {_address(host, port)} ({err.strerror or err}); "
                    "another server is there: stop it or pick another --port (0: any free port)"
                ) from None


class RpcServer:
    """A built (not yet started) server; `start()`, then `drain()` or `stop()`."""

    def __init__(
        self,
        config: ServerConfig,
        server: grpc.Server,
        port: int,
        health_servicer: health.HealthServicer,
        service_names: tuple[str, ...],
        admission: AdmissionState,
        metrics: RpcMetrics,
        registry: CollectorRegistry,
    ) -> None:
        self.config = config
        self.grpc_server = server
        self.port = port
        self.health = health_servicer
        self.service_names = service_names
        self.admission = admission
        self.metrics = metrics
        self.registry = registry
        self.metrics_endpoint: MetricsEndpoint | None = None
        self._stopped = threading.Event()

    @property
    def address(self) -> str:
        return _address(self.config.host, self.port)

    @property
    def metrics_port(self) -> int | None:
        return self.metrics_endpoint.port if self.metrics_endpoint else None

    def start(self, also_export: Iterable[CollectorRegistry] = ()) -> RpcServer:
        """``also_export``: registries whose metrics this server's endpoint serves beside its own (the
        all-in-one deployment's workers, which have no endpoint of their own)."""
        if self.config.metrics_port is not None:
            registry = self.registry
            others = list(also_export)
            if others:
                registry = CollectorRegistry()
                registry.register(MergedRegistries([self.registry, *others]))
            self.metrics_endpoint = start_metrics_endpoint(
                registry, self.config.metrics_host, self.config.metrics_port
            )
        self.grpc_server.start()
        for name in ("", *self.service_names):
            self.set_serving(name, True)
        _log.info(
            "serving",
            extra={"role": self.config.role, "address": self.address, "metrics_port": self.metrics_port},
        )
        return self

    def set_serving(self, service: str, serving: bool) -> None:
        """Report `service` ("" = the whole server) as SERVING or NOT_SERVING (ignored once draining)."""
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self.health.set(service, status)

    def drain(self, grace_s: float | None = None) -> bool:
        """Stop taking calls, let running ones finish within the grace period, then stop.

        Health flips to NOT_SERVING first (load balancers stop routing here), new calls get UNAVAILABLE, and
        calls still running when the grace period ends are cancelled. Returns True if all finished in time.
        """
        grace = self.config.drain_grace_s if grace_s is None else grace_s
        self.admission.start_drain()
        self.health.enter_graceful_shutdown()
        self.metrics.draining.labels(self.config.role).set(1)
        _log.info("draining", extra={"in_flight": self.admission.in_flight, "grace_s": grace})
        finished = self.admission.wait_idle(grace)
        # A short grace lets the last responses' statuses reach their clients before the transport closes.
        self.stop(grace_s=1.0 if finished else 0.0)
        _log.info("drained", extra={"all_finished": finished})
        return finished

    def stop(self, grace_s: float = 0.0) -> None:
        self.grpc_server.stop(grace_s).wait()
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.close()
            self.metrics_endpoint = None
        self._stopped.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._stopped.wait(timeout_s)

    def serve_until_signal(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT)) -> bool:
        """Block (main thread only) until one of `signals` arrives, then drain. Returns drain()'s result."""
        received = threading.Event()
        previous = {sig: signal.signal(sig, lambda *_: received.set()) for sig in signals}
        try:
            # Short waits keep the main thread returning to the interpreter, where signal handlers run.
            while not received.wait(0.25):
                if self._stopped.is_set():
                    return True
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self.drain()

    def __enter__(self) -> RpcServer:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._stopped.is_set():
            self.stop()


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def _reflection_v1_handler(service_names: tuple[str, ...]) -> grpc.GenericRpcHandler:
    """Server reflection under its v1 name (current grpcurl and other clients try v1 first). grpcio-reflection
    ships only v1alpha; the two protocols are the same messages in another package, identical on the wire,
    so the v1alpha servicer answers both."""
    from grpc_reflection.v1alpha import reflection_pb2

    servicer = reflection.ReflectionServicer(service_names)
    method = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": method})


def build_server(
    config: ServerConfig, services: list[ServiceSpec], registry: CollectorRegistry | None = None
) -> RpcServer:
    """Create a server with health, reflection, auth, limits, metrics and drain wired in (call start())."""
    credentials = None
    if config.tls is not None:  # read first: a bad path must fail before any thread is started
        try:
            key, cert = Path(config.tls.key_path).read_bytes(), Path(config.tls.cert_path).read_bytes()
        except OSError as err:
            raise ValueError(f"cannot read TLS key/certificate {err.filename}: {err.strerror}") from None
        credentials = grpc.ssl_server_credentials([(key, cert)])
    registry = registry if registry is not None else CollectorRegistry()
    admission = AdmissionState(limit=config.max_concurrent_rpcs or config.max_workers)
    metrics = RpcMetrics(registry, config.role)
    interceptors: list[grpc.ServerInterceptor] = [
        ObservabilityInterceptor(admission, metrics, track_queue_depth=config.track_queue_depth)
    ]
    if config.auth_token:
        interceptors.append(AuthInterceptor(config.auth_token))
    # Spare threads beyond the admission limit keep health checks answered when every slot is busy.
    threads = max(config.max_workers, admission.limit) + EXEMPT_THREADS
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"grpc-{config.role}"),
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", config.max_receive_message_bytes),
            ("grpc.max_send_message_length", config.max_send_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    for spec in services:
        spec.register(server)
    # Health Watch streams block a thread each; give them their own small pool for status fan-out.
    health_servicer = health.HealthServicer(
        experimental_non_blocking=True,
        experimental_thread_pool=futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grpc-health"),
    )
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = tuple(spec.name for spec in services)
    if config.reflection:
        listed = (*names, health.SERVICE_NAME, reflection.SERVICE_NAME, REFLECTION_V1)
        reflection.enable_server_reflection(listed, server)
        server.add_generic_rpc_handlers((_reflection_v1_handler(listed),))
    check_port(config.host, config.port)  # before gRPC's own bind, which logs a C-core error first
    address = _address(config.host, config.port)
    try:
        if credentials is not None:
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # grpcio >= 1.68 raises where it returned 0
        port = 0
    if port == 0:  # ValueError: `serve` reports it as one line naming the flag
        raise ValueError(f"--port {config.port}: could not bind the gRPC server to {address} (in use?)")
    return RpcServer(config, server, port, health_servicer, names, admission, metrics, registry)
