"""The one interface every KV-tier backend (CPU LRU, Redis, stacked tiers) implements.

Contract, relied on by the engine and services:
- ``get_many`` answers a tensor only if it is exactly what was stored under that key (verified for the
  Redis tier) and ``None`` otherwise: absent, evicted, corrupt, mismatched or backend unreachable. It never
  raises for backend trouble; the caller recomputes misses.
- ``put_many`` is best effort and returns how many values were stored; failures are counted in ``stats()``.
- ``contains_many`` is a hint (a value may vanish or prove corrupt before it is read).
- Returned tensors may be shared with the store: treat them as read-only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from pdllm.shared.kv_tier.stats import KVStats


@runtime_checkable
class KVStore(Protocol):
    name: str

    def get_many(self, keys: Sequence[str]) -> list[torch.Tensor | None]: ...

    def put_many(self, items: Sequence[tuple[str, torch.Tensor]]) -> int: ...

    def contains_many(self, keys: Sequence[str]) -> list[bool]: ...

    def stats(self) -> KVStats: ...

    def healthy(self) -> bool: ...

    def close(self) -> None: ...
