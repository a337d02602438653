"""chunk_boundary="sentence": layout properties, validation, and fast path == reference path."""

from __future__ import annotations

import math
import random

import pytest

from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.layout import make_request, sentence_end_ids, split_context
from pdllm.shared.reference import reference_generate
from tests.engine.helpers import model, tokens

C = 12
GEN = GenerationConfig(gen_length=8, steps=4)
# About a third of the helper's token range (3..89) ends a sentence: chunks of 9..12 tokens.
ENDS = frozenset(range(3, 30))


def _check_layout(context: list[int], c: int, ends: frozenset[int]) -> list[list[int]]:
    chunks = split_context(context, c, "sentence", ends)
    assert [t for chunk in chunks for t in chunk] == context
    min_len = math.ceil(0.75 * c)
    start = 0
    for i, chunk in enumerate(chunks):
        assert 1 <= len(chunk) <= c
        if i < len(chunks) - 1:
            window = range(start + min_len - 1, start + c)  # cut after one of these: >= min_len tokens
            cuts = [j for j in window if context[j] in ends]
            expected = cuts[-1] + 1 - start if cuts else c
            assert len(chunk) == expected, (i, start, cuts)
        else:
            assert len(chunk) == len(context) - start
        start += len(chunk)
    return chunks


@pytest.mark.parametrize("c", [1, 2, 4, 7, 12, 64])
def test_sentence_layout_properties(c: int) -> None:
    rng = random.Random(c)
    for density in (0.0, 0.05, 0.3, 1.0):
        for n in (1, c - 1, c, c + 1, 5 * c + 3, 200):
            if n <= 0:
                continue
            context = [rng.randrange(3, 90) for _ in range(n)]
            ends = frozenset(t for t in range(3, 90) if rng.random() < density)
            chunks = _check_layout(context, c, ends)
            if not ends:
                assert chunks == split_context(context, c, "fixed")


def test_cut_lands_after_last_sentence_end_in_last_quarter() -> None:
    dot, w = 7, 50  # "." and a word
    # C=8: a chunk keeps >= 6 tokens, so only sentence ends at indices 5..7 of a chunk may cut it.
    context = [w, dot, w, w, w, w, dot, w, w, w, w, w, w, w, w, w, w, w, w, w, w, dot]
    chunks = split_context(context, 8, "sentence", {dot})
    assert [len(x) for x in chunks] == [7, 8, 7]  # cut after index 6; then no end in 12..14: cut at C
    assert chunks[0][-1] == dot
    # A sentence end before the last quarter does not cut (index 1 here), the fixed cut stays.
    assert split_context(context[:1] + [dot] + [w] * 10, 8, "sentence", {dot})[0] == [w, dot] + [w] * 6


def test_sentence_end_ids_from_tokenizer() -> None:
    class Tok:
        texts = ["<s>", "</s>", "Hello", " world", ".", "!\n", '?"', " end.'", "\n", "3.5", "e.g", ".)"]
        all_special_ids = [0, 1]

        def __len__(self) -> int:
            return len(self.texts)

        def decode(self, ids: list[int]) -> str:
            return "".join(self.texts[i] for i in ids)

    assert sentence_end_ids(Tok()) == frozenset({4, 5, 6, 7, 8})


def test_invalid_chunk_boundary_and_missing_sentence_ends() -> None:
    with pytest.raises(
        ValueError, match=r"chunk_boundary must be one of fixed, sentence \(got 'paragraph'\)"
    ):
        EngineConfig(chunk_boundary="paragraph")  # type: ignore[arg-type]
    cfg = EngineConfig(chunk_size=C, chunk_boundary="sentence")
    with pytest.raises(ValueError, match="sentence-end token ids"):
        make_request(tokens(30, 1), tokens(4, 2), 1, cfg, 97)
    engine = PrefillingEngine(model("dream"), None, cfg)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        engine.prefill(tokens(30, 1), tokens(4, 2), GEN)


CASES = [
    ("dream", "full-mask", 5, 2, "torch"),
    ("llada", "chunk-only", 5, 3, "torch"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-b{c[2]}-k{c[3]}-{c[4]}")
def test_sentence_chunks_fast_path_matches_reference(case: tuple) -> None:
    family, kv_mode, top_b, top_k, attn = case
    m = model(family)
    context, question = tokens(50, 1), tokens(6, 2)
    cfg = EngineConfig(chunk_size=C, top_k=top_k, top_b=top_b, kv_mode=kv_mode, chunk_boundary="sentence")
    request = make_request(context, question, 1, cfg, 97, [5, 7, 9], sentence_ends=ENDS)
    lens = [len(c) - 1 for c in request.chunks]
    assert max(lens) <= C and any(n < C for n in lens[:-1])  # the layout differs from fixed chunks
    ref = reference_generate(m, request, cfg, GEN)
    engine = PrefillingEngine(m, None, cfg, decode_attention=attn, sentence_ends=ENDS)
    sel = engine.prefill(context, question, GEN, [5, 7, 9])
    result = engine.decode(sel, GEN)
    assert sel.request.chunks == request.chunks
    for fast, slow in zip(sel.scores, ref.scores, strict=True):
        assert fast.labels == slow.labels
        assert fast.total == pytest.approx(slow.total, abs=1e-5)
    assert sel.selected == ref.selected
    assert sel.trace.kept_tokens == [int(k.numel()) for k in ref.kept]  # what the build kept
    assert result.raw_tokens == ref.result.raw_tokens
    assert result.steps == ref.result.steps
