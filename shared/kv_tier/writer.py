"""A KV-tier store whose writes leave the caller's thread at once: a bounded background writer.

The prefill worker publishes chunk step-3 KV once a request's top-K is known (its write policy picks which:
up to the whole document, about 1 GB of bf16 per 16K-token Dream-7B document), on the thread that drives
the device. Copying that to host memory, and on to Redis, there would stall every decode round behind it.
:class:`BackgroundKVWriter` wraps any :class:`~pdllm.shared.kv_tier.base.KVStore`:

- ``put_many`` takes a private copy of each value on its own device (a device-to-device clone costs
  ~40 us per chunk on a GPU, and the caller may reuse or modify its buffers afterwards), records an
  event, queues it and returns. Values that would push the queued bytes past ``max_pending_bytes`` are
  dropped and counted (``put_failures``); the caller never waits.
- One writer thread copies each queued value to pageable host memory, then hands it to the wrapped store
  (CPU LRU, Redis, or both). On CUDA the copy goes through the writer's
  :class:`~pdllm.shared.kv_tier.staging.HostStaging`: a few pinned buffers (``staging_buffers`` of
  ``staging_buffer_bytes``, 64 MiB by default) allocated once and reused, on the ring's own copy stream.
  Pinning each value instead would call ``cudaHostAlloc`` for every value while the tier fills, which
  stalled the device (``staging.py`` has the measurement); the pinned bytes stay bounded whatever the
  tier's capacity.
- Reads see queued values: ``get_many`` and ``contains_many`` answer from the queue first, so a write is
  visible as soon as ``put_many`` returns, unless it was dropped.

``stats()`` is the writer's own: ``puts`` values handed to the wrapped store, ``put_failures`` values
dropped (queue full, or the wrapped store refused them), ``resident_bytes`` / ``resident_values`` what is
queued now. ``tiers`` are the wrapped store's, so each tier keeps exporting its own metrics.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdllm.shared.kv_tier.base import KVStore
from pdllm.shared.kv_tier.staging import BUFFER_BYTES, BUFFERS, HostStaging
from pdllm.shared.kv_tier.stats import KVStats, StatsRecorder


@dataclass(frozen=True)
class KVWriterConfig:
    max_pending_bytes: int = 1 << 30  # queued copies (device memory on a GPU) beyond which writes drop
    pin_memory: bool | None = None  # staging buffers in pinned memory; None: when CUDA is available
    staging_buffer_bytes: int = BUFFER_BYTES  # one device-to-host piece; larger values go in several
    staging_buffers: int = BUFFERS  # the ring's size: pinned bytes = staging_buffers * staging_buffer_bytes

    def __post_init__(self) -> None:
        if self.max_pending_bytes < 0:
            raise ValueError(f"max_pending_bytes must be >= 0, got {self.max_pending_bytes}")
        if self.staging_buffer_bytes <= 0 or self.staging_buffers <= 0:
            raise ValueError(
                "staging_buffer_bytes and staging_buffers must be positive, got "
                f"{self.staging_buffer_bytes} and {self.staging_buffers}"
            )


@dataclass
class _Pending:
    value: torch.Tensor  # the writer's private copy, on the caller's device
    ready: torch.cuda.Event | None  # recorded after the copy on the caller's stream (CUDA only)
    size: int


class BackgroundKVWriter:
    """``store``: where values end up; ``name``: the writer's label in metrics; ``staging``: the ring its
    device-to-host copies go through (default: one made from ``config``; tests inject their own)."""

    def __init__(
        self,
        store: KVStore,
        config: KVWriterConfig | None = None,
        name: str = "writer",
        staging: HostStaging | None = None,
    ) -> None:
        self.store = store
        self.config = config or KVWriterConfig()
        self.name = name
        self.staging = staging or HostStaging(
            self.config.staging_buffer_bytes, self.config.staging_buffers, pin=self.config.pin_memory
        )
        self._stats = StatsRecorder()
        self._cond = threading.Condition()
        self._pending: OrderedDict[str, _Pending] = OrderedDict()  # queue order = write order
        self._pending_bytes = 0
        self._writing: _Pending | None = (
            None  # the value the thread is writing (its bytes count until stored)
        )
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kv-{name}", daemon=True)
        self._thread.start()

    @property
    def tiers(self) -> list[KVStore]:
        return list(getattr(self.store, "tiers", None) or [self.store])

    def put_many(self, items: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Queues copies of ``items``; returns how many were queued (the rest were dropped)."""
        start = time.perf_counter()
        queued = dropped = 0
        for key, tensor in items:
            size = tensor.numel() * tensor.element_size()
            with self._cond:
                fits = not self._closed and self._pending_bytes + size <= self.config.max_pending_bytes
                if fits:
                    self._pending_bytes += size  # reserved before the copy so concurrent puts see it
            if not fits:
                dropped += 1
                continue
            value = tensor.detach().clone(memory_format=torch.contiguous_format)
            ready = None
            if value.is_cuda:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(value.device))
            with self._cond:
                old = self._pending.pop(key, None)
                if old is not None and old is not self._writing:  # else the thread releases its bytes
                    self._pending_bytes -= old.size
                self._pending[key] = _Pending(value, ready, size)
                self._set_gauges()
                self._cond.notify_all()
            queued += 1
        self._stats.add(put_failures=dropped, put_seconds=time.perf_counter() - start)
        return queued

    def get_many(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        with self._cond:
            queued = [self._pending.get(key) for key in keys]
        results: list[torch.Tensor | None] = [p.value if p is not None else None for p in queued]
        missing = [i for i, p in enumerate(queued) if p is None]
        if missing:
            for i, value in zip(missing, self.store.get_many([keys[i] for i in missing])):
                results[i] = value
        return results

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        with self._cond:
            queued = [key in self._pending for key in keys]
        missing = [i for i, hit in enumerate(queued) if not hit]
        if missing:
            for i, hit in zip(missing, self.store.contains_many([keys[i] for i in missing])):
                queued[i] = hit
        return queued

    def flush(self, timeout_s: float | None = None) -> bool:
        """Waits until every queued value reached the wrapped store; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout_s)

    def stats(self) -> KVStats:
        return self._stats.snapshot()

    def healthy(self) -> bool:
        return self._thread.is_alive() and self.store.healthy()

    def close(self, timeout_s: float = 30.0) -> None:
        """Writes what is queued (up to ``timeout_s``), stops the thread, closes the wrapped store."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        self.store.close()

    def _set_gauges(self) -> None:
        self._stats.set(resident_bytes=self._pending_bytes, resident_values=len(self._pending))

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._pending)
                if not self._pending:
                    return  # closed and drained
                key, item = next(iter(self._pending.items()))
                self._writing = item
            stored = self._write(key, item)
            with self._cond:
                self._writing = None
                if self._pending.get(key) is item:  # not replaced by a newer put meanwhile
                    del self._pending[key]
                self._pending_bytes -= item.size
                self._set_gauges()
                self._cond.notify_all()
            self._stats.add(puts=stored, put_failures=1 - stored, bytes_written=item.size * stored)

    def _write(self, key: str, item: _Pending) -> int:
        try:
            host = self._to_host(item)
            return self.store.put_many([(key, host)])
        except Exception:  # a backend failure loses this value only (the store contract: best effort)
            self._stats.add(errors=1)
            return 0

    def _to_host(self, item: _Pending) -> torch.Tensor:
        """A pageable host copy of a device value (through the staging ring); host values as they are."""
        value = item.value
        if not value.is_cuda:
            return value
        return self.staging.to_host(value, item.ready)
