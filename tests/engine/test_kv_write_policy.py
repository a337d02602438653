"""The prefill worker's KV write policy: after selection, each policy writes exactly its chunks, and
repeated questions on one document hit (and skip chunk prefill) accordingly."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
import torch

from pdllm.prefill_service.worker import PrefillWorker
from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.chunk_prefill import chunk_prefill
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.kv_tier.cpu_store import CPUStore, CPUStoreConfig
from pdllm.shared.kv_write_policy import (
    DEFAULT_KV_WRITE_POLICY,
    KV_WRITE_POLICIES,
    check_kv_write_policy,
    chunks_to_write,
)
from tests.engine.helpers import model, tokens

C = 12
GEN = GenerationConfig(gen_length=6, steps=3)
CONFIG = EngineConfig(chunk_size=C, top_k=2)
DOC = tokens(5 * C, 1)  # 5 chunks of 12 tokens (+ BOS each)
QUESTIONS = [tokens(5, seed) for seed in (2, 3, 4)]


class RecordingStore(CPUStore):
    """An in-process tier that records every key written, in order."""

    def __init__(self) -> None:
        super().__init__(CPUStoreConfig(capacity_bytes=1 << 26, pin_memory=False))
        self.written: list[str] = []

    def put_many(self, items: Sequence[tuple[str, torch.Tensor]]) -> int:
        self.written.extend(key for key, _ in items)
        return super().put_many(items)


def test_the_rule() -> None:
    computed, selected = [0, 2, 3, 4], [1, 3]
    assert chunks_to_write("all", computed, selected, any_hit=False) == [0, 2, 3, 4]
    assert chunks_to_write("selected", computed, selected, any_hit=True) == [3]  # chunk 1 hit: stored
    assert chunks_to_write("second-sight", computed, selected, any_hit=False) == [3]
    assert chunks_to_write("second-sight", computed, selected, any_hit=True) == [0, 2, 3, 4]
    assert DEFAULT_KV_WRITE_POLICY == "second-sight" and check_kv_write_policy("all") == "all"
    with pytest.raises(ValueError, match="all, selected, second-sight"):
        check_kv_write_policy("some")
    with pytest.raises(ValueError, match="kv write policy"):
        PrefillWorker(model("dream"), None, CONFIG, kv_write_policy="some")  # type: ignore[arg-type]


# Requests on the document that skip chunk prefill (all chunks hit), per policy: "selected" never gets
# the unselected chunks stored; "second-sight" stores the whole document on its second request.
SKIPS = {"all": [False, True, True], "selected": [False, False, False], "second-sight": [False, False, True]}


@pytest.mark.parametrize("policy", KV_WRITE_POLICIES)
def test_each_policy_writes_exactly_its_chunks_and_repeats_hit_them(policy: str) -> None:
    store = RecordingStore()
    worker = PrefillWorker(
        model("dream"), None, CONFIG, store=store, kv_write_policy=check_kv_write_policy(policy)
    )
    stored: set[int] = set()
    skips = []
    for q in QUESTIONS:
        before = len(store.written)
        sel = worker.prefill(DOC, q, GEN)
        n = sel.request.num_chunks
        assert n == 5
        assert sel.trace.cache_hits == len(stored)  # it finds exactly what the earlier requests wrote
        computed = set(range(n)) - stored
        if policy == "all" or (policy == "second-sight" and stored):
            expected = computed
        else:
            expected = computed & set(sel.selected)
        first = [i for i in sorted(expected) if i in sel.selected]  # queued first: decode reads them next
        assert store.written[before:] == [sel.keys[i] for i in first + sorted(expected - set(first))]
        assert sel.trace.chunks_written == len(expected)
        assert set(sel.selected) <= stored | expected  # a chunk-only decode worker finds the top-K
        stored |= expected
        skips.append(sel.trace.prefill_skipped)
    assert skips == SKIPS[policy]
    assert len(store.written) == len(set(store.written))  # nothing written twice


def test_a_batch_writes_each_shared_chunk_once_under_its_own_key() -> None:
    m = model("dream")
    store = RecordingStore()
    worker = PrefillWorker(m, None, CONFIG, store=store, kv_write_policy="all")
    doc_b = DOC[: 2 * C] + tokens(2 * C, 7)  # shares its first two chunks with DOC
    a, b = worker.prefill_many([worker.job(DOC, QUESTIONS[0], GEN), worker.job(doc_b, QUESTIONS[1], GEN)])
    assert not isinstance(a, Exception) and not isinstance(b, Exception)
    unique = dict.fromkeys([*a.keys, *b.keys])
    assert sorted(store.written) == sorted(unique) and len(unique) == 7
    assert (a.trace.chunks_written, b.trace.chunks_written) == (5, 2)
    # b's chunks sit in rows 0, 1, 5, 6 of the shared bank: each value is stored under its own key.
    for sel in (a, b):
        alone, _ = chunk_prefill(m, sel.request.chunks, "causal", C, CONFIG.prefill_batch)
        for i, key in enumerate(sel.keys):
            torch.testing.assert_close(store.get_many([key])[0], alone.segment(i), rtol=0, atol=1e-6)


def test_second_sight_in_a_batch_and_the_kept_bank() -> None:
    store = RecordingStore()
    worker = PrefillWorker(model("dream"), None, CONFIG, store=store)  # the default: second-sight
    first = worker.prefill(DOC, QUESTIONS[0], GEN)
    assert store.written == [first.keys[i] for i in first.selected] and first.bank is not None
    job = dataclasses.replace(worker.job(DOC, QUESTIONS[1], GEN), keep_bank=False)
    again, cold = worker.prefill_many([job, worker.job(tokens(3 * C, 9), QUESTIONS[1], GEN)])
    assert not isinstance(again, Exception) and not isinstance(cold, Exception)
    assert again.bank is None  # a server's selection lets its chunk KV go once written
    assert again.trace.chunks_written == 3 and sorted(store.written[2:5]) == sorted(
        k for i, k in enumerate(again.keys) if i not in first.selected
    )
    assert store.written[5:] == [cold.keys[i] for i in cold.selected]  # its batch-mate: seen once


def test_the_engine_passes_its_policy_and_defaults_to_second_sight() -> None:
    m = model("dream")
    assert PrefillingEngine(m, None, CONFIG).prefill_worker.kv_write_policy == "second-sight"
    store = RecordingStore()
    engine = PrefillingEngine(m, None, CONFIG, store=store, kv_write_policy="all")
    _, trace = engine.generate(DOC, QUESTIONS[0], GEN)
    assert trace.chunks_written == len(store.written) == 5


def test_serve_flag_and_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdllm.shared.app.serve_args import build_parser

    assert build_parser().parse_args([]).kv_write_policy == "second-sight"
    assert build_parser().parse_args(["--kv-write-policy", "all"]).kv_write_policy == "all"
    monkeypatch.setenv("PDLLM_KV_WRITE_POLICY", "selected")
    assert build_parser().parse_args([]).kv_write_policy == "selected"
    monkeypatch.setenv("PDLLM_KV_WRITE_POLICY", "some")
    with pytest.raises(ValueError, match="PDLLM_KV_WRITE_POLICY"):
        build_parser()
