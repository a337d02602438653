"""The infilling task: span bounds and placement, seeded determinism, the span is the document's own text,
scoring, and ``pdllm eval --tasks infilling`` end to end on a tiny checkpoint."""

from __future__ import annotations

import json
import random

import pytest

from pdllm.shared.eval import infilling
from pdllm.shared.eval.infilling import (
    GAP,
    SPAN_TOKENS,
    InfillSample,
    infill_gen_length,
    make_infill_sample,
    score_infill,
    span_starts,
)
from pdllm.shared.training.tokenizer import load_tokenizer

_TEXT = (
    "the archive keeps letters maps and notes from the coast while readers ask about the harbour and its "
    "old bridge near the river where the society met every week to read reports aloud"
)
_WORDS = _TEXT.split(" ")


def make_docs(n: int = 12, seed: int = 0) -> list[str]:
    """Documents of 4-8 paragraphs of 3-5 plain sentences each (ASCII, as the corpus's prose)."""
    rng = random.Random(seed)
    docs = []
    for d in range(n):
        paras = []
        for _ in range(rng.randint(4, 8)):
            sents = []
            for _ in range(rng.randint(3, 5)):
                words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 14))]
                sents.append(" ".join(words).capitalize() + f" in {1900 + rng.randint(0, 99)}.")
            paras.append(" ".join(sents))
        docs.append(f"Document {d}. " + "\n".join(paras))
    return docs


DOCS = make_docs()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_span_bounds_and_marker_depth(tok, depth: float) -> None:
    """Plant: ``pick_span`` returning ``s - 1`` (the span starts one token early, before a word) breaks
    the space-led start, the tokenization check and the splice back into the document."""
    room = 1000 - len(_ids(tok, GAP))
    for seed in range(6):
        s = make_infill_sample(tok, 1000, depth, seed, docs=DOCS)
        assert SPAN_TOKENS[0] <= s.span_tokens <= SPAN_TOKENS[1] and len(s.answer_ids) == s.span_tokens
        assert s.context.count(GAP) == 1 and s.context_tokens == 1000
        prefix, suffix = s.context.split(GAP)
        assert len(_ids(tok, prefix)) == round(depth * room)  # the marker sits at the depth
        assert s.answer.startswith(" ") and tuple(_ids(tok, s.answer)) == s.answer_ids
        # Spliced back, the window is the documents' text; the span lies inside one document.
        assert s.answer in DOCS[s.document]
        joined = "\n\n".join(DOCS * 3)
        assert (prefix[-40:] + s.answer + suffix[:40]) in joined
        assert suffix == "" or suffix[0].isspace()


def test_span_starts_are_word_aligned(tok) -> None:
    import torch

    ids = torch.tensor(_ids(tok, DOCS[0]))
    for n in (64, 100, 256):
        starts = span_starts(tok, ids, n).tolist()
        assert starts and all(1 <= s <= ids.numel() - n for s in starts)
        for s in starts:
            assert tok.decode(ids[s : s + 1]).startswith(" ")
            assert s + n == ids.numel() or tok.decode(ids[s + n : s + n + 1])[:1].isspace()


def test_seeded_determinism(tok) -> None:
    a = make_infill_sample(tok, 600, 0.5, 3, docs=DOCS)
    assert a == make_infill_sample(tok, 600, 0.5, 3, docs=DOCS)
    others = {make_infill_sample(tok, 600, 0.5, seed, docs=DOCS).answer for seed in range(4, 8)}
    assert a.answer not in others and len(others) == 4


def test_short_documents_borrow_context_from_neighbours(tok) -> None:
    s = make_infill_sample(tok, 3000, 0.5, 1, docs=DOCS[:4])
    assert s.context_tokens == 3000 and "\n\nDocument " in s.context


def test_bad_arguments(tok) -> None:
    with pytest.raises(ValueError, match="depth"):
        make_infill_sample(tok, 500, 1.5, 0, docs=DOCS)
    with pytest.raises(ValueError, match="too short"):
        infilling.make_eval_sample(tok, 32, 0.5, 0)
    with pytest.raises(ValueError, match="no document holds"):
        make_infill_sample(tok, 500, 0.5, 0, docs=["Too short to hold a span."])
    with pytest.raises(FileNotFoundError, match="prose build"):
        infilling.held_out_documents.__wrapped__(infilling.PROSE_DIR / "missing.txt.gz")


def test_scores() -> None:
    want = [5, 6, 7, 8]
    assert score_infill(want, want).exact and score_infill(want, want).token_accuracy == 1.0
    wrong = score_infill([5, 6, 9, 8], want)
    assert not wrong.exact and wrong.token_accuracy == 0.75
    assert score_infill([5, 6], want).token_accuracy == 0.5  # stopped early: the rest is missed
    longer = score_infill([*want, 1], want)
    assert not longer.exact and longer.token_accuracy == 1.0
    assert score_infill([6, 7, 8], want).token_accuracy == 0.0  # shifted by one: nothing at its place


def test_gen_length_covers_span_and_eos_in_whole_blocks() -> None:
    def sample(n: int) -> InfillSample:
        return InfillSample("c", "q", "a", (1,) * n, 0.5, 10, n, 0)

    assert [infill_gen_length(sample(n), 32) for n in (63, 64, 95, 256)] == [64, 96, 96, 288]


def test_eval_cli_scores_infilling(tmp_path, monkeypatch) -> None:
    """``pdllm eval --tasks infilling`` on a random tiny model: exact-span rate and token accuracy per cell,
    both methods, in the JSON rows and the Markdown tables."""
    from pdllm.shared.app import eval_settings
    from pdllm.shared.app.eval import main
    from tests.model.tiny_checkpoint import make_tiny_checkpoint

    ckpt = tmp_path / "tiny"
    make_tiny_checkpoint(ckpt)
    (ckpt / "pdllm.json").write_text(json.dumps({"train_length": 256, "engine": {"chunk_size": 32}}))
    made: list[InfillSample] = []

    def small_spans(tokenizer, context_tokens: int, depth: float, seed: int) -> InfillSample:
        # Spans of 8-16 tokens keep the random model's decodes cheap.
        made.append(make_infill_sample(tokenizer, context_tokens, depth, seed, docs=DOCS, bounds=(8, 16)))
        return made[-1]

    monkeypatch.setattr(eval_settings, "make_infill_sample", small_spans)
    argv = ["--model", str(ckpt), "--tasks", "infilling", "--samples", "2", "--depths", "0.5"]
    argv += ["--length-multiples", "1", "--block-length", "16", "--out", str(tmp_path), "--name", "inf"]
    assert main(argv) == 0
    data = json.loads((tmp_path / "inf.json").read_text())
    assert "multiple of 16" in data["infilling"]
    rows = data["rows"]
    assert [(r["method"], r["task"], r["context_length"]) for r in rows] == [
        ("vanilla", "infilling", 256),
        ("pdllm", "infilling", 256),
    ]
    for r in rows:
        assert 0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["token_accuracy"] <= 1.0 and r["samples"] == 2
    assert len(made) == 2 and all(8 <= s.span_tokens <= 16 for s in made)
    md = (tmp_path / "inf.md").read_text()
    assert "## infilling (exact span, %)" in md and "## infilling (token accuracy, %)" in md
