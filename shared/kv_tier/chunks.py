"""Chunk-level convenience over a :class:`KVStore`, and building the configured tier stack.

:class:`ChunkStore` turns chunks (their token ids, leading BOS included: exactly the T tokens whose KV is
stored) into keys, and rejects a stored tensor whose token count disagrees with the chunk, so a bug
elsewhere shows up as a recompute rather than a wrong answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdllm.shared.kv_tier.base import KVStore
from pdllm.shared.kv_tier.cpu_store import CPUStore, CPUStoreConfig
from pdllm.shared.kv_tier.format import KVMeta
from pdllm.shared.kv_tier.keys import chunk_key
from pdllm.shared.kv_tier.redis_store import RedisStore, RedisStoreConfig
from pdllm.shared.kv_tier.tiered import TieredStore

TokenIds = Sequence[int] | torch.Tensor


@dataclass(frozen=True)
class ChunkKeySpace:
    """Everything besides the tokens that a chunk's KV depends on."""

    model_id: str
    dtype: torch.dtype
    chunk_size: int
    position_scheme: str  # e.g. "local": RoPE at the chunk's own positions 0..T-1

    def key(self, token_ids: TokenIds) -> str:
        return chunk_key(self.model_id, self.dtype, self.chunk_size, self.position_scheme, token_ids)


class ChunkStore:
    def __init__(self, store: KVStore, space: ChunkKeySpace) -> None:
        self.store = store
        self.space = space

    def keys(self, chunks: Sequence[TokenIds]) -> list[str]:
        return [self.space.key(chunk) for chunk in chunks]

    def get(self, chunks: Sequence[TokenIds]) -> list[torch.Tensor | None]:
        found = self.store.get_many(self.keys(chunks))
        return [
            tensor if tensor is not None and tensor.dim() == 5 and tensor.shape[3] == len(chunk) else None
            for chunk, tensor in zip(chunks, found)
        ]

    def put(self, chunks: Sequence[TokenIds], tensors: Sequence[torch.Tensor]) -> int:
        if len(chunks) != len(tensors):
            raise ValueError(f"{len(chunks)} chunks but {len(tensors)} KV tensors")
        for chunk, tensor in zip(chunks, tensors):
            if tensor.dim() != 5 or tensor.shape[3] != len(chunk):
                raise ValueError(f"KV of shape {list(tensor.shape)} does not hold {len(chunk)} chunk tokens")
        return self.store.put_many(list(zip(self.keys(chunks), tensors)))

    def missing(self, chunks: Sequence[TokenIds]) -> list[int]:
        """Indices of chunks not in the store (a hint: present values can still miss on read)."""
        present = self.store.contains_many(self.keys(chunks))
        return [i for i, hit in enumerate(present) if not hit]


@dataclass(frozen=True)
class KVTierConfig:
    cpu: CPUStoreConfig | None = None
    redis: RedisStoreConfig | None = None


def build_kv_store(config: KVTierConfig, meta: KVMeta) -> KVStore:
    """CPU tier, Redis tier, or CPU in front of Redis, as configured."""
    tiers: list[KVStore] = []
    if config.cpu is not None:
        tiers.append(CPUStore(config.cpu))
    if config.redis is not None:
        tiers.append(RedisStore(config.redis, meta))
    if not tiers:
        raise ValueError("KV tier config names no tier: give a CPU capacity, a Redis URL, or both")
    return tiers[0] if len(tiers) == 1 else TieredStore(tiers)
