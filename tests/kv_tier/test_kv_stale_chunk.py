"""A document that comes back edited: the chunk whose text changed (same length, same position in the
document) is prefilled again, never served from the KV tier with its old KV; the request's chunk KV,
scores and answer equal a cold run on the edited document (fp32 CPU, tiny model, all-in-one engine over
the device cache in front of the host tier, as ``serve`` stacks them).

Planted by hand (each fails every case unless said otherwise):
- ``keys.chunk_key`` hashing the length of the tokens instead of the tokens -> the chunk-KV assertion fails;
- ``keys.chunk_key`` hashing all tokens but the last (``token_ids[:-1]``) -> fails for the edit of the
  last token (the middle-token edit still changes the key);
- the prefill worker keying chunks by their index in the document (``chunk_keys(..., [[i + 1] for i in
  range(len(chunks))])`` in ``prefill_many_steps``) -> the chunk-KV assertion fails;
- ``chunk_prefill_steps`` keying chunks by index when it makes the keys itself (the decode worker's
  chunk-only path) -> only the ``chunk-only/bidirectional`` cases fail, on the answer.
"""

from __future__ import annotations

import pytest
import torch

from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.chunk_prefill import chunk_prefill
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.kv_tier.cpu_store import CPUStore, CPUStoreConfig
from pdllm.shared.kv_tier.device_cache import DeviceChunkCache
from tests.engine.helpers import VOCAB_HI, VOCAB_LO, model, tokens

C = 12
GEN = GenerationConfig(gen_length=6, steps=3)
EDITED = 1  # the chunk whose text changes


def edit(context: list[int], at: int) -> list[int]:
    """``context`` with token ``at`` of chunk ``EDITED`` replaced by another id (nothing moves)."""
    out = list(context)
    i = EDITED * C + at
    out[i] = VOCAB_LO + (out[i] - VOCAB_LO + 1) % (VOCAB_HI - VOCAB_LO)
    return out


@pytest.mark.parametrize("at", [C // 2, C - 1], ids=["middle-token", "last-token"])
@pytest.mark.parametrize(
    "config",
    [
        EngineConfig(chunk_size=C, top_k=2),
        # every chunk selected: the decode worker looks each one up in the tier under its own scheme
        EngineConfig(chunk_size=C, top_k=8, kv_mode="chunk-only", prefill_attention="bidirectional"),
    ],
    ids=["full-mask", "chunk-only/bidirectional"],
)
def test_an_edited_chunk_is_prefilled_again_not_served_stale(config: EngineConfig, at: int) -> None:
    m = model("dream")
    store = DeviceChunkCache(CPUStore(CPUStoreConfig(capacity_bytes=1 << 26)), 1 << 26, torch.device("cpu"))
    engine = PrefillingEngine(m, None, config, store=store, kv_write_policy="all")
    context, question = tokens(3 * C + 5, 1), tokens(5, 2)
    engine.generate(context, question, GEN)  # every chunk's KV is now in the tier

    changed = edit(context, at)
    sel = engine.prefill(changed, question, GEN)
    chunks = sel.request.chunks
    assert len(chunks) == 4 and chunks[EDITED][1:] != context[EDITED * C : (EDITED + 1) * C]
    cold_kv, _ = chunk_prefill(m, chunks, "causal", C, 4)  # no store: a fresh prefill of the edited text
    for i in range(len(chunks)):
        assert torch.equal(sel.bank.segment(i), cold_kv.segment(i)), f"chunk {i}: KV not a fresh prefill's"
    assert (sel.trace.cache_hits, sel.trace.cache_misses) == (3, 1)  # the edited chunk alone missed

    result = engine.decode(sel, GEN)
    cold, cold_trace = PrefillingEngine(m, None, config, reuse_chunks=False).generate(changed, question, GEN)
    assert [s["total"] for s in sel.trace.chunk_scores] == [s["total"] for s in cold_trace.chunk_scores]
    assert sel.trace.selected == cold_trace.selected
    assert result.raw_tokens == cold.raw_tokens
    if config.kv_mode == "chunk-only":  # the decode worker's lookups: the three unchanged chunks hit
        assert (sel.trace.cache_hits, sel.trace.cache_misses) == (3 + 3, 1 + 1)
