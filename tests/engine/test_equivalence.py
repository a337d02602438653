"""Fast path == reference path: same chunk scores (1e-5), same selection, same kept tokens, same tokens."""

from __future__ import annotations

import pytest
import torch

from pdllm.prefill_service.scoring import score_chunks
from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.chunk_prefill import chunk_prefill
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.layout import decode_layout, make_request
from pdllm.shared.reference import reference_generate, reference_scores
from tests.engine.helpers import model, tokens

C = 12
CONTEXT = 50  # not a multiple of C: 5 chunks, the last one 2 tokens + BOS
GEN = GenerationConfig(gen_length=8, steps=4)

# (family, kv_mode, top_b, top_k, decode attention, extra config, instruction?, context length)
CASES = [
    ("dream", "full-mask", None, 2, "torch", {}, True, CONTEXT),
    ("llada", "full-mask", None, 2, "torch", {}, False, CONTEXT),
    ("dream", "full-mask", 5, 1, "torch", {}, False, CONTEXT),
    ("llada", "full-mask", 5, 5, "torch", {"retention_score": "query-to-chunk"}, True, CONTEXT),
    ("dream", "chunk-query", None, 5, "torch", {}, True, CONTEXT),
    ("llada", "chunk-query", 4, 2, "torch", {}, False, CONTEXT),
    ("dream", "chunk-only", None, 2, "torch", {}, True, CONTEXT),
    ("llada", "chunk-only", 5, 2, "torch", {}, True, CONTEXT),
    ("dream", "chunk-only", 5, 5, "torch", {"prefill_attention": "bidirectional"}, False, CONTEXT),
    ("llada", "chunk-only", None, 1, "torch", {"prefill_attention": "bidirectional"}, True, CONTEXT),
    ("dream", "full-mask", None, 2, "torch", {"score_mode": "self-info"}, False, CONTEXT),
    ("llada", "full-mask", 6, 2, "torch", {"score_mode": "query-only", "query_window": 3}, True, CONTEXT),
    ("dream", "full-mask", None, 4, "torch", {"prefill_batch": 2}, False, 7),  # context < one chunk
    ("llada", "chunk-only", 3, 4, "torch", {}, False, 7),
]


def _run(case: tuple, gen: GenerationConfig = GEN) -> None:
    family, kv_mode, top_b, top_k, attn, extra, with_instruction, n_ctx = case
    m = model(family)
    context, question = tokens(n_ctx, 1), tokens(6, 2)
    instruction = [5, 7, 9] if with_instruction else None
    cfg = EngineConfig(chunk_size=C, top_k=top_k, top_b=top_b, kv_mode=kv_mode, **extra)
    ref = reference_generate(m, make_request(context, question, 1, cfg, 97, instruction), cfg, gen)
    engine = PrefillingEngine(m, None, cfg, decode_attention=attn)
    sel = engine.prefill(context, question, gen, instruction)
    result = engine.decode(sel, gen)
    for fast, slow in zip(sel.scores, ref.scores, strict=True):
        assert fast.labels == slow.labels
        assert fast.s_i == pytest.approx(slow.s_i, abs=1e-5)
        assert (fast.s_p is None) == (slow.s_p is None)
        if fast.s_p is not None:
            assert fast.s_p == pytest.approx(slow.s_p, abs=1e-5)
    assert sel.selected == ref.selected
    assert len(ref.selected) == min(top_k, -(-n_ctx // C))
    assert sel.trace.kept_tokens == [int(k.numel()) for k in ref.kept]  # what the build kept
    assert result.raw_tokens == ref.result.raw_tokens
    assert result.steps == ref.result.steps


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-b{c[2]}-k{c[3]}-{c[4]}-n{c[7]}")
def test_fast_path_matches_reference(case: tuple) -> None:
    _run(case)


def test_threshold_decoding_and_blocks_match() -> None:
    _run(CASES[0], GenerationConfig(gen_length=8, steps=8, block_length=4, threshold=0.2))
    _run(CASES[7], GenerationConfig(gen_length=8, steps=4, block_length=4))


def test_kept_token_sets_match_reference() -> None:
    """Not only how many: exactly which chunk tokens top-B keeps, BOS always among them."""
    m = model("dream")
    context, question = tokens(CONTEXT, 1), tokens(6, 2)
    for kv_mode in ("full-mask", "chunk-only"):
        cfg = EngineConfig(chunk_size=C, top_k=3, top_b=5, kv_mode=kv_mode)
        ref = reference_generate(m, make_request(context, question, 1, cfg, 97), cfg, GEN)
        engine = PrefillingEngine(m, None, cfg)
        sel = engine.prefill(context, question, GEN)
        static = engine.build(sel, GEN)
        assert static.contiguous is None  # tokens were dropped: no full contiguous copy
        chunk_lens = decode_layout(sel.request, sel.selected, GEN.gen_length).chunk_lens
        assert any(k.numel() < n for k, n in zip(ref.kept, chunk_lens, strict=True))
        for seg, keep in zip(static.segments, ref.kept, strict=True):
            assert int(keep[0]) == 0 and seg.shape[3] == keep.numel()
        # The kept K/V are the build's K/V at the reference's kept indices.
        full_cfg = EngineConfig(chunk_size=C, top_k=3, kv_mode=kv_mode)
        full_engine = PrefillingEngine(m, None, full_cfg)
        full = full_engine.build(full_engine.prefill(context, question, GEN), GEN)
        for seg, full_seg, keep in zip(static.segments, full.segments, ref.kept, strict=True):
            torch.testing.assert_close(seg, full_seg[:, :, :, keep], rtol=0, atol=1e-6)


def test_batched_scoring_independent_of_batch_size() -> None:
    m = model("llada")
    cfg = EngineConfig(chunk_size=C, top_k=2)
    request = make_request(tokens(CONTEXT, 3), tokens(5, 4), 1, cfg, 97)
    ref = reference_scores(m, request, cfg)
    for batch in (1, 2, 64):
        bank, _ = chunk_prefill(m, request.chunks, "causal", C, batch)
        fast = score_chunks(m, request, EngineConfig(chunk_size=C, top_k=2, prefill_batch=batch), bank)
        assert [s.total for s in fast] == pytest.approx([s.total for s in ref], abs=1e-5)
