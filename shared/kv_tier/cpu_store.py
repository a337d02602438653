"""In-process LRU of chunk-KV tensors, bounded by bytes.

Tensors are held as contiguous CPU copies in ordinary pageable memory, whatever the capacity: chunk
prefill loads a hit to the device through a small fixed ring of pinned buffers
(:func:`~pdllm.shared.kv_tier.staging.load_into`), asynchronously and without a device sync, and the
background writer stages its device-to-host copies the same way. Pinning every stored value instead calls
``cudaHostAlloc`` for each value while the tier fills (always, with a tier of tens of GB), which is slow and
can stall the device: on an H100 a 50 GB pinned tier served 1.09 and 0.99 req/s where a 2 GiB one served
1.40 (``staging.py``). ``pin_memory=True`` still pins, for small stores.

Thread-safe: one lock guards the LRU bookkeeping, while the copies happen outside it so concurrent
requests do not serialize on memcpy.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdllm.shared.kv_tier.stats import KVStats, StatsRecorder


@dataclass(frozen=True)
class CPUStoreConfig:
    capacity_bytes: int
    pin_memory: bool | None = None  # True: hold values in pinned memory (needs CUDA); None or False: pageable
    # False lets a caller hand over tensors it will never touch again (e.g. freshly decoded from Redis).
    copy_on_put: bool = True

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {self.capacity_bytes}")


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class CPUStore:
    """LRU by bytes: a put that overflows evicts the least recently read or written values."""

    def __init__(self, config: CPUStoreConfig, name: str = "cpu") -> None:
        self.config = config
        self.name = name
        self._pin = bool(config.pin_memory)
        if self._pin and not torch.cuda.is_available():
            raise ValueError("CPUStoreConfig.pin_memory=True needs CUDA; leave it None for pageable memory")
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._stats = StatsRecorder()

    def _prepare(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        ready = (
            tensor.device.type == "cpu" and tensor.is_contiguous() and (not self._pin or tensor.is_pinned())
        )
        if ready and not self.config.copy_on_put:
            return tensor
        held = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self._pin)
        return held.copy_(tensor)

    def get_many(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        start = time.perf_counter()
        with self._lock:
            found = [self._entries.get(key) for key in keys]
            for key, tensor in zip(keys, found):
                if tensor is not None:
                    self._entries.move_to_end(key)
        hits = [t for t in found if t is not None]
        self._stats.add(
            hits=len(hits),
            misses=len(found) - len(hits),
            bytes_read=sum(tensor_bytes(t) for t in hits),
            get_seconds=time.perf_counter() - start,
        )
        return found

    def put_many(self, items: Sequence[tuple[str, torch.Tensor]]) -> int:
        start = time.perf_counter()
        stored = rejected = written = evicted = 0
        for key, tensor in items:
            size = tensor_bytes(tensor)
            if size > self.config.capacity_bytes:
                rejected += 1
                continue
            held = self._prepare(tensor)
            with self._lock:
                old = self._entries.pop(key, None)
                if old is not None:
                    self._bytes -= tensor_bytes(old)
                while self._entries and self._bytes + size > self.config.capacity_bytes:
                    _, victim = self._entries.popitem(last=False)
                    self._bytes -= tensor_bytes(victim)
                    evicted += 1
                self._entries[key] = held
                self._bytes += size
                self._stats.set(resident_bytes=self._bytes, resident_values=len(self._entries))
            stored += 1
            written += size
        self._stats.add(
            puts=stored,
            put_failures=rejected,
            bytes_written=written,
            evictions=evicted,
            put_seconds=time.perf_counter() - start,
        )
        return stored

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [key in self._entries for key in keys]

    def discard_many(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                old = self._entries.pop(key, None)
                if old is not None:
                    self._bytes -= tensor_bytes(old)
            self._stats.set(resident_bytes=self._bytes, resident_values=len(self._entries))

    def stats(self) -> KVStats:
        return self._stats.snapshot()

    def healthy(self) -> bool:
        return True

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
            self._stats.set(resident_bytes=0, resident_values=0)
