"""Redis tier faults: server killed mid-use, unreachable, out of memory; metrics export."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from pdllm.shared.kv_tier.redis_store import RedisStore, RedisStoreConfig
from pdllm.shared.kv_tier.stats import register_kv_metrics
from tests.fixtures.redis_server import RedisServer, RedisServerConfig, free_loopback_port
from tests.kv_tier.helpers import chunk_kv, meta

RETRY_S = 0.2


def make_store(url: str) -> RedisStore:
    config = RedisStoreConfig(url=url, part_bytes=1000, retry_after_s=RETRY_S, connect_timeout_s=0.5)
    return RedisStore(config, meta())


def test_killed_redis_gives_misses_then_recovers(redis_process: RedisServer) -> None:
    store = make_store(redis_process.url)
    items = [(f"k{i}", chunk_kv(meta(), 1 + 20 * i, seed=i)) for i in range(3)]
    assert store.put_many(items) == 3 and store.healthy()
    redis_process.kill()

    start = time.monotonic()
    assert store.get_many(["k0", "k1", "k2"]) == [None, None, None]
    assert store.put_many(items) == 0
    assert store.contains_many(["k0"]) == [False]
    with pytest.raises(ValueError, match="shape"):  # caller bugs still surface while Redis is down
        store.put_many([("bad", torch.zeros(3))])
    assert not store.healthy()
    assert time.monotonic() - start < 2.0  # refused connections fail fast, no retry storm
    stats = store.stats()
    assert stats.errors >= 1 and stats.misses == 3 and stats.put_failures == 3

    # While marked down, calls answer at once without touching the socket.
    errors_before = store.stats().errors
    store.get_many(["k0"])
    assert store.stats().errors == errors_before

    redis_process.restart()
    time.sleep(RETRY_S)
    assert store.healthy()
    assert store.get_many(["k0"]) == [None]  # restarted without persistence: a miss, never stale data
    assert store.put_many(items) == 3
    got = store.get_many(["k0", "k1", "k2"])
    assert all(g is not None and torch.equal(g, t) for g, (_, t) in zip(got, items))


def test_unreachable_from_the_start() -> None:
    store = make_store(f"redis://127.0.0.1:{free_loopback_port()}/0")
    assert store.get_many(["a", "b"]) == [None, None]
    assert store.put_many([("a", chunk_kv(meta(), 2))]) == 0
    assert not store.healthy() and not store.ping()
    assert store.stats().errors >= 1


def test_kill_during_concurrent_reads_never_raises_or_lies(redis_process: RedisServer) -> None:
    store = make_store(redis_process.url)
    items = [(f"k{i}", chunk_kv(meta(), 30, seed=i)) for i in range(8)]
    store.put_many(items)
    expected = dict(items)
    failures: list[str] = []
    answered = [0, 0]  # hits, misses
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            try:
                got = store.get_many(list(expected))
            except Exception as exc:  # noqa: BLE001 - the point is that nothing escapes
                failures.append(repr(exc))
                return
            for key, tensor in zip(expected, got):
                if tensor is None:
                    answered[1] += 1
                elif not torch.equal(tensor, expected[key]):
                    failures.append(f"wrong tensor for {key}")
                else:
                    answered[0] += 1

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(0.2)
    redis_process.kill()
    time.sleep(0.3)
    redis_process.restart()
    store.put_many(items)
    time.sleep(RETRY_S + 0.2)
    stop.set()
    for thread in threads:
        thread.join(timeout=10)
    assert not failures
    assert answered[0] > 0 and answered[1] > 0
    assert store.healthy()


def test_redis_evicting_parts_under_memory_pressure_gives_misses_not_wrong_values() -> None:
    with RedisServer(RedisServerConfig(max_memory="3mb")) as server:
        config = RedisStoreConfig(url=server.url, part_bytes=4096, retry_after_s=RETRY_S)
        store = RedisStore(config, meta())
        items = [(f"k{i}", chunk_kv(meta(), 32, seed=i)) for i in range(300)]  # 2 parts each, ~2.5 MB
        for start in range(0, len(items), 10):
            store.put_many(items[start : start + 10])
        got = store.get_many([k for k, _ in items])
        hits = [(g, t) for g, (_, t) in zip(got, items) if g is not None]
        assert all(torch.equal(g, t) for g, t in hits)
        assert 0 < len(hits) < len(items)
        assert store.stats().corrupt > 0  # values that lost a part were detected, not assembled
        assert store.healthy()


def test_prometheus_export_matches_stats(redis_server: str) -> None:
    store = make_store(redis_server)
    store.put_many([("a", chunk_kv(meta(), 3))])
    store.get_many(["a", "b"])
    registry = CollectorRegistry()
    register_kv_metrics({"redis": store}, registry)
    assert registry.get_sample_value("pdllm_kv_hits_total", {"tier": "redis"}) == 1
    assert registry.get_sample_value("pdllm_kv_misses_total", {"tier": "redis"}) == 1
    assert (
        registry.get_sample_value("pdllm_kv_bytes_written_total", {"tier": "redis"})
        == store.stats().bytes_written
    )
    assert registry.get_sample_value("pdllm_kv_healthy", {"tier": "redis"}) == 1
    assert b'pdllm_kv_corrupt_total{tier="redis"} 0.0' in generate_latest(registry)
    with pytest.raises(ValueError, match="Duplicated"):
        register_kv_metrics({"redis": store}, registry)


def test_redis_refusing_every_put_is_unhealthy_until_a_put_succeeds() -> None:
    import redis

    with RedisServer(RedisServerConfig(max_memory="2mb")) as server:
        client = redis.Redis.from_url(server.url)
        client.config_set("maxmemory-policy", "noeviction")  # full: writes fail with OOM, nothing evicted
        store = RedisStore(RedisStoreConfig(url=server.url, part_bytes=4096, retry_after_s=RETRY_S), meta())
        refused = False
        for start in range(0, 2000, 10):
            items = [(f"k{i}", chunk_kv(meta(), 32, seed=i)) for i in range(start, start + 10)]
            if store.put_many(items) == 0:
                refused = True
                break
        assert refused and store.stats().errors == 0  # reachable, just refusing
        assert not store.healthy()
        assert store.get_many(["k0"])[0] is not None  # reads still answer
        client.config_set("maxmemory", "0")  # room again
        assert store.put_many([("again", chunk_kv(meta(), 3))]) == 1
        assert store.healthy()
        client.close()
