"""KV tier: chunk-KV value format, in-process CPU LRU store, Redis store, stacked tiers."""

from pdllm.shared.kv_tier.base import KVStore
from pdllm.shared.kv_tier.chunks import KVTierConfig, build_kv_store
from pdllm.shared.kv_tier.cpu_store import CPUStore, CPUStoreConfig
from pdllm.shared.kv_tier.format import KVCorruptError, KVFormatError, KVMeta, KVMismatchError, KVVersionError
from pdllm.shared.kv_tier.keys import chunk_key
from pdllm.shared.kv_tier.redis_store import RedisStore, RedisStoreConfig
from pdllm.shared.kv_tier.stats import KVStats, register_kv_metrics
from pdllm.shared.kv_tier.tiered import TieredStore

__all__ = [
    "CPUStore",
    "CPUStoreConfig",
    "KVCorruptError",
    "KVFormatError",
    "KVMeta",
    "KVMismatchError",
    "KVStats",
    "KVStore",
    "KVTierConfig",
    "KVVersionError",
    "RedisStore",
    "RedisStoreConfig",
    "TieredStore",
    "build_kv_store",
    "chunk_key",
    "register_kv_metrics",
]
