"""In-process CPU LRU: exact round trips, eviction by bytes in LRU order, stats, thread safety."""

from __future__ import annotations

import threading

import pytest
import torch

from pdllm.shared.kv_tier.base import KVStore
from pdllm.shared.kv_tier.cpu_store import CPUStore, CPUStoreConfig
from tests.kv_tier.helpers import DTYPES, bitwise_equal, chunk_kv, meta, nbytes


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_and_copy_on_put(dtype: torch.dtype) -> None:
    store = CPUStore(CPUStoreConfig(capacity_bytes=1 << 20))
    assert isinstance(store, KVStore)
    tensor = chunk_kv(meta(dtype), 5)
    original = tensor.clone()
    assert store.put_many([("a", tensor)]) == 1
    tensor.add_(1)  # the caller reusing its buffer must not change what is stored
    got, missing = store.get_many(["a", "b"])
    assert missing is None and got is not None and bitwise_equal(got, original)
    assert store.contains_many(["a", "b"]) == [True, False]


def test_adopting_without_copy_shares_the_tensor() -> None:
    store = CPUStore(CPUStoreConfig(capacity_bytes=1 << 20, copy_on_put=False, pin_memory=False))
    tensor = chunk_kv(meta(), 3)
    store.put_many([("a", tensor)])
    assert store.get_many(["a"])[0].data_ptr() == tensor.data_ptr()


def test_eviction_by_bytes_in_lru_order() -> None:
    kv_meta = meta()
    values = {name: chunk_kv(kv_meta, 4, seed=i) for i, name in enumerate("abcde")}
    size = nbytes(values["a"])
    store = CPUStore(CPUStoreConfig(capacity_bytes=3 * size + size // 2))
    store.put_many([(k, values[k]) for k in "abc"])
    store.get_many(["a"])  # a becomes most recent: b is now the oldest
    store.put_many([("d", values["d"])])
    assert store.contains_many(list("abcd")) == [True, False, True, True]
    store.put_many([("e", values["e"])])  # evicts c
    assert store.contains_many(list("abcde")) == [True, False, False, True, True]
    stats = store.stats()
    assert (stats.evictions, stats.resident_values, stats.resident_bytes) == (2, 3, 3 * size)
    for key in "ade":
        assert torch.equal(store.get_many([key])[0], values[key])


def test_a_large_value_evicts_several_small_ones_and_too_large_is_rejected() -> None:
    kv_meta = meta()
    small = [chunk_kv(kv_meta, 2, seed=i) for i in range(4)]
    big = chunk_kv(kv_meta, 6)
    store = CPUStore(CPUStoreConfig(capacity_bytes=nbytes(big) + nbytes(small[0])))
    store.put_many([(f"s{i}", t) for i, t in enumerate(small)])
    store.put_many([("big", big)])
    assert store.contains_many(["s0", "s1", "s2", "s3", "big"]) == [False, False, False, True, True]
    huge = chunk_kv(kv_meta, 16)
    assert store.put_many([("huge", huge)]) == 0
    stats = store.stats()
    assert stats.put_failures == 1 and stats.resident_bytes == nbytes(big) + nbytes(small[0])


def test_replacing_a_key_accounts_bytes_once() -> None:
    kv_meta = meta()
    store = CPUStore(CPUStoreConfig(capacity_bytes=1 << 20))
    store.put_many([("a", chunk_kv(kv_meta, 4))])
    replacement = chunk_kv(kv_meta, 8, seed=1)
    store.put_many([("a", replacement)])
    assert store.stats().resident_bytes == nbytes(replacement)
    assert torch.equal(store.get_many(["a"])[0], replacement)
    store.discard_many(["a", "never-stored"])
    assert store.stats().resident_bytes == 0 and store.get_many(["a"]) == [None]


def test_stats_count_hits_misses_and_bytes() -> None:
    kv_meta = meta(torch.bfloat16)
    tensor = chunk_kv(kv_meta, 3)
    store = CPUStore(CPUStoreConfig(capacity_bytes=1 << 20))
    store.put_many([("a", tensor)])
    store.get_many(["a", "a", "x"])
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.puts) == (2, 1, 1)
    assert (stats.bytes_read, stats.bytes_written) == (2 * nbytes(tensor), nbytes(tensor))


def test_bad_config() -> None:
    with pytest.raises(ValueError, match="capacity_bytes"):
        CPUStoreConfig(capacity_bytes=0)


def test_pinned_memory_where_cuda_exists_and_a_clear_error_elsewhere() -> None:
    config = CPUStoreConfig(capacity_bytes=1 << 20, pin_memory=True)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            CPUStore(config)
        return
    store = CPUStore(config)
    store.put_many([("a", chunk_kv(meta(), 2))])
    assert store.get_many(["a"])[0].is_pinned()


def test_concurrent_use_keeps_the_invariants() -> None:
    kv_meta = meta()
    values = {f"k{i}": chunk_kv(kv_meta, 1 + i % 5, seed=i) for i in range(40)}
    capacity = sum(nbytes(t) for t in values.values()) // 3
    store = CPUStore(CPUStoreConfig(capacity_bytes=capacity))
    wrong: list[str] = []

    def worker(offset: int) -> None:
        keys = list(values)
        for step in range(300):
            key = keys[(offset * 7 + step) % len(keys)]
            if step % 3 == 0:
                store.put_many([(key, values[key])])
            else:
                got = store.get_many([key])[0]
                if got is not None and not torch.equal(got, values[key]):
                    wrong.append(key)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong
    stats = store.stats()
    present = [k for k, hit in zip(values, store.contains_many(list(values))) if hit]
    assert stats.resident_bytes == sum(nbytes(values[k]) for k in present) <= capacity
    assert stats.resident_values == len(present)
    assert stats.hits + stats.misses == 4 * 200
