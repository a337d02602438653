"""Cross-request chunk reuse: a question on a document whose chunks are all stored skips step 3 entirely."""

from __future__ import annotations

import torch

from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.chunk_prefill import chunk_prefill
from pdllm.shared.chunk_store import chunk_keys, default_chunk_store
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.sampler import GenerationConfig
from tests.engine.helpers import model, tokens

C = 12
GEN = GenerationConfig(gen_length=6, steps=3)


def test_a_returning_document_is_stored_whole_then_skips_prefill_and_matches_a_cold_run() -> None:
    m = model("dream")
    store = default_chunk_store()
    context = tokens(40, 1)
    engine = PrefillingEngine(m, None, EngineConfig(chunk_size=C, top_k=2), store=store)  # second-sight
    _, first = engine.generate(context, tokens(5, 2), GEN)
    assert (first.cache_hits, first.cache_misses, first.prefill_skipped) == (0, 4, False)
    st = store.stats()
    assert (st.hits, st.misses, st.puts) == (0, 4, 2)  # a document seen once: its top-2 only
    _, second = engine.generate(context, tokens(5, 4), GEN)
    assert (second.cache_hits, second.cache_misses, second.prefill_skipped) == (2, 2, False)
    assert store.stats().puts == 4  # it came back: the chunks it computed are written too
    question = tokens(5, 3)
    warm, third = engine.generate(context, question, GEN)
    assert (third.cache_hits, third.cache_misses, third.prefill_skipped) == (4, 0, True)
    assert store.stats().puts == 4 and third.chunks_written == 0
    cold, cold_trace = PrefillingEngine(
        m, None, EngineConfig(chunk_size=C, top_k=2), reuse_chunks=False
    ).generate(context, question, GEN)
    assert warm.raw_tokens == cold.raw_tokens
    assert [s["total"] for s in third.chunk_scores] == [s["total"] for s in cold_trace.chunk_scores]


def test_shared_chunks_are_reused_across_documents() -> None:
    m = model("llada")
    store = default_chunk_store()
    engine = PrefillingEngine(
        m, None, EngineConfig(chunk_size=C, top_k=1), store=store, kv_write_policy="all"
    )
    base = tokens(3 * C, 5)
    engine.prefill(base, tokens(4, 6), GEN)
    _, edited = engine.generate(base[: 2 * C] + tokens(C, 7), tokens(4, 6), GEN)
    assert (edited.cache_hits, edited.cache_misses, edited.prefill_skipped) == (2, 1, False)


def test_keys_separate_attention_schemes_and_chunk_sizes() -> None:
    chunk = [[1, 5, 6, 7]]
    a = chunk_keys("m", torch.float32, 12, "causal", chunk)
    assert a == chunk_keys("m", torch.float32, 12, "causal", chunk)
    assert a != chunk_keys("m", torch.float32, 12, "bidirectional", chunk)
    assert a != chunk_keys("m", torch.float32, 16, "causal", chunk)
    assert a != chunk_keys("m", torch.bfloat16, 12, "causal", chunk)
    assert a != chunk_keys("m", torch.float32, 12, "causal", [[1, 5, 6, 8]])


def test_stored_kv_is_the_chunk_layout_and_lru_evicts_by_bytes() -> None:
    m = model("dream")
    chunks = [[1, *tokens(C, 1)], [1, *tokens(5, 2)]]
    store = default_chunk_store()
    bank, stats = chunk_prefill(m, chunks, "causal", C, 8, store)
    assert stats.forwarded == 2
    keys = chunk_keys(m.config.model_id, torch.float32, C, "causal", chunks)
    stored = store.get_many(keys)
    cfg = m.config
    assert stored[1].shape == (cfg.num_layers, 2, cfg.num_kv_heads, 6, cfg.head_dim)
    torch.testing.assert_close(stored[0], bank.segment(0), rtol=0, atol=0)
    one = stored[0].numel() * stored[0].element_size()
    small = default_chunk_store(capacity_bytes=one + 1)
    assert small.put_many([(keys[0], stored[0]), (keys[1], stored[1])]) == 2
    assert small.get_many(keys)[0] is None and small.get_many(keys)[1] is not None
