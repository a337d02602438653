"""Per-request trace: what the engine decided and where the time and memory went."""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Trace:
    num_chunks: int = 0
    context_tokens: int = 0
    chunk_scores: list[dict[str, float | int | None]] = field(default_factory=list)
    selected: list[int] = field(default_factory=list)
    kept_tokens: list[int] = field(default_factory=list)
    _timings: dict[str, float] = field(default_factory=dict, repr=False)
    peak_memory_bytes: int = 0
    memory_kind: str = "cpu-rss-delta"
    cache_hits: int = 0
    cache_misses: int = 0
    prefill_skipped: bool = False
    chunks_written: int = 0  # chunk KV values handed to the KV tier after selection (its write policy)
    decode_steps: int = 0
    # event-timed phases not read yet: (name, start, end) on the stream that ran them
    _pending: list[tuple[str, Any, Any]] = field(default_factory=list, repr=False)

    @property
    def timings(self) -> dict[str, float]:
        """Seconds per phase. Event-timed phases are settled here, waiting for their end if need be."""
        for name, start, end in self._pending:
            end.synchronize()
            self._timings[name] = self._timings.get(name, 0.0) + start.elapsed_time(end) / 1e3
        self._pending.clear()
        return self._timings

    @contextmanager
    def phase(self, name: str, device: torch.device, sync: bool = True) -> Iterator[None]:
        """Time one phase. ``sync`` (or off CUDA): host time, on CUDA synchronising first and last so the
        time belongs to this phase. Without ``sync`` on CUDA: the phase's span on the current stream, from
        CUDA events, and nothing waits, so the host can queue the next phase's work while the device still
        runs this one's (the prefill worker's prefill and scoring: their host time is mostly kernel
        launches). Such phases are settled when :attr:`timings` is read."""
        if device.type == "cuda" and not sync:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._pending.append((name, start, end))
            return
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        try:
            yield
        finally:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self._timings[name] = self._timings.get(name, 0.0) + time.perf_counter() - began

    def adopt(self, other: Trace, name: str) -> None:
        """Take ``other``'s timing of phase ``name`` (a batch's shared prefill) without settling it."""
        self._pending += [p for p in other._pending if p[0] == name]
        if name in other._timings:
            self._timings[name] = other._timings[name]

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_chunks": self.num_chunks,
            "context_tokens": self.context_tokens,
            "chunk_scores": self.chunk_scores,
            "selected": self.selected,
            "kept_tokens": self.kept_tokens,
            "timings": dict(self.timings),
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_kind": self.memory_kind,
            "cache_hits": self.cache_hits,
            "cache_misses": self.cache_misses,
            "prefill_skipped": self.prefill_skipped,
            "chunks_written": self.chunks_written,
            "decode_steps": self.decode_steps,
        }


class MemoryMeter:
    """Peak memory of a request (of its prefill batch): on CUDA how far the allocator's peak rose above
    what was allocated when the batch started (so weights, the decode KV pool and other requests' standing
    memory are not counted), on CPU the growth of the process's peak RSS."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._base = 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self._base = torch.cuda.memory_allocated(device)
        self._rss0 = _peak_rss()

    def peak(self) -> tuple[int, str]:
        if self.device.type == "cuda":
            return max(0, torch.cuda.max_memory_allocated(self.device) - self._base), "cuda-peak-above-start"
        return max(0, _peak_rss() - self._rss0), "cpu-rss-delta"


def _peak_rss() -> int:
    # ru_maxrss is in KiB on Linux.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
