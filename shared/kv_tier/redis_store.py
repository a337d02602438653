"""Chunk KV in Redis: pipelined binary GET/SET over a connection pool, multi-part values, TTL.

A value that fits in one part is stored as-is under its key. A larger one is split into parts stored under
``<key>:part:<i>`` and the key holds a small manifest (part count, total and part length), written after the
parts in the same pipeline, so a reader never sees a manifest before its parts were sent. Missing, short or
corrupt parts make the value a miss (and it is deleted so the next prefill rewrites it); the value's own
checksum (see ``format``) catches anything the manifest cannot.

Redis trouble never reaches the caller: a failed operation counts an error, turns ``healthy()`` false and
answers misses / failed puts. For ``retry_after_s`` afterwards calls do not touch Redis at all (no connect
timeout per request while it is down); then the next call tries again, and the pool reconnects.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ModuleNotFoundError:  # only the Redis tier needs redis-py; engines and the CPU tier run without it
    redis = None

from pdllm.shared.kv_tier.format import MAGIC, KVCorruptError, KVFormatError, KVMeta, decode, encode
from pdllm.shared.kv_tier.stats import KVStats, StatsRecorder

MANIFEST_MAGIC = b"PDKM"
MANIFEST_VERSION = 1
_MANIFEST = struct.Struct("<4sHIQQI")  # magic, version, parts, total bytes, part bytes, crc32 of the rest
MAX_PARTS = 1 << 16
_BACKEND_ERRORS = (redis.RedisError, OSError) if redis is not None else (OSError,)
MiB = 1 << 20
_log = logging.getLogger("pdllm.kv_tier.redis")


@dataclass(frozen=True)
class RedisStoreConfig:
    url: str
    ttl_s: float | None = 6 * 3600.0  # None: no expiry (then size Redis with maxmemory + an LRU policy)
    # Redis refuses strings over 512 MB, and on loopback 1-4 MiB parts moved ~0.8 GB/s where single 30 MB
    # values moved ~0.3 GB/s (Redis and redis-py both handle huge bulk strings slowly).
    part_bytes: int = 4 * MiB
    socket_read_size: int = 1 * MiB  # redis-py's 32 KiB default halves GET throughput of MB-sized values
    max_connections: int = 32
    connect_timeout_s: float = 1.0
    socket_timeout_s: float = 10.0
    retry_after_s: float = 1.0
    pipeline_bytes: int = 256 * MiB  # flush a write pipeline once this much is queued

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"Redis URL must start with redis://, rediss:// or unix://, got {self.url!r}")
        if self.part_bytes < 1 or self.part_bytes > 512 * MiB - 1:
            raise ValueError(f"part_bytes must be in [1, 512 MiB), got {self.part_bytes}")
        if self.ttl_s is not None and self.ttl_s < 0.001:
            raise ValueError(f"ttl_s must be >= 1 ms or None, got {self.ttl_s}")


def part_key(key: str, index: int) -> str:
    return f"{key}:part:{index}"


def _manifest(total: int, part_bytes: int) -> bytes:
    fields = (MANIFEST_MAGIC, MANIFEST_VERSION, -(-total // part_bytes), total, part_bytes)
    head = _MANIFEST.pack(*fields, 0)[:-4]
    return _MANIFEST.pack(*fields, zlib.crc32(head))


def _parse_manifest(raw: bytes) -> tuple[int, int, int] | str:
    """(parts, total, part bytes), or why the manifest is unusable: 'corrupt' or 'version'."""
    if len(raw) != _MANIFEST.size:
        return "corrupt"
    _, version, parts, total, part_bytes, crc = _MANIFEST.unpack(raw)
    if zlib.crc32(raw[:-4]) != crc:
        return "corrupt"
    if version != MANIFEST_VERSION:
        return "version"
    if not 0 < parts <= MAX_PARTS or part_bytes <= 0 or parts != -(-total // part_bytes):
        return "corrupt"
    return parts, total, part_bytes


@dataclass
class _Pending:
    """A multi-part value whose parts are still to be fetched."""

    index: int
    key: str
    parts: int
    total: int
    part_bytes: int


class RedisStore:
    def __init__(self, config: RedisStoreConfig, meta: KVMeta, name: str = "redis") -> None:
        self.config = config
        self.meta = meta
        self.name = name
        if redis is None:
            raise ValueError("the Redis KV tier needs the redis package (pip install 'redis[hiredis]')")
        # One quick retry lets a pooled connection that died with a restarted server reconnect transparently.
        self._client = redis.Redis.from_url(
            config.url,
            max_connections=config.max_connections,
            socket_connect_timeout=config.connect_timeout_s,
            socket_timeout=config.socket_timeout_s,
            socket_read_size=config.socket_read_size,
            retry=Retry(NoBackoff(), 1),
        )
        self._stats = StatsRecorder()
        self._state_lock = threading.Lock()
        self._failed_at: float | None = None
        self._refusing = False  # the last put reached Redis and every value was refused

    # ------------------------------------------------------------------ availability
    def _available(self) -> bool:
        with self._state_lock:
            failed_at = self._failed_at
        return failed_at is None or time.monotonic() - failed_at >= self.config.retry_after_s

    def _mark(self, ok: bool) -> None:
        with self._state_lock:
            self._failed_at = None if ok else time.monotonic()
        if not ok:
            self._stats.add(errors=1)

    def healthy(self) -> bool:
        """False while Redis is known to be failing, or refused every value of the last put (out of memory);
        probes it again once ``retry_after_s`` has passed."""
        with self._state_lock:
            failed_at, refusing = self._failed_at, self._refusing
        if refusing:  # until a put succeeds again
            return False
        if failed_at is None:
            return True
        return self._available() and self.ping()

    def ping(self) -> bool:
        try:
            self._client.ping()
        except _BACKEND_ERRORS:
            self._mark(False)
            return False
        self._mark(True)
        return True

    # ------------------------------------------------------------------ reads
    def get_many(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        start = time.perf_counter()
        results: list[torch.Tensor | None] = [None] * len(keys)
        if keys and self._available():
            try:
                self._read(keys, results)
                self._mark(True)
            except _BACKEND_ERRORS:
                self._mark(False)
        hits = [t for t in results if t is not None]
        self._stats.add(
            hits=len(hits),
            misses=len(results) - len(hits),
            bytes_read=sum(t.numel() * t.element_size() for t in hits),
            get_seconds=time.perf_counter() - start,
        )
        return results

    def _read(self, keys: Sequence[str], results: list[torch.Tensor | None]) -> None:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        # Per-key errors (WRONGTYPE: something else wrote another Redis type there) come back as values, so
        # one bad key is repaired like a corrupt value instead of failing the whole read as "backend down".
        raw_values = pipe.execute(raise_on_error=False)
        pending: list[_Pending] = []
        bad: list[tuple[str, int]] = []
        for index, (key, raw) in enumerate(zip(keys, raw_values)):
            if raw is None:
                continue
            if isinstance(raw, Exception):
                self._stats.add(corrupt=1)
                bad.append((key, 0))
            elif raw[:4] == MAGIC:
                results[index] = self._decode(key, raw, bad, parts=0)
            elif raw[:4] == MANIFEST_MAGIC and not isinstance(manifest := _parse_manifest(raw), str):
                pending.append(_Pending(index, key, *manifest))
            elif raw[:4] == MANIFEST_MAGIC and manifest == "version":
                self._stats.add(mismatched=1)
            else:
                self._stats.add(corrupt=1)
                bad.append((key, 0))
        if pending:
            self._read_parts(pending, results, bad)
        if bad:
            self._delete(bad)

    def _read_parts(
        self, pending: list[_Pending], results: list[torch.Tensor | None], bad: list[tuple[str, int]]
    ) -> None:
        pipe = self._client.pipeline(transaction=False)
        for item in pending:
            for part in range(item.parts):
                pipe.get(part_key(item.key, part))
        replies = iter(pipe.execute(raise_on_error=False))
        for item in pending:
            chunks = [
                None if isinstance(r, Exception) else r for r in (next(replies) for _ in range(item.parts))
            ]
            buffer = self._assemble(item, chunks)
            if buffer is None:
                self._stats.add(corrupt=1)
                bad.append((item.key, item.parts))
                continue
            results[item.index] = self._decode(item.key, buffer, bad, parts=item.parts)

    @staticmethod
    def _assemble(item: _Pending, chunks: list[bytes | None]) -> bytearray | None:
        sizes = [min(item.part_bytes, item.total - part * item.part_bytes) for part in range(item.parts)]
        if any(chunk is None or len(chunk) != size for chunk, size in zip(chunks, sizes)):
            return None
        buffer = bytearray(item.total)
        offset = 0
        for chunk, size in zip(chunks, sizes):
            buffer[offset : offset + size] = chunk  # type: ignore[assignment]
            offset += size
        return buffer

    def _decode(
        self, key: str, raw: bytes | bytearray, bad: list[tuple[str, int]], parts: int
    ) -> torch.Tensor | None:
        try:
            return decode(raw, self.meta, key)
        except KVCorruptError:
            self._stats.add(corrupt=1)
            bad.append((key, parts))
        except KVFormatError:
            # Another format version or model config may legitimately share this Redis: leave it be.
            self._stats.add(mismatched=1)
        return None

    def _delete(self, bad: list[tuple[str, int]]) -> None:
        # A corrupt value left in place would look present to contains_many() and never be rewritten.
        _log.warning(
            "kv tier: %d corrupt chunk-KV value(s) in Redis deleted (they will be recomputed): %s",
            len(bad),
            ", ".join(key for key, _ in bad[:5]) + (" ..." if len(bad) > 5 else ""),
        )
        names = [name for key, parts in bad for name in (key, *(part_key(key, i) for i in range(parts)))]
        self._client.delete(*names)

    # ------------------------------------------------------------------ writes
    def put_many(self, items: Sequence[tuple[str, torch.Tensor]]) -> int:
        start = time.perf_counter()
        if not items:
            return 0
        stored = written = 0
        if self._available():
            stored, written, ok = self._write(
                [(key, encode(tensor, self.meta, key)) for key, tensor in items]
            )
            self._mark(ok)
            with self._state_lock:  # reachable but storing nothing (e.g. OOM under maxmemory): unhealthy
                self._refusing = ok and stored == 0
        else:
            for key, tensor in items:  # a caller's bad tensor is its bug, reported even while Redis is down
                problem = self.meta.layout_error(tuple(tensor.shape), tensor.dtype)
                if problem:
                    raise ValueError(f"cannot store chunk KV under {key!r}: {problem}")
        self._stats.add(
            puts=stored,
            put_failures=len(items) - stored,
            bytes_written=written,
            put_seconds=time.perf_counter() - start,
        )
        return stored

    def _write(self, encoded: list[tuple[str, bytearray]]) -> tuple[int, int, bool]:
        """(values stored, bytes stored, backend reachable); a value counts only if all its commands succeeded."""
        px = None if self.config.ttl_s is None else max(1, round(self.config.ttl_s * 1000))
        stored = written = 0
        pipe = self._client.pipeline(transaction=False)
        batch: list[tuple[int, int]] = []  # (commands, bytes) per queued value
        queued = 0
        for position, (key, value) in enumerate(encoded):
            view = memoryview(value)
            step = self.config.part_bytes
            if len(view) <= step:
                pipe.set(key, view, px=px)
            else:
                for part, offset in enumerate(range(0, len(view), step)):
                    pipe.set(part_key(key, part), view[offset : offset + step], px=px)
                pipe.set(key, _manifest(len(view), step), px=px)
            batch.append((len(pipe), len(view)))
            queued += len(view)
            if queued < self.config.pipeline_bytes and position < len(encoded) - 1:
                continue
            try:
                # Command errors (e.g. OOM under maxmemory) fail only their value; a lost connection raises.
                replies = pipe.execute(raise_on_error=False)
            except _BACKEND_ERRORS:
                return stored, written, False
            begin = 0
            for end, size in batch:
                if not any(isinstance(reply, Exception) for reply in replies[begin:end]):
                    stored += 1
                    written += size
                begin = end
            batch, queued = [], 0
        return stored, written, True

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        if not keys or not self._available():
            return [False] * len(keys)
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            found = [bool(n) for n in pipe.execute()]
        except _BACKEND_ERRORS:
            self._mark(False)
            return [False] * len(keys)
        self._mark(True)
        return found

    def stats(self) -> KVStats:
        return self._stats.snapshot()

    def close(self) -> None:
        self._client.close()
