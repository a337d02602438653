"""A long-answer task: "Quote the paragraph about <name>." (decode policies are judged on answers
long enough for cached K/V to drift; the needle tasks answer in 16 tokens).

A sample is documentation prose (by default the held-out haystack, as for the other tasks) with a planted
paragraph of 128-256 tokens about one invented person at the requested depth, plus distractor paragraphs
about other invented people elsewhere; the answer is the gold paragraph verbatim. Same prompt format as the
retrieval tasks (``tasks.format_query`` / ``format_answer``). Scored per sample by :func:`score_passage`:
exact passage (whitespace-normalized) and token accuracy (answer tokens reproduced at their position).

``pdllm eval --tasks long-answer`` scores it (:func:`make_eval_sample`: distractors as many as the context
holds, up to two). Training rows (``shared/training/data.py``, ``DataConfig.long_answer_weight``) use the
same passages and :func:`plant_paragraphs`, over the training sentences of the haystack.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .task_facts import KEYS, _code, _person, _word
from .tasks import format_answer, format_query, split_train_eval_sentences

LONG_ANSWER = "long-answer"  # the task's name in ``pdllm eval --tasks`` and in the report rows
PASSAGE_TOKENS = (128, 256)
MAX_DISTRACTORS = 2
_FIELDS = ("tidal mapping", "glass chemistry", "river law", "bridge design", "seed banking", "bell casting")
_THINGS = ("maps", "clocks", "field notebooks", "brass keys", "postcards", "lanterns")
_TRAITS = ("patient", "exact", "quiet", "stubborn", "generous", "curious", "careful", "cheerful")
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_TEMPLATES = (
    "{name} was born in the city of {city} in {year}.",
    "{first} studied {field} at {company} for {n} years.",
    "The {key} of {name} is {code}.",
    "In {year}, {first} moved to {city} to work at {company}.",
    "{first} keeps a collection of {count} old {thing} at home.",
    "Colleagues at {company} describe {first} as {trait} and {trait2}.",
    "Every {day}, {first} walks to the harbour of {city} before work.",
    "{first} once wrote a short report on {field} that was read aloud in {city}.",
)


@dataclass(frozen=True)
class LongAnswerSample:
    context: str
    question: str
    answer: str  # the gold paragraph, verbatim
    name: str
    distractor_names: tuple[str, ...]
    depth: float
    context_tokens: int
    passage_tokens: int

    @property
    def query(self) -> str:
        return format_query(self.question)


@dataclass(frozen=True)
class PassageScore:
    exact: bool
    token_accuracy: float


def _count(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _sentence(rng: random.Random, first: str, name: str, template: str | None = None) -> str:
    company = f"{_word(rng, 2)} {rng.choice(('Labs', 'Works', 'Foundry', 'Institute'))}"
    trait, trait2 = rng.sample(_TRAITS, 2)
    values = {
        "name": name, "first": first, "city": _word(rng, rng.choice((2, 3))), "year": rng.randint(1890, 2010),
        "field": rng.choice(_FIELDS), "company": company, "n": rng.randint(2, 9), "key": rng.choice(KEYS),
        "code": _code(rng), "count": rng.randint(3, 90), "thing": rng.choice(_THINGS), "trait": trait,
        "trait2": trait2, "day": rng.choice(_DAYS),
    }  # fmt: skip
    return (template or rng.choice(_TEMPLATES[1:])).format(**values)


def make_passage(
    tokenizer: Any, rng: random.Random, bounds: tuple[int, int] = PASSAGE_TOKENS
) -> tuple[str, str]:
    """(name, paragraph about them) of ``bounds[0]``..``bounds[1]`` tokens."""
    lo, hi = bounds
    first, last = _person(rng)
    name = f"{first} {last}"
    # The first sentence names the person in full, so that the question has exactly one answer.
    target, text = rng.randint(lo, hi), _sentence(rng, first, name, _TEMPLATES[0])
    for _ in range(200):
        if _count(tokenizer, text) >= target:
            break
        longer = text + " " + _sentence(rng, first, name)
        if _count(tokenizer, longer) <= hi:
            text = longer
    n = _count(tokenizer, text)
    if not lo <= n <= hi:
        raise ValueError(f"could not write a paragraph of {lo}-{hi} tokens (got {n}) with this tokenizer")
    return name, text


def make_long_answer_sample(
    tokenizer: Any,
    context_tokens: int,
    depth: float,
    seed: int,
    hay: Sequence[str] | None = None,
    distractors: int = 2,
    bounds: tuple[int, int] = PASSAGE_TOKENS,
) -> LongAnswerSample:
    """About ``context_tokens`` tokens of ``hay`` sentences (each with its leading separator; default: the
    held-out haystack) with the gold paragraph at ``depth`` (0: first, 1: last) and ``distractors`` other
    paragraphs at random places; deterministic in all arguments."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    sentences = list(hay) if hay is not None else held_out_sentences()
    rng = random.Random(f"long_answer:{context_tokens}:{depth}:{seed}")
    name, gold = make_passage(tokenizer, rng, bounds)
    others: dict[str, str] = {}
    while len(others) < distractors:
        other, text = make_passage(tokenizer, rng, bounds)
        if other != name:
            others[other] = text
    budget = context_tokens - sum(_count(tokenizer, p) for p in (gold, *others.values()))
    if budget < 0:
        raise ValueError(f"context_tokens={context_tokens} is too short for {1 + distractors} paragraphs")
    prose, used, i = [], 0, rng.randrange(len(sentences))
    while used < budget:
        s = sentences[i % len(sentences)]
        used += _count(tokenizer, s)
        prose.append(s)
        i += 1
    context = plant_paragraphs(prose, gold, list(others.values()), depth, rng)
    return LongAnswerSample(
        context=context,
        question=question_about(name),
        answer=gold,
        name=name,
        distractor_names=tuple(others),
        depth=depth,
        context_tokens=_count(tokenizer, context),
        passage_tokens=_count(tokenizer, gold),
    )


def question_about(name: str) -> str:
    return f"Quote the paragraph about {name}."


def plant_paragraphs(
    prose: Sequence[str], gold: str, others: Sequence[str], depth: float, rng: random.Random
) -> str:
    """The context text: ``prose`` sentences (each with its leading separator) with each paragraph on lines
    of its own between two sentences, the gold one at ``depth``, the others at random places. Evaluation
    and training both lay contexts out here, so the model trains on the format it is scored on."""
    slots = [(round(depth * len(prose)), gold)] + [(rng.randint(0, len(prose)), p) for p in others]
    parts = list(prose)
    for at, paragraph in sorted(slots, key=lambda s: -s[0]):
        if at < len(parts):  # the prose after a paragraph opens a line of its own
            parts[at] = parts[at].lstrip(" ")
        parts.insert(at, "\n" + paragraph + "\n")
    return "".join(parts)


@functools.lru_cache(maxsize=1)
def held_out_sentences() -> tuple[str, ...]:
    """The held-out tail of the haystack (read once: every evaluation sample draws from it)."""
    return tuple(split_train_eval_sentences()[1])


def distractors_for(context_tokens: int) -> int:
    """Distractor paragraphs an evaluation context of this size gets: as many as fit beside the gold one at
    the longest passage length, up to :data:`MAX_DISTRACTORS` (0 at 256-511 tokens, 1 at 512-767, 2 from
    768 on), so that every length from one passage up can be evaluated."""
    return max(0, min(MAX_DISTRACTORS, context_tokens // PASSAGE_TOKENS[1] - 1))


def make_eval_sample(tokenizer: Any, context_tokens: int, depth: float, seed: int) -> LongAnswerSample:
    """The sample ``pdllm eval --tasks long-answer`` scores: held-out prose, :func:`distractors_for`."""
    if context_tokens < PASSAGE_TOKENS[1]:
        raise ValueError(
            f"{LONG_ANSWER}: context length {context_tokens} is too short; it needs at least "
            f"{PASSAGE_TOKENS[1]} tokens (one passage of up to {PASSAGE_TOKENS[1]})"
        )
    return make_long_answer_sample(
        tokenizer,
        context_tokens,
        depth,
        seed,
        hay=held_out_sentences(),
        distractors=distractors_for(context_tokens),
    )


def answer_gen_length(tokenizer: Any, sample: LongAnswerSample, block_length: int) -> int:
    """Answer slots for ``sample``: its tokens and an EOS, rounded up to whole blocks."""
    n = _count(tokenizer, format_answer(sample.answer)) + 1
    return -(-n // block_length) * block_length


def score_passage(tokenizer: Any, prediction: str, answer: str) -> PassageScore:
    """Exact: equal up to whitespace. Token accuracy: the share of the answer's tokens that the prediction
    has at the same position (both tokenized as generated answers; a short prediction misses the rest)."""
    want = tokenizer(format_answer(answer.strip()), add_special_tokens=False)["input_ids"]
    got = tokenizer(format_answer(prediction.strip()), add_special_tokens=False)["input_ids"]
    hits = sum(g == w for g, w in zip(got, want, strict=False))
    exact = prediction.split() == answer.split()
    return PassageScore(exact=exact, token_accuracy=hits / len(want) if want else float(not got))


def token_agreement(got: Sequence[int], reference: Sequence[int]) -> float:
    """Share of positions where two decodings (token ids, trimmed at EOS) hold the same token, over the
    longer of the two: a policy that stops early or runs on disagrees there. Two empty answers agree."""
    n = max(len(got), len(reference))
    return sum(a == b for a, b in zip(got, reference, strict=False)) / n if n else 1.0
