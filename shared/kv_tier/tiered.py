"""Stacked tiers, fastest first (e.g. CPU LRU in front of Redis).

Reads go down the stack only for what the tiers above missed, and a hit in a lower tier is copied into
every tier above it (read-through), so a document's chunks are pulled from Redis once per process. Writes go
to every tier (write-through), so other workers find them in the shared tier.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from pdllm.shared.kv_tier.base import KVStore
from pdllm.shared.kv_tier.stats import KVStats, StatsRecorder


class TieredStore:
    """``stats()`` counts lookups and puts as the caller sees them; each of ``tiers`` keeps its own counters
    (bytes, errors, corruption, evictions)."""

    def __init__(self, tiers: Sequence[KVStore], name: str = "tiered") -> None:
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        names = [tier.name for tier in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be distinct, got {names}")
        self.tiers = list(tiers)
        self.name = name
        self._stats = StatsRecorder()

    def get_many(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        start = time.perf_counter()
        results: list[torch.Tensor | None] = [None] * len(keys)
        wanted = list(range(len(keys)))
        for depth, tier in enumerate(self.tiers):
            if not wanted:
                break
            found = tier.get_many([keys[i] for i in wanted])
            hits = [(i, t) for i, t in zip(wanted, found) if t is not None]
            for i, tensor in hits:
                results[i] = tensor
            if hits and depth:
                for upper in self.tiers[:depth]:
                    upper.put_many([(keys[i], tensor) for i, tensor in hits])
            wanted = [i for i, t in zip(wanted, found) if t is None]
        self._stats.add(
            hits=len(keys) - len(wanted),
            misses=len(wanted),
            bytes_read=sum(t.numel() * t.element_size() for t in results if t is not None),
            get_seconds=time.perf_counter() - start,
        )
        return results

    def put_many(self, items: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Stores in every tier; returns how many values reached the last (most durable) tier."""
        start = time.perf_counter()
        stored = 0
        for tier in self.tiers:
            stored = tier.put_many(items)
        self._stats.add(
            puts=stored,
            put_failures=len(items) - stored,
            put_seconds=time.perf_counter() - start,
        )
        return stored

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        present = [False] * len(keys)
        wanted = list(range(len(keys)))
        for tier in self.tiers:
            if not wanted:
                break
            found = tier.contains_many([keys[i] for i in wanted])
            for i, hit in zip(wanted, found):
                present[i] = hit
            wanted = [i for i, hit in zip(wanted, found) if not hit]
        return present

    def stats(self) -> KVStats:
        return self._stats.snapshot()

    def healthy(self) -> bool:
        return all(tier.healthy() for tier in self.tiers)

    def health(self) -> dict[str, bool]:
        return {tier.name: tier.healthy() for tier in self.tiers}

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
