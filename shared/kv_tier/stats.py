"""KV-tier counters and their optional Prometheus export.

Every store keeps a :class:`StatsRecorder`; ``stats()`` hands out a consistent snapshot. The Prometheus
collector reads those snapshots at scrape time, so stores never touch a global registry and a test can
register several stores on its own ``CollectorRegistry``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass
class KVStats:
    hits: int = 0
    misses: int = 0
    puts: int = 0  # values stored
    put_failures: int = 0  # values the backend failed to store (unreachable, too large, ...)
    bytes_read: int = 0
    bytes_written: int = 0
    get_seconds: float = 0.0
    put_seconds: float = 0.0
    errors: int = 0  # backend operations that failed (connection refused, timeout, ...)
    corrupt: int = 0  # bad checksum, truncated, missing parts: dropped and counted as misses
    mismatched: int = 0  # well-formed, but other format version / model / layout: counted as misses
    evictions: int = 0
    resident_bytes: int = 0  # gauge: bytes held (CPU tier only)
    resident_values: int = 0  # gauge: values held (CPU tier only)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_GAUGES = ("resident_bytes", "resident_values")


class StatsRecorder:
    """Thread-safe accumulation into a :class:`KVStats`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = KVStats()

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def set(self, **values: float) -> None:
        with self._lock:
            for name, value in values.items():
                setattr(self._stats, name, value)

    def snapshot(self) -> KVStats:
        with self._lock:
            return dataclasses.replace(self._stats)


_HELP = {
    "hits": "chunk-KV lookups answered",
    "misses": "chunk-KV lookups not answered (absent, corrupt, mismatched or backend down)",
    "puts": "chunk-KV values stored",
    "put_failures": "chunk-KV values that could not be stored",
    "bytes_read": "bytes of chunk KV read",
    "bytes_written": "bytes of chunk KV written",
    "get_seconds": "seconds spent in get_many",
    "put_seconds": "seconds spent in put_many",
    "errors": "backend operations that failed",
    "corrupt": "corrupt or incomplete values detected",
    "mismatched": "values of another format version, model or layout",
    "evictions": "values evicted to stay within capacity",
    "resident_bytes": "bytes of chunk KV held",
    "resident_values": "chunk-KV values held",
}


class KVTierCollector:
    """Exports ``pdllm_kv_<counter>_total{tier=...}`` and gauges plus ``pdllm_kv_healthy{tier=...}``."""

    def __init__(
        self,
        sources: Mapping[str, Callable[[], KVStats]],
        health: Mapping[str, Callable[[], bool]] | None = None,
        namespace: str = "pdllm_kv",
    ) -> None:
        self._sources = dict(sources)
        self._health = dict(health or {})
        self._namespace = namespace

    def describe(self) -> list[Any]:
        # Lets the registry reject a second collector exporting the same names, without probing stores.
        return list(self._families({tier: KVStats() for tier in self._sources}, {}))

    def collect(self) -> Iterator[Any]:
        snapshots = {tier: source() for tier, source in self._sources.items()}
        health = {tier: probe() for tier, probe in self._health.items()}
        yield from self._families(snapshots, health)

    def _families(self, snapshots: Mapping[str, KVStats], health: Mapping[str, bool]) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for field in dataclasses.fields(KVStats):
            name = f"{self._namespace}_{field.name}"
            family_type = GaugeMetricFamily if field.name in _GAUGES else CounterMetricFamily
            family = family_type(name, _HELP[field.name], labels=["tier"])
            for tier, stats in snapshots.items():
                family.add_metric([tier], getattr(stats, field.name))
            yield family
        if self._health:
            healthy = GaugeMetricFamily(
                f"{self._namespace}_healthy", "1 when the tier's backend answers", labels=["tier"]
            )
            for tier, ok in health.items():
                healthy.add_metric([tier], 1.0 if ok else 0.0)
            yield healthy


def register_kv_metrics(
    stores: Mapping[str, Any], registry: Any, namespace: str = "pdllm_kv"
) -> KVTierCollector:
    """Register stores (anything with ``stats()`` and ``healthy()``) on a ``prometheus_client`` registry."""
    collector = KVTierCollector(
        {tier: store.stats for tier, store in stores.items()},
        {tier: store.healthy for tier, store in stores.items()},
        namespace,
    )
    registry.register(collector)
    return collector
