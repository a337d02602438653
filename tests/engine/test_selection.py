"""Selection depends on content; ranking, clamping and top-B helpers behave as documented."""

from __future__ import annotations

import pytest
import torch

from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.layout import decode_layout, keep_top_b, make_request, select_top_k
from tests.engine.helpers import greedy_continuation, model, tokens

C = 12
GEN = GenerationConfig(gen_length=4, steps=2)


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_selection_follows_the_planted_chunk(family: str) -> None:
    """The question is the model's own continuation of one chunk: that chunk must win, wherever it is."""
    m = model(family, seed=1)
    context = tokens(5 * C, 11)
    engine = PrefillingEngine(m, None, EngineConfig(chunk_size=C, top_k=1, score_mode="self-info"))
    for planted in range(5):
        question = greedy_continuation(m, [1, *context[planted * C : (planted + 1) * C]], 6)
        sel = engine.prefill(context, question, GEN)
        assert sel.selected == [planted]
        totals = [s.total for s in sel.scores]
        assert totals[planted] == min(totals)


def test_top_k_larger_than_chunk_count_keeps_every_chunk() -> None:
    engine = PrefillingEngine(model("dream"), None, EngineConfig(chunk_size=C, top_k=50))
    sel = engine.prefill(tokens(30, 1), tokens(4, 2), GEN)
    assert sel.selected == [0, 1, 2]
    assert decode_layout(sel.request, sel.selected, GEN.gen_length).chunk_lens == [C + 1, C + 1, 7]


def test_select_top_k_lowest_scores_in_document_order() -> None:
    assert select_top_k([3.0, 1.0, 2.0, 0.5], 2) == [1, 3]
    assert select_top_k([1.0, 1.0, 1.0], 2) == [0, 1]  # ties: the earlier chunk
    assert select_top_k([2.0], 4) == [0]


def test_keep_top_b_keeps_bos_and_best_tokens() -> None:
    scores = torch.tensor([0.0, 5.0, 1.0, 9.0, 3.0])
    assert keep_top_b(scores, 3).tolist() == [0, 1, 3]
    assert keep_top_b(scores, 1).tolist() == [0]
    assert keep_top_b(scores, None).tolist() == [0, 1, 2, 3, 4]
    assert keep_top_b(scores, 10).tolist() == [0, 1, 2, 3, 4]


def test_positions_are_continuous_across_selected_chunks() -> None:
    cfg = EngineConfig(chunk_size=4)
    request = make_request(list(range(3, 17)), [20, 21], 1, cfg, 97, instruction_ids=[30, 31, 32])
    assert request.chunks[0] == [1, 3, 4, 5, 6] and request.chunks[-1] == [1, 15, 16]
    layout = decode_layout(request, [3, 1], gen_length=4)
    assert layout.chunk_ids == [1, 3]
    assert layout.chunk_starts == [3, 8]
    assert layout.static_len == 11
    assert layout.local_positions().tolist() == list(range(11, 17))
