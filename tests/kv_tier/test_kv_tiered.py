"""CPU tier in front of Redis: read-through, write-through, degradation; the factory."""

from __future__ import annotations

import pytest
import torch

from pdllm.shared.kv_tier.chunks import KVTierConfig, build_kv_store
from pdllm.shared.kv_tier.cpu_store import CPUStore, CPUStoreConfig
from pdllm.shared.kv_tier.redis_store import RedisStore, RedisStoreConfig
from pdllm.shared.kv_tier.tiered import TieredStore
from tests.fixtures.redis_server import RedisServer
from tests.kv_tier.helpers import chunk_kv, meta


def stack(url: str, capacity: int = 1 << 20) -> tuple[TieredStore, CPUStore, RedisStore]:
    cpu = CPUStore(CPUStoreConfig(capacity_bytes=capacity))
    redis_tier = RedisStore(RedisStoreConfig(url=url, part_bytes=1000, retry_after_s=0.05), meta())
    return TieredStore([cpu, redis_tier]), cpu, redis_tier


def test_redis_hit_fills_the_cpu_tier(redis_server: str) -> None:
    tiered, cpu, redis_tier = stack(redis_server)
    tensors = {f"k{i}": chunk_kv(meta(), 10 + i, seed=i) for i in range(3)}
    redis_tier.put_many(list(tensors.items()))  # as if another worker had written them
    cpu.put_many([("k0", tensors["k0"])])

    got = tiered.get_many(["k0", "k1", "k2", "nope"])
    assert got[3] is None and all(torch.equal(g, tensors[k]) for g, k in zip(got, ["k0", "k1", "k2"]))
    assert redis_tier.stats().hits == 2  # k0 came from the CPU tier
    assert cpu.contains_many(["k1", "k2"]) == [True, True]

    again = tiered.get_many(["k1", "k2"])
    assert all(torch.equal(g, tensors[k]) for g, k in zip(again, ["k1", "k2"]))
    assert redis_tier.stats().hits == 2  # second read served by the CPU tier
    stats = tiered.stats()
    assert (stats.hits, stats.misses) == (5, 1)


def test_write_through_reaches_both_tiers(redis_server: str) -> None:
    tiered, cpu, redis_tier = stack(redis_server)
    items = [("a", chunk_kv(meta(), 4)), ("b", chunk_kv(meta(), 40, seed=1))]
    assert tiered.put_many(items) == 2
    assert cpu.contains_many(["a", "b"]) == [True, True]
    assert redis_tier.contains_many(["a", "b"]) == [True, True]
    assert tiered.contains_many(["a", "c"]) == [True, False]
    cpu.discard_many(["a", "b"])
    assert tiered.contains_many(["a", "b"]) == [True, True]


def test_redis_down_serves_cpu_hits_and_reports_unhealthy(redis_process: RedisServer) -> None:
    tiered, cpu, _ = stack(redis_process.url)
    kept = chunk_kv(meta(), 4)
    tiered.put_many([("kept", kept), ("redis-only", chunk_kv(meta(), 4, seed=1))])
    cpu.discard_many(["redis-only"])
    redis_process.kill()
    got = tiered.get_many(["kept", "redis-only"])
    assert torch.equal(got[0], kept) and got[1] is None
    assert tiered.put_many([("new", chunk_kv(meta(), 2))]) == 0  # not durable: counted as a failure
    assert cpu.contains_many(["new"]) == [True]
    assert not tiered.healthy() and tiered.health() == {"cpu": True, "redis": False}
    assert tiered.stats().put_failures == 1


def test_tiered_rejects_bad_stacks() -> None:
    with pytest.raises(ValueError, match="at least one"):
        TieredStore([])
    cpu = CPUStore(CPUStoreConfig(capacity_bytes=10))
    with pytest.raises(ValueError, match="distinct"):
        TieredStore([cpu, CPUStore(CPUStoreConfig(capacity_bytes=10))])


def test_build_kv_store_variants(redis_server: str) -> None:
    cpu_config = CPUStoreConfig(capacity_bytes=1 << 20)
    redis_config = RedisStoreConfig(url=redis_server)
    assert isinstance(build_kv_store(KVTierConfig(cpu=cpu_config), meta()), CPUStore)
    assert isinstance(build_kv_store(KVTierConfig(redis=redis_config), meta()), RedisStore)
    both = build_kv_store(KVTierConfig(cpu=cpu_config, redis=redis_config), meta())
    assert isinstance(both, TieredStore) and [t.name for t in both.tiers] == ["cpu", "redis"]
    with pytest.raises(ValueError, match="names no tier"):
        build_kv_store(KVTierConfig(), meta())
