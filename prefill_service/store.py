"""Where step-3 chunk KV lives between requests: a content-keyed store.

:class:`ChunkKVStore` is the subset of ``pdllm.shared.kv_tier``'s ``KVStore`` the engine needs
(``get_many`` / ``put_many``), so the services can hand the engine a CPU, Redis or tiered KV-tier store.
:class:`LRUChunkStore` is the in-process default. Values use the chunk KV layout
``[num_layers, 2, num_kv_heads, T, head_dim]`` (K with RoPE at the chunk's own positions 0..T-1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import torch

from pdllm.shared.kv_tier.keys import chunk_key


class ChunkKVStore(Protocol):
    def get_many(self, keys: Sequence[str]) -> list[torch.Tensor | None]: ...

    def put_many(self, items: Sequence[tuple[str, torch.Tensor]]) -> int: ...


def position_scheme(prefill_attention: str) -> str:
    """Names what the stored K/V depend on besides the tokens: local positions and the intra-chunk mask."""
    return f"chunk-local-{prefill_attention}"


def chunk_keys(
    model_id: str,
    dtype: torch.dtype,
    chunk_size: int,
    prefill_attention: str,
    chunks: Sequence[Sequence[int]],
) -> list[str]:
    scheme = position_scheme(prefill_attention)
    return [chunk_key(model_id, dtype, chunk_size, scheme, list(c)) for c in chunks]


class LRUChunkStore:
    """In-process LRU bounded by bytes; keeps CPU copies so device memory is not held by the cache."""

    name = "in-process-lru"

    def __init__(self, capacity_bytes: int = 2 << 30) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.puts = 0

    def get_many(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for key in keys:
            value = self._entries.get(key)
            if value is None:
                self.misses += 1
            else:
                self.hits += 1
                self._entries.move_to_end(key)
            out.append(value)
        return out

    def put_many(self, items: Sequence[tuple[str, torch.Tensor]]) -> int:
        stored = 0
        for key, value in items:
            size = value.numel() * value.element_size()
            if size > self.capacity_bytes:
                continue
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.numel() * old.element_size()
            self._entries[key] = value.detach().to("cpu", copy=True).contiguous()
            self._bytes += size
            stored += 1
            while self._bytes > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.numel() * evicted.element_size()
        self.puts += stored
        return stored

    def __len__(self) -> int:
        return len(self._entries)
