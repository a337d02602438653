"""The device-resident chunk-KV LRU in front of the KV tier (run on the CPU as its device here).

Planted by hand: a read not refreshing the entry's recency -> the eviction test fails; the cache keeping
the writer's tensor instead of a copy -> the copy test fails; puts not passed on to the store below -> the
write-through test fails.
"""

from __future__ import annotations

import pytest
import torch

from pdllm.shared.app.serve import build_parser, start
from pdllm.shared.chunk_prefill import chunk_prefill
from pdllm.shared.kv_tier.cpu_store import CPUStore, CPUStoreConfig
from pdllm.shared.kv_tier.device_cache import DeviceChunkCache
from pdllm.shared.kv_tier.writer import BackgroundKVWriter
from tests.engine.helpers import model, tokens

CPU = torch.device("cpu")


class CountingStore(CPUStore):
    """A host tier that records the keys it was asked for."""

    def __init__(self) -> None:
        super().__init__(CPUStoreConfig(capacity_bytes=1 << 30))
        self.asked: list[str] = []

    def get_many(self, keys):  # type: ignore[no-untyped-def]
        self.asked += list(keys)
        return super().get_many(keys)


def value(n: int, seed: int) -> torch.Tensor:
    return torch.randn(2, 2, 1, n, 4, generator=torch.Generator().manual_seed(seed))


def test_hits_are_served_without_asking_the_store_below_and_puts_go_through() -> None:
    below = CountingStore()
    cache = DeviceChunkCache(below, 1 << 20, CPU)
    a, b = value(5, 1), value(6, 2)
    assert cache.put_many([("a", a), ("b", b)]) == 2
    assert below.contains_many(["a", "b"]) == [True, True]  # write-through
    got = cache.get_many(["a", "b", "c"])
    assert torch.equal(got[0], a) and torch.equal(got[1], b) and got[2] is None
    assert below.asked == ["c"]  # only the miss went down
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.resident_values) == (2, 1, 2)
    assert cache.contains_many(["a", "c"]) == [True, False]


def test_the_least_recently_read_value_is_evicted_first() -> None:
    one = value(8, 0)
    size = one.numel() * one.element_size()
    cache = DeviceChunkCache(CPUStore(CPUStoreConfig(capacity_bytes=1 << 20)), 2 * size, CPU)
    cache.put_many([("a", value(8, 1)), ("b", value(8, 2))])
    cache.get_many(["a"])  # a is now the most recent
    cache.put_many([("c", value(8, 3))])
    mine = cache.lru.contains_many(["a", "b", "c"])
    assert mine == [True, False, True] and cache.stats().evictions == 1


def test_the_cache_keeps_a_copy_and_passes_other_devices_through() -> None:
    source = value(4, 5)
    cache = DeviceChunkCache(CPUStore(CPUStoreConfig(capacity_bytes=1 << 20)), 1 << 20, CPU)
    cache.put_many([("a", source)])
    kept = source.clone()
    source.zero_()  # the writer reuses its buffer
    assert torch.equal(cache.get_many(["a"])[0], kept)
    elsewhere = DeviceChunkCache(
        CPUStore(CPUStoreConfig(capacity_bytes=1 << 20)), 1 << 20, torch.device("meta")
    )
    elsewhere.put_many([("a", kept)])
    assert elsewhere.stats().resident_values == 0 and elsewhere.contains_many(["a"]) == [True]


def test_tiers_list_the_cache_then_the_tiers_and_writer_below() -> None:
    cpu = CPUStore(CPUStoreConfig(capacity_bytes=1 << 20))
    writer = BackgroundKVWriter(cpu)
    try:
        cache = DeviceChunkCache(writer, 1 << 20, CPU)
        assert cache.tiers == [cache, cpu, writer]
    finally:
        writer.close()


def test_a_document_that_comes_back_is_prefilled_from_the_cache() -> None:
    m = model("dream")
    chunks = [[1, *tokens(11, 1)], [1, *tokens(7, 2)]]
    below = CountingStore()
    cache = DeviceChunkCache(below, 1 << 26, CPU)
    first, stats = chunk_prefill(m, chunks, "causal", 12, 4, store=cache)
    assert stats.forwarded == 2
    again, stats = chunk_prefill(m, chunks, "causal", 12, 4, store=cache)
    assert stats.forwarded == 0 and stats.hits == 2 and len(below.asked) == 2  # the first lookup only
    for i, n in enumerate(first.lens):
        assert torch.equal(again.kv[:, :, i, :, :n], first.kv[:, :, i, :, :n])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-gpu-bytes", "auto"], "no 'auto'"),
        (["--kv-gpu-bytes", "lots"], "expected"),
    ],
)
def test_bad_device_cache_sizes_are_refused(flags: list[str], message: str, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--role", "all", "--model", "x", *flags])
    assert message in capsys.readouterr().err


def test_a_device_cache_without_a_cuda_device_is_refused_before_the_model_loads() -> None:
    args = build_parser().parse_args(["--role", "all", "--model", "/nonexistent", "--kv-gpu-bytes", "1G"])
    with pytest.raises(ValueError, match="--kv-gpu-bytes needs a CUDA device"):
        start(args)
