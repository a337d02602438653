"""Decode-side pieces: segmented attention, RoPE re-rotation, the reference loop's static-KV policies, the
trace."""

from __future__ import annotations

import json

import pytest
import torch

from pdllm.decode_service.attention import SegmentedAttention
from pdllm.decode_service.build import rotate_keys
from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.chunk_prefill import chunk_prefill
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.model.attention import PrefixAttention
from pdllm.shared.static_kv import StaticKV
from tests.engine.helpers import model, tokens
from tests.reference.static_attention import BufferedAttention
from tests.reference.static_kv import StaticPolicy, decode

GEN = GenerationConfig(gen_length=6, steps=3)


def _segments(lens: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, 2, n, 16, generator=gen) for n in lens]


def test_segmented_and_buffered_attention_equal_concatenated_prefix() -> None:
    segs = _segments([5, 0, 9, 3], 0)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(1, 4, 7, 16, generator=gen),
        torch.randn(1, 2, 7, 16, generator=gen),
        torch.randn(1, 2, 7, 16, generator=gen),
    )
    cat = torch.cat(segs, dim=3)
    reference = PrefixAttention([(cat[layer, 0][None], cat[layer, 1][None]) for layer in range(2)])
    buffered = BufferedAttention(cat, local=7)
    for layer in range(2):
        want = reference(layer, q, k, v)
        torch.testing.assert_close(SegmentedAttention(segs)(layer, q, k, v), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(buffered(layer, q, k, v), want, rtol=1e-5, atol=1e-6)


def test_rotating_chunk_kv_equals_encoding_at_the_offset() -> None:
    m = model("dream")
    chunk = [1, *tokens(10, 4)]
    bank, _ = chunk_prefill(m, [chunk], "causal", 12, 1)
    from pdllm.shared.chunk_prefill import ChunkBank, WriteKV, empty_bank
    from pdllm.shared.model.attention import DenseAttention

    shifted: ChunkBank = empty_bank(m, [len(chunk)])
    offset = 37
    positions = torch.arange(offset, offset + len(chunk))[None]
    m.hidden_states(
        torch.tensor([chunk]), positions, WriteKV(DenseAttention(causal=True), shifted, slice(0, 1))
    )
    torch.testing.assert_close(
        rotate_keys(m, bank.segment(0), offset), shifted.segment(0), rtol=1e-4, atol=1e-5
    )
    assert not torch.allclose(bank.segment(0)[:, 0], shifted.segment(0)[:, 0], atol=1e-3)


class _CountingPolicy(StaticPolicy):
    def __init__(self) -> None:
        super().__init__("segments")
        self.steps: list[int] = []
        self.masked: list[int] = []

    def backend(self, step, tokens):  # type: ignore[no-untyped-def]
        self.steps.append(step)
        self.masked.append(int((tokens == 96).sum()))
        return super().backend(step, tokens)


def test_policy_is_called_once_per_step_and_can_change_what_decode_sees() -> None:
    m = model("llada")
    engine = PrefillingEngine(m, None, EngineConfig(chunk_size=12, top_k=2))
    sel = engine.prefill(tokens(40, 1), tokens(5, 2), GEN)
    static = engine.build(sel, GEN)
    policy = _CountingPolicy()
    result = decode(m, sel.request.query, static, GEN, policy)
    assert policy.steps == list(range(result.steps)) and result.steps == 3
    assert policy.masked == [6, 4, 2]  # the loop hands the policy the live tokens
    # A policy that drops the static KV is an honest variant: no context gives other logits.
    blind = StaticKV([], static.query_start)
    alone = decode(m, sel.request.query, blind, GEN, StaticPolicy("segments"))
    with_ctx = decode(m, sel.request.query, static, GEN, StaticPolicy("segments"))
    assert with_ctx.raw_tokens == result.raw_tokens
    assert alone.raw_tokens != result.raw_tokens


def test_trace_reports_every_phase_and_is_json() -> None:
    engine = PrefillingEngine(model("dream"), None, EngineConfig(chunk_size=12, top_k=2, top_b=5))
    result, trace = engine.generate(tokens(40, 1), tokens(5, 2), GEN)
    d = json.loads(json.dumps(trace.to_dict()))
    assert set(d["timings"]) == {"prefill", "score", "select", "build", "decode"} and all(
        t >= 0 for t in d["timings"].values()
    )
    assert d["num_chunks"] == 4 and d["context_tokens"] == 40 and len(d["chunk_scores"]) == 4
    assert d["selected"] == sorted(d["selected"]) and len(d["selected"]) == 2
    assert all(k <= 5 for k in d["kept_tokens"])
    for s in d["chunk_scores"]:
        assert abs(s["total"] - (s["s_i"] + s["s_p"])) < 1e-9
    assert d["decode_steps"] == result.steps and d["memory_kind"] == "cpu-rss-delta"
    assert result.timings == d["timings"]


def test_graphed_rounds_are_reused_by_a_new_request_of_the_same_shape() -> None:
    """Same shapes, other document: the engine's rounds replay the bucket the first request made and still
    decode each request as the reference loop (segmented attention, one request) does."""
    m = model("dream")
    cfg = EngineConfig(chunk_size=12, top_k=2)
    cached = PrefillingEngine(m, None, cfg, reuse_chunks=False, cuda_graph=True)
    plain = PrefillingEngine(m, None, cfg, reuse_chunks=False)
    wants = []
    for doc in (1, 2, 3):
        context, question = tokens(48, doc), tokens(5, 10 + doc)
        got, _ = cached.generate(context, question, GEN)
        sel = plain.prefill(context, question, GEN)
        want = decode(m, sel.request.query, plain.build(sel, GEN), GEN, StaticPolicy("segments"))
        assert got.raw_tokens == want.raw_tokens
        wants.append(want.raw_tokens)
    forward = cached.decode_worker.local.forward
    assert forward is not None and (forward.captures, forward.replays) == (1, 3 * GEN.steps - 1)
    assert wants[0] != wants[1]


def test_default_decode_attention_follows_the_device() -> None:
    import importlib.util

    from pdllm.decode_service.worker import default_decode_attention

    cuda = torch.device("cuda")  # a device object needs no GPU
    assert default_decode_attention(torch.device("cpu")) == "torch"
    want = "triton" if importlib.util.find_spec("triton") is not None else "torch"
    assert default_decode_attention(cuda) == want


def test_triton_decode_attention_off_cuda_needs_the_interpreter(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from pdllm.shared.app.engine import PrefillingEngine

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs CUDA with Triton, or TRITON_INTERPRET=1"):
        PrefillingEngine(model("dream"), None, decode_attention="triton")
