"""Hits land in their own rows: a request whose chunks are a mix of two cached documents' chunks (in another
order than they were first served, one of them the short last chunk) and new chunks gets, in every bank row
that scoring and the decode-KV build read, exactly the KV an uncached prefill computes (fp32 CPU, tiny
model). Document A's chunks come from the device cache, document B's from the host tier below it (written
there by another worker), the new chunks are forwarded.

Planted by hand:
- ``chunk_prefill_steps`` landing the n-th hit in bank row n instead of its own row
  (``bank.kv[:, :, len(hits), ...]``) -> both tests fail (a document served whole, all hits in order,
  does not notice);
- two hits' destinations swapped before ``load_into`` -> both tests fail;
- the landing slice one token late (``bank.kv[:, :, i, :, 1 : bank.lens[i] + 1]``) -> both tests fail
  (the bank test on the shape, the engine test, whose rows have scoring slots after them, on the KV);
- ``DeviceChunkCache.get_many`` putting the host tier's answers back at the wrong lookups
  (``zip(wanted[::-1], ...)``) -> both tests fail;
- ``HostStaging.to_device`` copying the first two staged values into each other's destinations ->
  the ``staged`` bank test fails.
"""

from __future__ import annotations

import pytest
import torch

from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.chunk_prefill import chunk_prefill
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.kv_tier import staging
from pdllm.shared.kv_tier.cpu_store import CPUStore, CPUStoreConfig
from pdllm.shared.kv_tier.device_cache import DeviceChunkCache
from pdllm.shared.kv_tier.staging import HostStaging
from tests.engine.helpers import model, tokens

C = 12
GEN = GenerationConfig(gen_length=6, steps=3)
CPU = torch.device("cpu")

A = [tokens(C, 10), tokens(C, 11), tokens(C, 12), tokens(5, 13)]  # its last chunk is short
B = [tokens(C, 20), tokens(C, 21), tokens(C, 22)]
NEW = [tokens(C, 30), tokens(C, 31)]
MIXED = [B[2], NEW[0], A[1], B[0], NEW[1], A[3]]  # the short chunk stays last: fixed boundaries
HIT_ROWS = [0, 2, 3, 5]


def bos(bodies: list[list[int]]) -> list[list[int]]:
    return [[1, *b] for b in bodies]


class AskedStore(CPUStore):
    """The host tier, recording the keys it was asked for."""

    def __init__(self) -> None:
        super().__init__(CPUStoreConfig(capacity_bytes=1 << 26))
        self.asked: list[str] = []

    def get_many(self, keys):  # type: ignore[no-untyped-def]
        self.asked += list(keys)
        return super().get_many(keys)


def stack() -> tuple[DeviceChunkCache, AskedStore]:
    below = AskedStore()
    return DeviceChunkCache(below, 1 << 26, CPU), below


@pytest.mark.parametrize("path", ["direct", "staged"])
def test_mixed_hits_from_two_documents_land_in_their_own_bank_rows(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``staged``: every hit goes through the pinned-ring copy that host hits take to a GPU."""
    m = model("dream")
    cache, below = stack()
    chunk_prefill(m, bos(A), "causal", C, 4, store=cache)  # A: in the device cache (and below)
    chunk_prefill(m, bos(B), "causal", C, 4, store=below)  # B: in the host tier only
    below.asked.clear()
    if path == "staged":
        monkeypatch.setattr(staging, "needs_staging", lambda dest, value: True)
        ring = HostStaging(1000, 2, pin=False)  # smaller than a chunk's KV: several pieces each
        monkeypatch.setattr(staging, "loader", lambda device: ring)

    warm, stats = chunk_prefill(m, bos(MIXED), "causal", C, 4, store=cache)
    assert (stats.hit_rows, stats.forwarded) == (HIT_ROWS, 2)
    assert len(below.asked) == 4  # A's two chunks came from the device cache, the rest was asked below
    cold, _ = chunk_prefill(m, bos(MIXED), "causal", C, 4)  # no store: the reference
    for i, n in enumerate(warm.lens):
        assert torch.equal(warm.segment(i), cold.segment(i)), f"row {i}: not its chunk's KV"
        if i in HIT_ROWS:
            assert not warm.kv[:, :, i, :, n:].any(), f"row {i}: a hit wrote past its chunk"


def test_a_request_mixing_cached_and_new_chunks_scores_and_answers_as_uncached() -> None:
    """The all-in-one engine (chunk-only: the decode KV is built from the bank rows scoring read)."""
    m = model("dream")
    config = EngineConfig(chunk_size=C, top_k=3, kv_mode="chunk-only")
    cache, below = stack()
    question = tokens(5, 40)
    PrefillingEngine(m, None, config, store=cache, kv_write_policy="all").generate(sum(A, []), question, GEN)
    PrefillingEngine(m, None, config, store=below, kv_write_policy="all").generate(sum(B, []), question, GEN)

    engine = PrefillingEngine(m, None, config, store=cache, kv_write_policy="all")
    sel = engine.prefill(sum(MIXED, []), question, GEN)
    assert sel.request.chunks == bos(MIXED)
    assert (sel.trace.cache_hits, sel.trace.cache_misses) == (4, 2)
    cold_kv, _ = chunk_prefill(m, bos(MIXED), "causal", C, 4)
    for i in range(len(MIXED)):
        assert torch.equal(sel.bank.segment(i), cold_kv.segment(i)), f"row {i}: not its chunk's KV"

    result = engine.decode(sel, GEN)
    cold, cold_trace = PrefillingEngine(m, None, config, reuse_chunks=False).generate(
        sum(MIXED, []), question, GEN
    )
    assert [s["total"] for s in sel.trace.chunk_scores] == [s["total"] for s in cold_trace.chunk_scores]
    assert sel.trace.selected == cold_trace.selected
    assert result.raw_tokens == cold.raw_tokens
