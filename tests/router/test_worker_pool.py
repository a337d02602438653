"""WorkerPool health membership against real in-process gRPC servers running grpc.health.v1."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from k8s_fake import wait_until

from pdllm.router.discovery import (
    DiscoveryError,
    StaticDiscovery,
    StaticDiscoveryConfig,
    discovery_from_flags,
    parse_worker_list,
)
from pdllm.router.worker_pool import HealthCheckConfig, WorkerPool

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Worker:
    server: grpc.Server
    health: health.HealthServicer
    address: str

    def set(self, status: int, service: str = "") -> None:
        self.health.set(service, status)


def start_worker(port: int = 0) -> Worker:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    servicer.set("", SERVING)
    return Worker(server, servicer, f"127.0.0.1:{bound}")


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started = [start_worker(), start_worker()]
    yield started
    for w in started:
        w.server.stop(None)


def make_pool(**overrides: float | int | str) -> WorkerPool:
    config = HealthCheckConfig(
        **{"interval_s": 0.05, "timeout_s": 0.5, "unhealthy_threshold": 2, **overrides}
    )
    return WorkerPool(role="prefill", config=config)


def test_members_join_after_passing_and_leave_after_threshold_failures(workers: list[Worker]) -> None:
    a, b = workers
    pool = make_pool()
    changes: list[tuple[str, tuple[str, ...]]] = []
    pool.subscribe(lambda role, healthy: changes.append((role, healthy)))
    pool.set_members(frozenset({a.address, b.address}))
    assert pool.healthy() == ()  # unknown until checked, even if discovery says they exist
    pool.check_once()
    assert pool.healthy() == tuple(sorted([a.address, b.address]))

    b.set(NOT_SERVING)
    pool.check_once()
    assert b.address in pool.healthy()  # one failed check is tolerated (unhealthy_threshold=2)
    pool.check_once()
    assert pool.healthy() == (a.address,)
    assert pool.channel(b.address) is not None  # still a member, still probed

    b.set(SERVING)
    pool.check_once()
    assert pool.healthy() == tuple(sorted([a.address, b.address]))
    assert [healthy for _, healthy in changes] == [
        tuple(sorted([a.address, b.address])),
        (a.address,),
        tuple(sorted([a.address, b.address])),
    ]
    assert {role for role, _ in changes} == {"prefill"}
    pool.stop()


def test_dead_server_and_unknown_service_fail_checks(workers: list[Worker]) -> None:
    a, b = workers
    pool = make_pool(unhealthy_threshold=1, service="pdllm.v1.Prefill")
    pool.set_members(frozenset({a.address, b.address}))
    a.set(SERVING, service="pdllm.v1.Prefill")
    pool.check_once()
    assert pool.healthy() == (a.address,)  # b never registered the service name: NOT_FOUND

    port = int(a.address.rsplit(":", 1)[1])
    a.server.stop(None).wait()
    pool.check_once()
    assert pool.healthy() == ()

    revived = start_worker(port)  # a restarted pod answering on the same address rejoins
    try:
        revived.set(SERVING, service="pdllm.v1.Prefill")
        assert wait_until(lambda: (pool.check_once(), pool.healthy())[1] == (a.address,), timeout_s=10)
    finally:
        revived.server.stop(None)
        pool.stop()


def test_discovery_changes_and_passive_failures(workers: list[Worker]) -> None:
    a, b = workers
    pool = make_pool(retire_after_s=0.3)
    pool.set_members(frozenset({a.address, b.address}))
    pool.check_once()
    channel_b = pool.channel(b.address)
    pool.set_members(frozenset({a.address}))
    assert pool.healthy() == (a.address,)
    with pytest.raises(KeyError):
        pool.channel(b.address)
    # A removed worker (e.g. draining after SIGTERM) keeps its channel a while: RPCs on it still complete.
    check = lambda: health_pb2_grpc.HealthStub(channel_b).Check(health_pb2.HealthCheckRequest(), timeout=0.5)
    pool.check_once()
    assert check().status == SERVING
    time.sleep(0.35)
    pool.check_once()
    with pytest.raises(ValueError):  # retired and closed now
        check()

    pool.report_failure(a.address)
    assert pool.healthy() == (a.address,)
    pool.report_failure(a.address)
    assert pool.healthy() == ()
    pool.report_failure("10.1.2.3:1")  # not a member: ignored
    pool.stop()


def test_background_loop_follows_status_flips(workers: list[Worker]) -> None:
    a, _ = workers
    pool = make_pool()
    pool.start()
    try:
        pool.set_members(frozenset({a.address}))
        assert wait_until(lambda: pool.healthy() == (a.address,))
        a.set(NOT_SERVING)
        assert wait_until(lambda: pool.healthy() == ())
        a.set(SERVING)
        assert wait_until(lambda: pool.healthy() == (a.address,))
    finally:
        pool.stop()


def test_static_discovery_and_flag_parsing() -> None:
    assert parse_worker_list("10.0.0.1:50051, worker-b:7, [::1]:9") == {
        "10.0.0.1:50051",
        "worker-b:7",
        "[::1]:9",
    }
    assert parse_worker_list("") == frozenset()
    for bad in ["host", "host:", "host:0", "host:99999", "::1:50051", ":80", "host:http"]:
        with pytest.raises(DiscoveryError):
            parse_worker_list(bad)
    source = StaticDiscovery(
        StaticDiscoveryConfig(workers={"prefill": frozenset({"a:1"}), "decode": frozenset()})
    )
    seen: dict[str, frozenset[str]] = {}
    source.subscribe(lambda role, addrs: seen.__setitem__(role, addrs))
    assert seen == {"prefill": {"a:1"}, "decode": frozenset()}
    built = discovery_from_flags("static", {"prefill_workers": "p:1,p:2", "decode_workers": "d:1"})
    assert built.workers("prefill") == {"p:1", "p:2"} and built.workers("decode") == {"d:1"}
    with pytest.raises(DiscoveryError, match="--decode-workers"):
        discovery_from_flags("static", {"prefill_workers": "p:1", "decode_workers": None})
    with pytest.raises(DiscoveryError, match="thresholds"):
        WorkerPool(role="decode", config=HealthCheckConfig(unhealthy_threshold=0))


def test_a_worker_back_after_a_long_outage_rejoins_within_seconds() -> None:
    """The router's channels cap gRPC's reconnect backoff (default: growing to 120 s), so after a 30 s
    outage the worker is routable again within 5 s of serving, not after the channel's next retry."""
    from pdllm.shared.rpc.channels import worker_channel_factory
    from pdllm.shared.rpc.server import ServerConfig

    worker = start_worker()
    port = int(worker.address.rsplit(":", 1)[1])
    pool = WorkerPool(
        "prefill", HealthCheckConfig(interval_s=0.25, timeout_s=0.5), worker_channel_factory(ServerConfig())
    )
    pool.set_members(frozenset({worker.address}))
    pool.start()
    try:
        assert wait_until(lambda: pool.healthy() == (worker.address,), 5)
        worker.server.stop(None)
        assert wait_until(lambda: pool.healthy() == (), 5)
        time.sleep(30)  # long enough for the default backoff to reach ~15-25 s between attempts
        back = start_worker(port)
        started = time.monotonic()
        assert wait_until(lambda: pool.healthy() == (worker.address,), 15)
        assert time.monotonic() - started <= 5.0
        back.server.stop(None)
    finally:
        pool.stop()
