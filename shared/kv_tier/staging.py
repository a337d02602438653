"""Copies between the device and pageable host memory through a small fixed ring of pinned buffers.

The CPU tier holds chunk KV in ordinary (pageable) host memory, however large it is. Pinning each stored
value instead costs a ``cudaHostAlloc`` per value for as long as the tier is filling: PyTorch's caching host
allocator only reuses blocks that were freed, a tier of tens of GB never evicts in a benchmark, and
``cudaHostAlloc`` is slow and can synchronize the device, stalling the decode rounds queued behind it. On an
H100 (all-in-one, 16 concurrent unique 16K-token requests at Dream-7B shapes) a 50 GB pinned tier served
1.09 and 0.99 req/s against 1.40 req/s for a 2 GiB one, whose evicted blocks were reused
(``docs/kv-tier-and-handoff.md``).

:class:`HostStaging` owns ``buffers`` pinned buffers of ``buffer_bytes`` each, allocated once on first use
and reused for every copy after that, so the pinned memory a process uses for the tier is bounded and does
not depend on the tier's capacity:

- :meth:`HostStaging.to_host` (the background writer's thread): device -> pinned buffer on the ring's own
  copy stream, wait for that copy's event, memcpy into a fresh pageable tensor; the next piece's DMA runs
  while the previous one is memcpy'd.
- :meth:`HostStaging.to_device` (a tier hit in chunk prefill): memcpy into a pinned buffer, DMA on the copy
  stream into a device scratch tensor allocated on that stream, then the caller's stream waits for the copy
  stream and copies the scratch into place. The caller's thread waits only for its own earlier pieces'
  DMAs (never for the caller's stream, so no device sync); the copy itself is asynchronous.

:func:`load_into` is chunk prefill's hit path: pinned, device or CPU-destination values are copied
directly, pageable host values to a CUDA destination go through the process's ring for that device.

Without CUDA the same ring runs synchronously (pinning off, or an injected ``alloc``), so the piecewise
logic is tested on CPU.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

import torch

BUFFER_BYTES = 32 << 20  # one Dream-7B 512-token chunk's KV (28 MiB) in one piece
BUFFERS = 2  # double buffering: one piece's DMA overlaps the previous piece's memcpy
_ALIGN = 256  # bytes: where each value starts in a scratch tensor holding several


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes."""
    return tensor.reshape(-1).view(torch.uint8)


class HostStaging:
    """A fixed ring of ``buffers`` reusable host buffers of ``buffer_bytes``, pinned when ``pin`` (None: when
    CUDA is available). ``alloc(nbytes)`` makes one buffer (a uint8 tensor); tests inject a counting one.
    Thread-safe: one copy runs at a time."""

    def __init__(
        self,
        buffer_bytes: int = BUFFER_BYTES,
        buffers: int = BUFFERS,
        pin: bool | None = None,
        alloc: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        if buffer_bytes <= 0 or buffers <= 0:
            raise ValueError(f"need buffer_bytes > 0 and buffers > 0, got {buffer_bytes} and {buffers}")
        self.buffer_bytes = buffer_bytes
        self.count = buffers
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._alloc = alloc or self._default_alloc
        self._lock = threading.Lock()
        self._buffers: list[torch.Tensor] = []
        self._inflight: list[torch.cuda.Event | None] = [None] * buffers  # last DMA using each buffer
        self._events: dict[tuple[int, torch.device], torch.cuda.Event] = {}  # an event is one device's
        self._next = 0  # the ring's next buffer
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.allocations = 0  # buffers allocated so far: at most ``buffers``, ever

    @property
    def pinned_bytes(self) -> int:
        """Host bytes this ring holds: at most ``buffers * buffer_bytes``, whatever it copied."""
        return sum(b.numel() for b in self._buffers)

    def to_host(self, value: torch.Tensor, ready: torch.cuda.Event | None = None) -> torch.Tensor:
        """A pageable host copy of ``value``. On CUDA the copy waits for ``ready`` (recorded where
        ``value`` was produced) on the ring's copy stream; returns once the copy is complete."""
        out = torch.empty(value.shape, dtype=value.dtype)
        if value.numel() == 0:
            return out
        src = _bytes(value.contiguous())
        dst = _bytes(out)
        stream = self._stream(value.device) if value.is_cuda else None
        with self._lock:
            if stream is not None and ready is not None:
                stream.wait_event(ready)
            pending: deque[tuple[int, int, int]] = deque()  # (buffer, offset, size) not yet memcpy'd out
            for offset in range(0, src.numel(), self.buffer_bytes):
                if len(pending) == self.count:
                    self._unload(pending.popleft(), dst)
                size = min(self.buffer_bytes, src.numel() - offset)
                slot, buf = self._take(size)
                piece = src[offset : offset + size]
                if stream is not None:
                    with torch.cuda.stream(stream):
                        buf.copy_(piece, non_blocking=True)
                    self._record(slot, stream)
                else:
                    buf.copy_(piece)
                pending.append((slot, offset, size))
            while pending:
                self._unload(pending.popleft(), dst)
        return out

    def to_device(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copies each host ``value`` into its ``dest`` (``(dest, value)`` pairs, one device, any strides).

        On CUDA the copies are ordered on the caller's current stream like a ``non_blocking`` copy from
        pinned memory: the call returns once the last pieces' DMAs are queued, without waiting for the
        caller's stream."""
        pairs = [(dest, value) for dest, value in pairs if value.numel()]
        if not pairs:
            return
        device = pairs[0][0].device
        if any(dest.device != device for dest, _ in pairs):
            raise ValueError("to_device copies to one device per call")
        spans, total = [], 0
        for _, value in pairs:
            size = value.numel() * value.element_size()
            spans.append((total, size))
            total += -(-size // _ALIGN) * _ALIGN
        stream = self._stream(device) if device.type == "cuda" else None
        with self._lock:
            if stream is not None:
                with torch.cuda.stream(stream):  # the scratch belongs to the copy stream's pool
                    scratch = torch.empty(total, dtype=torch.uint8, device=device)
            else:
                scratch = torch.empty(total, dtype=torch.uint8, device=device)
            for (_, value), (start, size) in zip(pairs, spans):
                src = _bytes(value.contiguous())
                for offset in range(0, size, self.buffer_bytes):
                    n = min(self.buffer_bytes, size - offset)
                    slot, buf = self._take(n)
                    buf.copy_(src[offset : offset + n])
                    target = scratch[start + offset : start + offset + n]
                    if stream is not None:
                        with torch.cuda.stream(stream):
                            target.copy_(buf, non_blocking=True)
                        self._record(slot, stream)
                    else:
                        target.copy_(buf)
            if stream is not None:
                current = torch.cuda.current_stream(device)
                current.wait_stream(stream)
                scratch.record_stream(current)
        for (dest, value), (start, size) in zip(pairs, spans):
            dest.copy_(scratch[start : start + size].view(value.dtype).view(value.shape))

    def _default_alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def _take(self, size: int) -> tuple[int, torch.Tensor]:
        """The ring's next buffer, once the DMA that last used it is done; its first ``size`` bytes."""
        if not self._buffers:
            for _ in range(self.count):
                self._buffers.append(self._alloc(self.buffer_bytes))
                self.allocations += 1
        slot = self._next
        self._next = (slot + 1) % self.count
        done = self._inflight[slot]
        if done is not None:
            done.synchronize()
            self._inflight[slot] = None
        return slot, self._buffers[slot][:size]

    def _record(self, slot: int, stream: torch.cuda.Stream) -> None:
        key = (slot, stream.device)
        event = self._events.get(key)
        if event is None:
            event = self._events[key] = torch.cuda.Event()
        event.record(stream)
        self._inflight[slot] = event

    def _unload(self, piece: tuple[int, int, int], dst: torch.Tensor) -> None:
        slot, offset, size = piece
        done = self._inflight[slot]
        if done is not None:
            done.synchronize()
            self._inflight[slot] = None
        dst[offset : offset + size].copy_(self._buffers[slot][:size])

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream


_LOADERS: dict[torch.device, HostStaging] = {}
_LOADERS_LOCK = threading.Lock()


def loader(device: torch.device) -> HostStaging:
    """The process's ring for tier hits copied to ``device`` (one per device, made on first use)."""
    with _LOADERS_LOCK:
        ring = _LOADERS.get(device)
        if ring is None:
            ring = _LOADERS[device] = HostStaging()
        return ring


def needs_staging(dest: torch.Tensor, value: torch.Tensor) -> bool:
    """Pageable host memory going to a CUDA device: a direct copy would be synchronous."""
    return dest.is_cuda and value.device.type == "cpu" and not value.is_pinned()


def load_into(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copies each ``value`` into its ``dest`` without a device sync: device and pinned values directly
    (``non_blocking``), pageable host values to a CUDA device through :func:`loader`'s ring."""
    staged: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for dest, value in pairs:
        if needs_staging(dest, value):
            staged.setdefault(dest.device, []).append((dest, value))
        else:
            dest.copy_(value, non_blocking=True)
    for device, group in staged.items():
        loader(device).to_device(group)
