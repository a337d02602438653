"""A device-resident LRU of hot chunk KV in front of the KV tier (``serve --kv-gpu-bytes``).

A document that comes back finds its chunks here: chunk prefill copies a hit into its bank device to device,
where a host-tier hit costs a copy out of pageable host memory and a transfer over PCIe (about 0.9 GiB for
a 16K-token Dream-7B document). Writes are cloned here on the caller's device and stream (~40 us per chunk
on an H100) and go on, unchanged, to the store below (the background writer, then the host tier and
Redis). A hit below is not copied up: its transfer to the device happens in the bank load anyway.

A hit handed out is marked as used on the reader's current stream (``record_stream``), so evicting it
later never frees memory a queued copy still reads. Values on another device than the cache's are passed
through, not cached.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

from pdllm.shared.kv_tier.base import KVStore
from pdllm.shared.kv_tier.stats import KVStats, StatsRecorder


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class DeviceChunkCache:
    """LRU by bytes on ``device`` in front of ``store``; ``stats()`` counts this tier's own hits."""

    def __init__(self, store: KVStore, capacity_bytes: int, device: torch.device, name: str = "gpu") -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.store, self.capacity_bytes, self.device, self.name = store, capacity_bytes, device, name
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._stats = StatsRecorder()

    @property
    def tiers(self) -> list:
        """This tier, then the store's tiers (and the store itself when it is a writer in front of them)."""
        below = list(getattr(self.store, "tiers", None) or [self.store])
        if self.store not in below:
            below.append(self.store)
        return [self, *below]

    def get_many(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        start = time.perf_counter()
        with self._lock:
            found = [self._entries.get(key) for key in keys]
            for key, value in zip(keys, found):
                if value is not None:
                    self._entries.move_to_end(key)
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            for value in found:
                if value is not None:
                    value.record_stream(stream)
        hits = [v for v in found if v is not None]
        self._stats.add(
            hits=len(hits),
            misses=len(found) - len(hits),
            bytes_read=sum(_bytes(v) for v in hits),
            get_seconds=time.perf_counter() - start,
        )
        wanted = [i for i, v in enumerate(found) if v is None]
        if wanted:
            for i, value in zip(wanted, self.store.get_many([keys[i] for i in wanted])):
                found[i] = value
        return found

    def put_many(self, items: Sequence[tuple[str, torch.Tensor]]) -> int:
        start = time.perf_counter()
        stored = evicted = written = 0
        for key, value in items:
            size = _bytes(value)
            if value.device != self.device or size > self.capacity_bytes:
                continue
            held = value.detach().clone(memory_format=torch.contiguous_format)
            with self._lock:
                old = self._entries.pop(key, None)
                if old is not None:
                    self._bytes -= _bytes(old)
                while self._entries and self._bytes + size > self.capacity_bytes:
                    _, victim = self._entries.popitem(last=False)
                    self._bytes -= _bytes(victim)
                    evicted += 1
                self._entries[key] = held
                self._bytes += size
                self._stats.set(resident_bytes=self._bytes, resident_values=len(self._entries))
            stored += 1
            written += size
        self._stats.add(
            puts=stored, bytes_written=written, evictions=evicted, put_seconds=time.perf_counter() - start
        )
        return self.store.put_many(items)

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            mine = [key in self._entries for key in keys]
        wanted = [i for i, hit in enumerate(mine) if not hit]
        if wanted:
            for i, hit in zip(wanted, self.store.contains_many([keys[i] for i in wanted])):
                mine[i] = hit
        return mine

    def stats(self) -> KVStats:
        return self._stats.snapshot()

    def healthy(self) -> bool:
        return self.store.healthy()

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
            self._stats.set(resident_bytes=0, resident_values=0)
        self.store.close()
