"""The router's view of one role's workers: which discovered members pass health checks right now.

A :class:`WorkerPool` follows discovery (``set_members``) and keeps a gRPC channel per member, which the
router reuses for its RPCs. A background loop probes every member with ``grpc.health.v1`` each interval, all
probes in flight at once; a member joins once it passes ``healthy_threshold`` probes in a row and leaves after
``unhealthy_threshold`` failures in a row, where an RPC the router reports failing with UNAVAILABLE counts as
a failed probe. A member discovery removes keeps its channel open a while, so that RPCs already on it can
finish. Subscribers hear the sorted healthy set whenever it changes (once per sweep, not per probe).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# The discovery module's logger and callback runner: membership and health lines read as one stream.
from .discovery import DiscoveryError, _fire, log


@dataclass(frozen=True)
class HealthCheckConfig:
    interval_s: float = 5.0
    timeout_s: float = 2.0
    unhealthy_threshold: int = 2  # consecutive failures before a healthy member leaves the pool
    healthy_threshold: int = 1  # consecutive passes before a new or failed member (re)joins
    service: str = ""  # grpc.health.v1 service name to check; "" = the whole server
    retire_after_s: float = 180.0  # a removed member's channel stays open this long: draining RPCs finish


@dataclass
class _MemberState:
    channel: grpc.Channel
    healthy: bool = False
    passes: int = 0
    failures: int = 0


@dataclass
class WorkerPool:
    """Healthy members of one role. `set_members` follows discovery; checks decide who is routable."""

    role: str
    config: HealthCheckConfig = field(default_factory=HealthCheckConfig)
    # Builds the channel for one address (TLS credentials, interceptors for the auth token, ...).
    channel_factory: Callable[[str], grpc.Channel] = grpc.insecure_channel

    def __post_init__(self) -> None:
        if self.config.unhealthy_threshold < 1 or self.config.healthy_threshold < 1:
            raise DiscoveryError("health check thresholds must be >= 1")
        self._lock = threading.Lock()
        self._members: dict[str, _MemberState] = {}
        self._retired: list[tuple[float, grpc.Channel]] = []  # (close at, channel)
        self._callbacks: list[Callable[[str, tuple[str, ...]], None]] = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def subscribe(self, callback: Callable[[str, tuple[str, ...]], None]) -> None:
        """Called with (role, sorted healthy addresses) whenever the healthy set changes."""
        with self._lock:
            self._callbacks.append(callback)

    def set_members(self, addresses: frozenset[str]) -> None:
        with self._lock:
            before = self._healthy_locked()
            close_at = time.monotonic() + self.config.retire_after_s
            for gone in set(self._members) - addresses:
                self._retired.append((close_at, self._members.pop(gone).channel))
            for new in addresses - set(self._members):
                self._members[new] = _MemberState(channel=self.channel_factory(new))
            after = self._healthy_locked()
        self._wake.set()  # check new members now rather than after a full interval
        self._notify(before, after)

    def healthy(self) -> tuple[str, ...]:
        with self._lock:
            return self._healthy_locked()

    def channel(self, address: str) -> grpc.Channel:  # the router reuses it for its RPCs
        with self._lock:
            if address not in self._members:
                raise KeyError(f"{address} is not a {self.role} pool member")
            return self._members[address].channel

    def report_failure(self, address: str) -> None:
        """Passive check: the router saw an RPC to `address` fail with UNAVAILABLE."""
        with self._lock:
            before = self._healthy_locked()
            self._record_locked(address, ok=False)
            after = self._healthy_locked()
        self._notify(before, after)

    def check_once(self) -> None:  # one synchronous sweep; the background loop calls it every interval
        with self._lock:
            targets = [(a, s.channel) for a, s in self._members.items()]
            before = self._healthy_locked()
            now = time.monotonic()
            expired = [c for t, c in self._retired if t <= now]
            self._retired = [(t, c) for t, c in self._retired if t > now]
        for channel in expired:
            channel.close()
        request = health_pb2.HealthCheckRequest(service=self.config.service)
        # All probes in flight at once: a sweep costs one timeout however many members are down.
        calls = [
            (a, health_pb2_grpc.HealthStub(c).Check.future(request, timeout=self.config.timeout_s))
            for a, c in targets
        ]
        results = [(address, self._passed(call)) for address, call in calls]
        with self._lock:
            for address, ok in results:
                self._record_locked(address, ok)
            after = self._healthy_locked()
        self._notify(before, after)  # once per sweep, so subscribers see no intermediate sets

    @staticmethod
    def _passed(call: grpc.Future) -> bool:
        try:
            return call.result().status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def _record_locked(self, address: str, ok: bool) -> None:
        state = self._members.get(address)
        if state is None:  # removed by discovery while the probe was in flight
            return
        if ok:
            state.passes, state.failures = state.passes + 1, 0
            state.healthy = state.healthy or state.passes >= self.config.healthy_threshold
        else:
            state.failures, state.passes = state.failures + 1, 0
            threshold = self.config.unhealthy_threshold if state.healthy else 1
            state.healthy = state.healthy and state.failures < threshold

    def _healthy_locked(self) -> tuple[str, ...]:
        return tuple(sorted(a for a, s in self._members.items() if s.healthy))

    def _notify(self, before: tuple[str, ...], after: tuple[str, ...]) -> None:
        if before == after:
            return
        log.info("pool %s: healthy workers now %s", self.role, list(after))
        with self._lock:
            callbacks = list(self._callbacks)
        _fire(callbacks, self.role, after)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"health-{self.role}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.config.timeout_s + 5)
        with self._lock:
            for channel in [s.channel for s in self._members.values()] + [c for _, c in self._retired]:
                channel.close()
            self._members.clear()
            self._retired.clear()

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.check_once()
            self._wake.wait(max(0.0, self.config.interval_s - (time.monotonic() - started)))
            self._wake.clear()
