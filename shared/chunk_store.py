"""Where step-3 chunk KV lives between requests: a content-keyed store.

:class:`ChunkKVStore` is the subset of ``pdllm.shared.kv_tier``'s ``KVStore`` that chunk prefill needs
(``get_many`` / ``put_many``), so ``pdllm serve`` can hand both workers a CPU, Redis or tiered KV-tier
store. The in-process engine's default is the KV tier's CPU LRU (:func:`default_chunk_store`). Values use
the chunk KV layout ``[num_layers, 2, num_kv_heads, T, head_dim]`` (K with RoPE at the chunk's own
positions 0..T-1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from pdllm.shared.kv_tier.cpu_store import CPUStore, CPUStoreConfig
from pdllm.shared.kv_tier.keys import chunk_key


class ChunkKVStore(Protocol):
    """``put_many`` keeps copies, never the tensors it is given: writers pass views of live buffers."""

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


def default_chunk_store(capacity_bytes: int = 2 << 30) -> CPUStore:
    """The in-process chunk store an engine gets when the services hand it none: the KV tier's CPU LRU."""
    return CPUStore(CPUStoreConfig(capacity_bytes=capacity_bytes), name="in-process-lru")
