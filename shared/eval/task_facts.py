"""What each retrieval task plants and asks: random pronounceable names, companies and numeric codes, the
fact templates ("The access code of Mira Halden is 48213."), and per task the facts spread over the context
in blocks (:class:`Block`), the question and the answer (:func:`task_content`), plus single random facts for the
training's recall rows (:func:`fact_text`); ``tasks.py`` turns this content into prompts over a haystack.
Everything is drawn from the caller's ``random.Random``, so a sample is fixed by its seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

TASKS = ("needle", "needle_distractors", "multidoc", "two_hop")
# Training-only: several facts and several questions in one sequence (dense retrieval supervision).
TRAIN_TASKS = (*TASKS, "multi_needle")
KEYS = ("access code", "access code", "access code", "badge number", "locker number", "vault PIN")
_ONSETS = [
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "j",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "w",
    "z",
    "br",
    "cl",
    "dr",
    "fl",
    "gr",
    "kr",
    "pr",
    "st",
    "tr",
    "sh",
    "th",
]
_VOWELS = ["a", "e", "i", "o", "u", "a", "e", "i", "o", "ai", "ea", "io"]
_CODAS = ["", "", "", "n", "r", "l", "s", "th", "x", "m", "nd", "rk"]
_SUFFIXES = ("Labs", "Works", "Systems", "Group", "Foundry", "Institute", "Partners", "Holdings")


def _word(rng: random.Random, syllables: int) -> str:
    parts = [rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)]
    return "".join(parts).capitalize()


def _person(rng: random.Random) -> tuple[str, str]:
    return _word(rng, rng.choice((1, 2))), _word(rng, rng.choice((2, 2, 3)))


def _code(rng: random.Random) -> str:
    return str(rng.randint(1, 9)) + "".join(str(rng.randint(0, 9)) for _ in range(rng.randint(3, 6)))


def _mutate(name: str, rng: random.Random) -> str:
    """A near-duplicate: one letter of the name changed."""
    for _ in range(20):
        i = rng.randrange(1, len(name))
        pool = "aeiou" if name[i] in "aeiou" else "bcdfgklmnprstvz"
        out = name[:i] + rng.choice(pool) + name[i + 1 :]
        if out != name:
            return out
    return name + "e"


def _access_fact(owner: str, key: str, code: str) -> str:
    return f" The {key} of {owner} is {code}."


@dataclass
class Block:
    """One stretch of context: optional header text, ``hay`` tokens of prose, facts at fractions of it."""

    hay: int
    facts: list[tuple[float, str, bool]] = field(default_factory=list)  # (fraction, text, is_gold)
    header: str = ""


@dataclass
class Content:
    question: str
    answer: str
    blocks: list[Block]
    gold_facts: list[str]
    # Further (question, answer) pairs about other facts of the same context (multi_needle only).
    extra_qa: list[tuple[str, str]] = field(default_factory=list)


def task_content(task: str, depth: float, hay: int, rng: random.Random) -> Content:
    """Facts, question and answer of one sample, with ``hay`` tokens of prose to spread them over."""
    if task in ("needle", "needle_distractors"):
        first, last = _person(rng)
        key = rng.choice(KEYS)
        code = _code(rng)
        gold = _access_fact(f"{first} {last}", key, code)
        block = Block(hay=hay, facts=[(depth, gold, True)])
        if task == "needle_distractors":
            # the other keys sorted: a set's order follows the hash seed, and samples must not
            variants = [
                (f"{_person(rng)[0]} {last}", key),
                (f"{first} {_person(rng)[1]}", key),
                (f"{first} {_mutate(last, rng)}", key),
                (f"{_mutate(first, rng)} {last}", key),
                (f"{first} {last}", rng.choice(sorted(set(KEYS) - {key}))),
            ]
            for owner, k in rng.sample(variants, rng.randint(2, len(variants))):
                if (owner, k) != (f"{first} {last}", key):
                    block.facts.append((rng.random(), _access_fact(owner, k, _code(rng)), False))
        question = f"What is the {key} of {first} {last}?"
        return Content(question, code, [block], [gold])
    if task == "two_hop":
        first, last = _person(rng)
        company = f"{_word(rng, 2)} {rng.choice(_SUFFIXES)}"
        code = _code(rng)
        hop1 = f" {first} {last} works at {company}."
        hop2 = _access_fact(company, "access code", code)
        block = Block(hay=hay, facts=[(depth, hop1, True), (rng.random(), hop2, True)])
        question = f"What is the access code of the company where {first} {last} works?"
        return Content(question, code, [block], [hop1, hop2])
    if task == "multidoc":
        return _multidoc(depth, hay, rng)
    if task == "multi_needle":
        return _multi_needle(depth, hay, rng)
    raise ValueError(f"unknown task {task!r} (expected one of {', '.join(TASKS)})")


def _multi_needle(depth: float, hay: int, rng: random.Random) -> Content:
    people: dict[str, tuple[str, str]] = {}
    while len(people) < rng.randint(3, 8):
        first, last = _person(rng)
        people[f"{first} {last}"] = (rng.choice(KEYS), _code(rng))
    qa = [(f"What is the {key} of {owner}?", code) for owner, (key, code) in people.items()]
    facts = [_access_fact(owner, key, code) for owner, (key, code) in people.items()]
    fracs = [depth] + [rng.random() for _ in facts[1:]]
    asked = rng.sample(range(1, len(facts)), rng.randint(1, min(3, len(facts) - 1)))
    block = Block(hay=hay, facts=[(f, t, i == 0) for i, (f, t) in enumerate(zip(fracs, facts))])
    return Content(qa[0][0], qa[0][1], [block], [facts[0]], extra_qa=[qa[i] for i in asked])


def _multidoc(depth: float, hay: int, rng: random.Random) -> Content:
    sizes: list[int] = []
    while sum(sizes) < hay:
        sizes.append(rng.randint(40, 160))
    sizes[-1] -= sum(sizes) - hay
    if len(sizes) > 1 and sizes[-1] < 20:
        last = sizes.pop()
        sizes[-1] += last
    entities: list[str] = []
    while len(entities) < len(sizes):
        e = f"{_word(rng, rng.choice((2, 3)))} {rng.choice(_SUFFIXES)}"
        if e not in entities:
            entities.append(e)
    gold_index = round(depth * (len(sizes) - 1))
    blocks, gold, answer, question = [], "", "", ""
    for k, (size, entity) in enumerate(zip(sizes, entities)):
        city = _word(rng, rng.choice((2, 3)))
        fact = f" {entity} was founded in the city of {city}."
        blocks.append(Block(hay=size, facts=[(0.0, fact, k == gold_index)], header=f"\nDocument [{k + 1}]:"))
        if k == gold_index:
            gold, answer, question = fact, city, f"In which city was {entity} founded?"
    return Content(question, answer, blocks, [gold])


def fact_text(rng: random.Random) -> str:
    """One random fact sentence in any of the tasks' templates (training filler for recall batches)."""
    kind = rng.random()
    if kind < 0.6:
        first, last = _person(rng)
        return _access_fact(f"{first} {last}", rng.choice(KEYS), _code(rng))
    if kind < 0.8:
        entity = f"{_word(rng, rng.choice((2, 3)))} {rng.choice(_SUFFIXES)}"
        return f" {entity} was founded in the city of {_word(rng, rng.choice((2, 3)))}."
    first, last = _person(rng)
    return f" {first} {last} works at {_word(rng, 2)} {rng.choice(_SUFFIXES)}."
