"""Chunk scoring on the prefill side against the from-scratch oracle (``prefilling.py``): the prefill worker's
``prefill`` (batched draft over the chunks' banked KV, then the NLL forward) must give every chunk the
oracle's pseudo-labels exactly, its self-information and pseudo-label scores to float32 rounding, the same
trace scores and the same top-K."""

from __future__ import annotations

import pytest

from pdllm.prefill_service.worker import PrefillWorker
from pdllm.shared.config import EngineConfig

from .cases import CHUNK, CONTEXT, INSTRUCTION, QUESTION, TOP_K, gen, model
from .prefilling import chunks, draft_labels, score, top_k

TOL = 1e-5


def _prefill(family: str, config: EngineConfig):
    worker = PrefillWorker(model(family, layers=2), None, config)
    return worker.model, worker.prefill(CONTEXT, QUESTION, gen(16, 16, 8, None), INSTRUCTION)


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize(("labels", "rounds"), [(4, 2), (4, 1), (6, 4), (5, 3), (3, 3)])
def test_pseudo_label_scores_match_oracle(family: str, labels: int, rounds: int) -> None:
    """Planted: the draft runs one round per label whatever ``pseudo_label_rounds`` says (``steps=
    pseudo_labels`` in the draft config) -> fails (every case with fewer rounds than labels). Planted: the
    rounds' unmask counts in reverse order -> fails (5 labels in 3 rounds). Planted: ``s_P`` averaged over
    the last query token too, or ``s_I`` without the last query token -> fails."""
    config = EngineConfig(chunk_size=CHUNK, top_k=TOP_K, pseudo_labels=labels, pseudo_rounds=rounds)
    m, sel = _prefill(family, config)
    expected = score(m, chunks(CONTEXT, CHUNK, m.config.bos_token_id), QUESTION, labels, rounds)
    assert [s.labels for s in sel.scores] == [e.labels for e in expected]
    for got, want in zip(sel.scores, expected, strict=True):
        assert got.s_i == pytest.approx(want.s_i, abs=TOL)
        assert got.s_p == pytest.approx(want.s_p, abs=TOL)
    for row, want in zip(sel.trace.chunk_scores, expected, strict=True):
        assert row["total"] == pytest.approx(want.total, abs=2 * TOL)
    assert sel.selected == sel.trace.selected == top_k([e.total for e in expected], TOP_K)


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_self_information_scores_match_oracle(family: str) -> None:
    """Planted: ``s_I`` averaged without the last query token -> fails."""
    config = EngineConfig(chunk_size=CHUNK, top_k=TOP_K, score_mode="self-info")
    m, sel = _prefill(family, config)
    expected = score(m, chunks(CONTEXT, CHUNK, m.config.bos_token_id), QUESTION, None, 0)
    assert all(s.labels == [] and s.s_p is None for s in sel.scores)
    assert [s.s_i for s in sel.scores] == pytest.approx([e.s_i for e in expected], abs=TOL)
    assert sel.selected == top_k([e.total for e in expected], TOP_K)


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_rounds_change_the_labels_of_this_request(family: str) -> None:
    """The request above is one where the number of rounds decides the pseudo-labels (so the comparison can
    tell a draft that ignores it): one round and one round per label disagree on some chunk. Planted in the
    oracle: its draft ignoring ``rounds`` -> fails."""
    m = model(family, layers=2)
    per_chunk = chunks(CONTEXT, CHUNK, m.config.bos_token_id)
    one = [draft_labels(m, c, QUESTION, 4, 1) for c in per_chunk]
    each = [draft_labels(m, c, QUESTION, 4, 4) for c in per_chunk]
    assert one != each
