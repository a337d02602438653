"""Building the configured tier stack (CPU, Redis, or CPU in front of Redis)."""

from __future__ import annotations

from dataclasses import dataclass

from pdllm.shared.kv_tier.base import KVStore
from pdllm.shared.kv_tier.cpu_store import CPUStore, CPUStoreConfig
from pdllm.shared.kv_tier.format import KVMeta
from pdllm.shared.kv_tier.redis_store import RedisStore, RedisStoreConfig
from pdllm.shared.kv_tier.tiered import TieredStore


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
