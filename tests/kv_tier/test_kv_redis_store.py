"""Redis tier against a real redis-server: round trips, parts, TTL and every bad-value path."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator

import pytest
import redis
import torch

from pdllm.shared.kv_tier.base import KVStore
from pdllm.shared.kv_tier.format import FORMAT_VERSION, KVMeta, header_size
from pdllm.shared.kv_tier.redis_store import MANIFEST_MAGIC, RedisStore, RedisStoreConfig, part_key
from tests.kv_tier.helpers import DTYPES, bitwise_equal, chunk_kv, meta, nbytes

PART = 1000  # tiny parts so a ~2 KB test value spans several


@pytest.fixture
def client(redis_server: str) -> Iterator[redis.Redis]:
    conn = redis.Redis.from_url(redis_server)
    yield conn
    conn.close()


def make_store(url: str, kv_meta: KVMeta | None = None, **overrides: object) -> RedisStore:
    config = RedisStoreConfig(url=url, part_bytes=PART, retry_after_s=0.05, **overrides)  # type: ignore[arg-type]
    return RedisStore(config, kv_meta or meta())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_round_trip_each_dtype_single_and_multi_part(
    redis_server: str, dtype: torch.dtype, tokens: int
) -> None:
    kv_meta = meta(dtype)
    store = make_store(redis_server, kv_meta)
    assert isinstance(store, KVStore)
    tensors = {f"k{i}": chunk_kv(kv_meta, tokens + i, seed=i) for i in range(3)}
    assert store.put_many(list(tensors.items())) == 3
    got = store.get_many(["k0", "missing", "k1", "k2"])
    assert got[1] is None
    for key, tensor in zip(["k0", "k1", "k2"], [got[0], got[2], got[3]]):
        assert tensor is not None and bitwise_equal(tensor, tensors[key])
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.puts, stats.put_failures) == (3, 1, 3, 0)
    assert stats.bytes_read == sum(nbytes(t) for t in tensors.values())
    assert stats.bytes_written == sum(header_size(5) + nbytes(t) for t in tensors.values())
    assert store.contains_many(["k0", "missing"]) == [True, False]
    store.close()


def test_part_boundaries(redis_server: str, client: redis.Redis) -> None:
    kv_meta = meta()
    tensor = chunk_kv(kv_meta, 3)  # 2*2*2*3*8 floats = 1536 bytes + header
    size = header_size(5) + nbytes(tensor)
    for part_bytes, parts in [(size, 0), (size - 1, 2), (size // 3, 4)]:
        store = RedisStore(RedisStoreConfig(url=redis_server, part_bytes=part_bytes), kv_meta)
        key = f"k{part_bytes}"
        store.put_many([(key, tensor)])
        stored_parts = sorted(k.decode() for k in client.keys(f"{key}:part:*"))
        assert stored_parts == sorted(part_key(key, i) for i in range(parts))
        head = client.get(key)
        assert head[:4] == (MANIFEST_MAGIC if parts else b"PDKV")
        assert all(len(client.get(p)) <= part_bytes for p in stored_parts)
        assert torch.equal(store.get_many([key])[0], tensor)


def test_ttl_is_set_on_value_and_parts(redis_server: str, client: redis.Redis) -> None:
    store = make_store(redis_server, ttl_s=120.0)
    store.put_many([("k", chunk_kv(meta(), 40))])
    for name in [b"k", *client.keys("k:part:*")]:
        assert 110_000 < client.pttl(name) <= 120_000
    forever = make_store(redis_server, ttl_s=None)
    forever.put_many([("f", chunk_kv(meta(), 1))])
    assert client.pttl("f") == -1


def _flip(client: redis.Redis, name: str, offset: int) -> None:
    byte = client.getrange(name, offset, offset)
    client.setrange(name, offset, bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("tokens", [1, 40])
def test_flipped_byte_is_a_counted_miss_and_is_deleted(
    redis_server: str, client: redis.Redis, tokens: int, caplog: pytest.LogCaptureFixture
) -> None:
    store = make_store(redis_server)
    store.put_many([("k", chunk_kv(meta(), tokens)), ("ok", chunk_kv(meta(), tokens, seed=1))])
    target = "k" if tokens == 1 else part_key("k", 1)
    _flip(client, target, 300)
    got = store.get_many(["k", "ok"])
    assert got[0] is None and got[1] is not None
    stats = store.stats()
    assert (stats.corrupt, stats.hits, stats.misses) == (1, 1, 1)
    assert client.exists("k") == 0 and not client.keys("k:part:*")  # next prefill rewrites it
    assert store.contains_many(["k"]) == [False]
    assert any(
        "corrupt" in r.getMessage() and "k" in r.getMessage() for r in caplog.records
    )  # not only a counter


@pytest.mark.parametrize("damage", ["truncate", "drop", "extend"])
def test_damaged_part_is_a_miss(redis_server: str, client: redis.Redis, damage: str) -> None:
    store = make_store(redis_server)
    store.put_many([("k", chunk_kv(meta(), 40))])
    name = part_key("k", 0)
    if damage == "truncate":
        client.set(name, client.get(name)[:-1])
    elif damage == "drop":
        client.delete(name)
    else:
        client.append(part_key("k", 2), b"x")
    assert store.get_many(["k"]) == [None]
    assert store.stats().corrupt == 1


def test_a_key_of_another_redis_type_is_repaired_and_the_other_keys_still_hit(
    redis_server: str, client: redis.Redis
) -> None:
    store = make_store(redis_server)
    small, large = chunk_kv(meta(), 3), chunk_kv(meta(), 40, seed=1)  # one value, one split into parts
    store.put_many([("ok", small), ("wrong", small), ("parted", large)])
    client.delete("wrong")
    client.rpush("wrong", b"x")  # WRONGTYPE for GET
    client.delete(part_key("parted", 1))
    client.sadd(part_key("parted", 1), b"y")
    got = store.get_many(["ok", "wrong", "parted"])
    assert bitwise_equal(got[0], small) and got[1:] == [None, None]
    assert store.stats().corrupt == 2 and store.healthy()
    assert client.exists("wrong", part_key("parted", 1)) == 0  # deleted, so the next put rewrites them
    assert store.put_many([("wrong", small)]) == 1 and bitwise_equal(store.get_many(["wrong"])[0], small)


def test_garbage_under_the_key_is_corrupt(redis_server: str, client: redis.Redis) -> None:
    store = make_store(redis_server)
    client.set("k", b"not a chunk")
    client.set("m", MANIFEST_MAGIC + b"short")
    assert store.get_many(["k", "m"]) == [None, None]
    assert store.stats().corrupt == 2


def test_other_format_version_is_a_mismatch_and_left_in_place(redis_server: str, client: redis.Redis) -> None:
    store = make_store(redis_server)
    store.put_many([("k", chunk_kv(meta(), 2))])
    client.setrange("k", 4, struct.pack("<H", FORMAT_VERSION + 1))
    assert store.get_many(["k"]) == [None]
    stats = store.stats()
    assert (stats.mismatched, stats.corrupt) == (1, 0)
    assert client.exists("k") == 1  # may belong to a newer deployment sharing this Redis


def test_other_model_meta_is_a_mismatch(redis_server: str) -> None:
    writer = make_store(redis_server, meta(model_id="model-a"))
    writer.put_many([("k", chunk_kv(meta(model_id="model-a"), 40))])
    for reader_meta in (meta(model_id="model-b"), meta(layers=3), meta(torch.float16)):
        reader = make_store(redis_server, reader_meta)
        assert reader.get_many(["k"]) == [None]
        assert reader.stats().mismatched == 1


def test_put_of_a_wrong_layout_tensor_raises_before_writing(redis_server: str, client: redis.Redis) -> None:
    store = make_store(redis_server)
    with pytest.raises(ValueError, match="shape"):
        store.put_many([("good", chunk_kv(meta(), 2)), ("bad", torch.zeros(2, 2, 2, 2))])
    assert client.dbsize() == 0


def test_small_pipeline_flushes_store_everything(redis_server: str) -> None:
    store = make_store(redis_server, pipeline_bytes=1)
    items = [(f"k{i}", chunk_kv(meta(), 1 + i * 7, seed=i)) for i in range(6)]
    assert store.put_many(items) == 6
    assert all(torch.equal(a, b) for a, (_, b) in zip(store.get_many([k for k, _ in items]), items))


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="redis://"):
        RedisStoreConfig(url="http://127.0.0.1:6379")
    with pytest.raises(ValueError, match="part_bytes"):
        RedisStoreConfig(url="redis://127.0.0.1:1/0", part_bytes=0)
    with pytest.raises(ValueError, match="ttl_s"):
        RedisStoreConfig(url="redis://127.0.0.1:1/0", ttl_s=0)


@pytest.mark.parametrize("offset", [6, 10, 18, 26, 29])  # parts, total, part size, crc (first, last)
def test_flipped_manifest_byte_is_corrupt(redis_server: str, client: redis.Redis, offset: int) -> None:
    store = make_store(redis_server)
    store.put_many([("k", chunk_kv(meta(), 40))])
    _flip(client, "k", offset)
    assert store.get_many(["k"]) == [None]
    assert store.stats().corrupt == 1 and client.exists("k") == 0


def test_manifest_of_another_version_is_a_mismatch(redis_server: str, client: redis.Redis) -> None:
    store = make_store(redis_server)
    store.put_many([("k", chunk_kv(meta(), 40))])
    raw = bytearray(client.get("k"))
    struct.pack_into("<H", raw, 4, 99)
    struct.pack_into("<I", raw, len(raw) - 4, zlib.crc32(raw[:-4]))
    client.set("k", bytes(raw))
    assert store.get_many(["k"]) == [None]
    assert (store.stats().mismatched, store.stats().corrupt) == (1, 0)
