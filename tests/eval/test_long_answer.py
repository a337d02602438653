"""The long-answer task ("quote the paragraph about <name>"): generator, layout, scorers."""

from __future__ import annotations

import random

import pytest

from pdllm.shared.eval.long_answer import (
    PassageScore,
    answer_gen_length,
    distractors_for,
    make_eval_sample,
    make_long_answer_sample,
    plant_paragraphs,
    score_passage,
    token_agreement,
)
from pdllm.shared.eval.tasks import format_answer
from tests.model.tiny_checkpoint import make_tokenizer

HAY = [
    " The reading room opens at nine.",
    " Letters and maps are kept in the east wing.",
    "\nVisitors sign in.",
]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def _n(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_sample_plants_one_gold_paragraph_of_the_right_length(tok, depth: float) -> None:
    s = make_long_answer_sample(tok, 2000, depth, seed=3, hay=HAY)
    assert 128 <= s.passage_tokens <= 256 and s.passage_tokens == _n(tok, s.answer)
    assert s.context.count(s.answer) == 1 and s.answer.startswith(s.name) and s.name in s.question
    assert s.question == f"Quote the paragraph about {s.name}."
    assert abs(s.context_tokens - 2000) < 200  # hay fills the rest, a sentence or so over
    where = s.context.index(s.answer) / len(s.context)
    assert abs(where - depth) < 0.25
    # deterministic in its arguments, different across seeds
    assert make_long_answer_sample(tok, 2000, depth, seed=3, hay=HAY) == s
    assert make_long_answer_sample(tok, 2000, depth, seed=4, hay=HAY).answer != s.answer


def test_distractors_are_about_other_people(tok) -> None:
    s = make_long_answer_sample(tok, 1500, 0.3, seed=1, hay=HAY, distractors=3)
    assert len(set(s.distractor_names)) == 3 and s.name not in s.distractor_names
    assert all(f"\n{n} was born" in s.context for n in (s.name, *s.distractor_names))
    assert s.context.count(s.name) == s.answer.count(s.name)  # only the gold paragraph names them
    assert f"\n{s.answer}\n" in s.context  # a paragraph of its own


def test_default_hay_is_the_held_out_haystack(tok) -> None:
    s = make_long_answer_sample(tok, 800, 0.5, seed=0, distractors=1)
    assert s.answer in s.context and s.context_tokens >= 700


def test_too_short_context_is_refused(tok) -> None:
    with pytest.raises(ValueError, match="too short for 3 paragraphs"):
        make_long_answer_sample(tok, 100, 0.5, seed=0, hay=HAY)


def test_gen_length_covers_answer_and_eos_in_whole_blocks(tok) -> None:
    s = make_long_answer_sample(tok, 1200, 0.5, seed=2, hay=HAY)
    g = answer_gen_length(tok, s, 32)
    assert g % 32 == 0 and g - 32 < _n(tok, format_answer(s.answer)) + 1 <= g


def test_scores(tok) -> None:
    answer = "Mira Halden was born in the city of Kelmar in 1950. Mira keeps a collection of 12 old maps."
    assert score_passage(tok, " " + answer + " ", answer) == PassageScore(True, 1.0)
    assert score_passage(tok, answer.replace("  ", " ").replace(". ", ".\n"), answer).exact
    wrong = score_passage(tok, answer.replace("1950", "1951"), answer)
    assert not wrong.exact and 0.8 < wrong.token_accuracy < 1.0
    half = score_passage(tok, answer[: len(answer) // 2], answer)
    assert not half.exact and 0.3 < half.token_accuracy < 0.7
    assert score_passage(tok, "", answer).token_accuracy == 0.0


def test_distractors_fit_the_context() -> None:
    assert [distractors_for(n) for n in (256, 511, 512, 767, 768, 1024, 16384)] == [0, 0, 1, 1, 2, 2, 2]


def test_eval_sample_uses_held_out_prose_and_fits(tok) -> None:
    s = make_eval_sample(tok, 512, 0.5, seed=1)
    assert len(s.distractor_names) == 1 and s.answer in s.context
    assert s.context_tokens <= 512 + 64  # one sentence or so over
    assert make_eval_sample(tok, 512, 0.5, seed=1) == s
    with pytest.raises(ValueError, match="too short; it needs at least 256 tokens"):
        make_eval_sample(tok, 200, 0.5, seed=1)


def test_plant_paragraphs_layout() -> None:
    rng = random.Random(0)
    text = plant_paragraphs([" A one.", " B two.", "\nC three."], "GOLD.", ["OTHER."], 0.0, rng)
    assert text.startswith("\nGOLD.\n") and "\nOTHER.\n" in text
    assert "\n A" not in text  # the sentence after a paragraph opens its own line, no leading space
    assert plant_paragraphs([" A one."], "GOLD.", [], 1.0, rng) == " A one.\nGOLD.\n"


def test_token_agreement() -> None:
    assert token_agreement([1, 2, 3], [1, 2, 3]) == 1.0
    assert token_agreement([1, 9, 3], [1, 2, 3]) == pytest.approx(2 / 3)
    assert token_agreement([1, 2], [1, 2, 3, 4]) == 0.5  # stopping early disagrees on the rest
    assert token_agreement([1, 2, 3, 4], [1, 2]) == 0.5  # so does running on
    assert token_agreement([], []) == 1.0 and token_agreement([], [5]) == 0.0
