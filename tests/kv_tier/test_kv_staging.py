"""The staging ring between the device and the CPU tier's pageable memory: copies are bit-exact in both
directions, whatever the value's size against the buffers; the ring allocates its buffers once and reuses
them, so the pinned bytes stay bounded whatever was copied; the tier holds pageable memory by default; and
chunk prefill's hit path goes through the ring (run here on CPU, pinning off, with a counting allocator)."""

from __future__ import annotations

import pytest
import torch

from pdllm.shared.chunk_prefill import chunk_prefill
from pdllm.shared.chunk_store import chunk_keys
from pdllm.shared.kv_tier import staging
from pdllm.shared.kv_tier.cpu_store import CPUStore, CPUStoreConfig
from pdllm.shared.kv_tier.staging import HostStaging, load_into
from pdllm.shared.kv_tier.writer import BackgroundKVWriter, KVWriterConfig
from tests.engine.helpers import model, tokens
from tests.kv_tier.helpers import DTYPES, bitwise_equal, chunk_kv, meta, nbytes


class Counting:
    """An allocator of unpinned buffers that counts what it was asked for."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0

    def __call__(self, nbytes: int) -> torch.Tensor:
        self.calls += 1
        self.bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8)


def ring(buffer_bytes: int = 100, buffers: int = 3) -> tuple[HostStaging, Counting]:
    alloc = Counting()
    return HostStaging(buffer_bytes, buffers, pin=False, alloc=alloc), alloc


def values(dtype: torch.dtype) -> list[torch.Tensor]:
    """Values smaller than one buffer, exactly one, several and a ragged tail, with NaN payloads kept."""
    out = [chunk_kv(meta(dtype, layers=1), tokens, seed=tokens) for tokens in (1, 3, 12, 37)]
    out.append(torch.tensor([float("nan"), -0.0, float("inf")], dtype=dtype))
    out.append(torch.empty((0, 4), dtype=dtype))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_to_host_is_bit_exact_and_reuses_the_ring(dtype: torch.dtype) -> None:
    staging_ring, alloc = ring()
    for value in values(dtype) * 3:
        host = staging_ring.to_host(value)
        assert bitwise_equal(host, value) and (not value.numel() or host.data_ptr() != value.data_ptr())
        assert host.device.type == "cpu" and not host.is_pinned()
    # Every copy went through the same three buffers: none allocated per value.
    assert (alloc.calls, alloc.bytes, staging_ring.allocations) == (3, 300, 3)
    assert staging_ring.pinned_bytes == 300


def test_to_device_is_bit_exact_into_strided_destinations_and_reuses_the_ring() -> None:
    staging_ring, alloc = ring(buffer_bytes=64, buffers=2)
    bank = torch.zeros(2, 2, 5, 2, 40, 8)  # [layers, 2, chunks, heads, tokens, dim], like a ChunkBank
    lens = [40, 3, 17, 1, 29]
    stored = [chunk_kv(meta(), n, seed=i) for i, n in enumerate(lens)]
    for _ in range(4):
        bank.zero_()
        staging_ring.to_device([(bank[:, :, i, :, :n], v) for i, (n, v) in enumerate(zip(lens, stored))])
        for i, (n, v) in enumerate(zip(lens, stored)):
            assert bitwise_equal(bank[:, :, i, :, :n], v)
            assert not bank[:, :, i, :, n:].any()  # nothing written past the chunk
    assert alloc.calls == 2 and staging_ring.pinned_bytes == 128
    with pytest.raises(ValueError, match="one device"):
        staging_ring.to_device(
            [(torch.empty(1), torch.ones(1)), (torch.empty(1, device="meta"), torch.ones(1))]
        )


def test_the_ring_alternates_directions_without_mixing_pieces() -> None:
    staging_ring, alloc = ring(buffer_bytes=48, buffers=2)
    for seed in range(5):
        value = chunk_kv(meta(torch.bfloat16), 7 + seed, seed=seed)
        host = staging_ring.to_host(value)
        back = torch.empty_like(value)
        staging_ring.to_device([(back, host)])
        assert bitwise_equal(back, value)
    assert alloc.calls == 2


def test_bad_ring() -> None:
    with pytest.raises(ValueError, match="buffer_bytes"):
        HostStaging(0, 2, pin=False)
    with pytest.raises(ValueError, match="staging"):
        KVWriterConfig(staging_buffers=0)


def test_the_tier_holds_pageable_memory_by_default_at_any_capacity() -> None:
    assert CPUStoreConfig(capacity_bytes=1 << 40).pin_memory is None
    store = CPUStore(CPUStoreConfig(capacity_bytes=1 << 20))
    value = chunk_kv(meta(), 3)
    store.put_many([("a", value)])
    held = store.get_many(["a"])[0]
    assert bitwise_equal(held, value) and not held.is_pinned()


def test_the_writer_stages_through_a_bounded_ring_made_from_its_config() -> None:
    writer = BackgroundKVWriter(
        CPUStore(CPUStoreConfig(capacity_bytes=1 << 24)),
        KVWriterConfig(pin_memory=False, staging_buffer_bytes=1 << 16, staging_buffers=3),
    )
    ring_ = writer.staging
    assert (ring_.buffer_bytes, ring_.count, ring_.pin, ring_.pinned_bytes) == (1 << 16, 3, False, 0)
    value = chunk_kv(meta(), 5)
    assert writer.put_many([("k", value)]) == 1 and writer.flush(10)
    assert bitwise_equal(writer.get_many(["k"])[0], value)
    writer.close()
    injected, _ = ring()
    assert BackgroundKVWriter(CPUStore(CPUStoreConfig(1 << 20)), staging=injected).staging is injected


def test_load_into_copies_device_and_pinned_values_directly() -> None:
    dest = torch.zeros(2, 3)
    value = torch.arange(6.0).view(2, 3)
    load_into([(dest, value)])  # a CPU destination: a plain copy
    assert torch.equal(dest, value)
    assert not staging.needs_staging(dest, value)


def test_chunk_prefill_hits_go_through_the_ring_bit_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every hit is staged (as pageable values going to a GPU are), through one ring allocated once."""
    m = model("dream")
    c = 12
    chunks = [[1, *tokens(c, 1)], [1, *tokens(5, 2)], [1, *tokens(c, 3)]]
    store = CPUStore(CPUStoreConfig(capacity_bytes=1 << 26))
    cold, cold_stats = chunk_prefill(m, chunks, "causal", c, 8, store)
    assert cold_stats.forwarded == 3
    keys = chunk_keys(m.config.model_id, torch.float32, c, "causal", chunks)
    assert all(v is not None and not v.is_pinned() for v in store.get_many(keys))

    staging_ring, alloc = ring(buffer_bytes=1000, buffers=2)  # smaller than a chunk's KV: several pieces
    staged: list[int] = []
    monkeypatch.setattr(staging, "needs_staging", lambda dest, value: staged.append(nbytes(value)) or True)
    monkeypatch.setattr(staging, "loader", lambda device: staging_ring)
    for _ in range(3):
        warm, warm_stats = chunk_prefill(m, chunks, "causal", c, 8, store)
        assert (warm_stats.forwarded, warm_stats.hit_rows) == (0, [0, 1, 2])
        for i in range(len(chunks)):
            assert bitwise_equal(warm.segment(i), cold.segment(i))
    assert len(staged) == 9 and min(staged) > 1000
    assert alloc.calls == 2 and staging_ring.pinned_bytes == 2000
