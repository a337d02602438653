"""Long-context retrieval tasks: the prompt format shared by training, the engine and the evaluation.

A sample is a haystack of documentation prose (``shared/training/data/haystack.txt.gz``) with facts
planted at sentence boundaries, a question and a short answer. Prompt format (fixed; the engine and the
evaluation must build prompts with :func:`format_query` / :func:`prompt_ids`):

    [BOS] <context> "\\nQuestion: <question>\\nAnswer:"  -> the model generates " <answer>" then [EOS]

Tasks:
- ``needle``: one fact "The access code of Mira Halden is 48213." at the requested depth.
- ``needle_distractors``: the same plus near-duplicate facts (a similar name, the same name with another
  key, ...) at random depths; only the gold fact answers the question.
- ``multidoc``: many short documents "Document [k]: Vantor Labs was founded in the city of Kelmar. ...",
  one per entity; the question asks about the gold document's entity (the paper's lost-in-the-middle
  setup); depth places the gold document among the others.
- ``two_hop``: "Mira Halden works at Vantor Labs." at the requested depth and "The access code of Vantor
  Labs is 48213." elsewhere; the question asks for the code of the company where Mira Halden works.

Depth 0.0 puts the gold fact at the start of the context, 1.0 at its end (next to the question).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field

import torch

from ..training.corpus import Haystack, read_haystack, sentence_texts, tokenize_haystack

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


def format_query(question: str) -> str:
    return f"\nQuestion: {question}\nAnswer:"


def format_answer(answer: str) -> str:
    """The text the model generates for ``answer`` (before its EOS)."""
    return f" {answer}"


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


def _content(task: str, depth: float, hay: int, rng: random.Random) -> Content:
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


def render_task_text(task: str, rng: random.Random) -> str:
    """Facts, question and answer of one random sample as plain text (tokenizer training)."""
    content = _content(task, rng.random(), 300, rng)
    facts = "".join(b.header + "".join(t for _, t, _ in b.facts) for b in content.blocks[:4])
    return facts + format_query(content.question) + format_answer(content.answer)


@dataclass(frozen=True)
class Sample:
    task: str
    context: str
    question: str
    answer: str
    depth: float
    context_tokens: int
    gold_facts: tuple[str, ...]

    @property
    def query(self) -> str:
        return format_query(self.question)


class TaskFactory:
    """Builds samples over one tokenized haystack, as token ids (training) or text (evaluation)."""

    def __init__(self, tokenizer, haystack: Haystack) -> None:
        self.tokenizer = tokenizer
        self.hay = haystack
        self._n = haystack.num_tokens
        # Offsets of the haystack repeated twice, so a span may wrap around the corpus end.
        self._bounds = torch.cat(
            [haystack.offsets[:-1], haystack.offsets[:-1] + self._n, haystack.offsets[-1:] * 2]
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _plan(self, task: str, context_tokens: int, depth: float, rng: random.Random):
        """Content plus, per block, the ids of its header and facts; hay sized to fill the context."""
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {depth}")
        content = _content(task, depth, max(context_tokens, 1), rng)
        fixed = 0
        encoded = []
        for b in content.blocks:
            header = self.encode(b.header) if b.header else []
            facts = [(frac, self.encode(text), gold) for frac, text, gold in b.facts]
            fixed += len(header) + sum(len(f) for _, f, _ in facts)
            encoded.append((header, facts))
        overflow = fixed - (context_tokens - sum(b.hay for b in content.blocks))
        # Shrink the prose so that facts + prose == context_tokens (largest blocks give first).
        for i in sorted(range(len(content.blocks)), key=lambda j: -content.blocks[j].hay):
            if overflow <= 0:
                break
            take = min(overflow, content.blocks[i].hay)
            content.blocks[i].hay -= take
            overflow -= take
        if overflow > 0:
            raise ValueError(f"context_tokens={context_tokens} is too short for task {task!r}")
        if max(b.hay for b in content.blocks) > self.hay.num_tokens:
            raise ValueError(
                f"context_tokens={context_tokens} exceeds the haystack ({self.hay.num_tokens} tokens)"
            )
        return content, encoded

    def _segments(self, block: Block, facts, rng: random.Random) -> list[tuple[str, int, int]]:
        """('hay', start, end) absolute token ranges (start at sentence boundaries) and ('fact', i, 0)."""
        start_sentence = rng.randrange(self.hay.num_sentences)
        a = int(self._bounds[start_sentence])
        b = a + block.hay
        lo = int(torch.searchsorted(self._bounds, a))
        hi = int(torch.searchsorted(self._bounds, b, right=True))
        bounds = self._bounds[lo:hi]
        points = []
        for frac, _, _ in facts:
            target = a + frac * block.hay
            near = int(bounds[(bounds - target).abs().argmin()]) if bounds.numel() else a
            points.append(b if frac >= 1.0 else min(near, b))
        segs: list[tuple[str, int, int]] = []
        cur = a
        for i in sorted(range(len(facts)), key=lambda j: points[j]):
            if points[i] > cur:
                segs.append(("hay", cur, points[i]))
                cur = points[i]
            segs.append(("fact", i, 0))
        if b > cur:
            segs.append(("hay", cur, b))
        return segs

    def build_ids(
        self, task: str, context_tokens: int, depth: float, rng: random.Random
    ) -> tuple[torch.Tensor, list[int], list[int], list[tuple[int, int]]]:
        """(context ids [context_tokens], query ids, answer ids, gold fact spans in the context)."""
        ctx, qa, spans = self.build_multi_ids(task, context_tokens, depth, rng)
        return ctx, qa[0][0], qa[0][1], spans

    def build_multi_ids(
        self, task: str, context_tokens: int, depth: float, rng: random.Random
    ) -> tuple[torch.Tensor, list[tuple[list[int], list[int]]], list[tuple[int, int]]]:
        """Like :meth:`build_ids` with every (query ids, answer ids) pair; the first is the main one."""
        content, encoded = self._plan(task, context_tokens, depth, rng)
        pieces: list[torch.Tensor] = []
        spans: list[tuple[int, int]] = []
        pos = 0
        for block, (header, facts) in zip(content.blocks, encoded):
            pieces.append(torch.tensor(header, dtype=torch.int32))
            pos += len(header)
            for kind, x, y in self._segments(block, facts, rng):
                if kind == "hay":
                    idx = torch.arange(x, y) % self._n
                    pieces.append(self.hay.ids[idx])
                    pos += y - x
                else:
                    ids = facts[x][1]
                    if facts[x][2]:
                        spans.append((pos, pos + len(ids)))
                    pieces.append(torch.tensor(ids, dtype=torch.int32))
                    pos += len(ids)
        qa = [(content.question, content.answer), *content.extra_qa]
        encoded_qa = [(self.encode(format_query(q)), self.encode(format_answer(a))) for q, a in qa]
        return torch.cat(pieces).long(), encoded_qa, spans

    def _hay_text(self, a: int, b: int) -> tuple[str, int]:
        """Text of token range [a, b) and its token count: whole sentences, the last one cut at a word
        boundary (so the text re-tokenizes to exactly the counted tokens, a few short of b - a)."""
        out = []
        used = 0
        i = int(torch.searchsorted(self._bounds, a))
        while int(self._bounds[i]) < b:
            s = self.hay.sentences[i % self.hay.num_sentences]
            room = b - int(self._bounds[i])
            if int(self._bounds[i + 1]) <= b:
                out.append(s)
                used += int(self._bounds[i + 1] - self._bounds[i])
            else:
                words = s.split(" ")
                lo, hi = 0, len(words)
                while lo < hi:  # longest word prefix with at most `room` tokens
                    mid = (lo + hi + 1) // 2
                    if len(self.encode(" ".join(words[:mid]))) <= room:
                        lo = mid
                    else:
                        hi = mid - 1
                out.append(" ".join(words[:lo]))
                used += len(self.encode(out[-1]))
                break
            i += 1
        return "".join(out), used

    def make_sample(self, task: str, context_tokens: int, depth: float, seed: int) -> Sample:
        rng = random.Random(f"{task}:{context_tokens}:{depth}:{seed}")
        content, encoded = self._plan(task, context_tokens, depth, rng)
        parts = []
        deficit = 0
        for block, (_, facts) in zip(content.blocks, encoded):
            parts.append(block.header)
            # Tokens lost where the previous block's prose was cut at a word boundary go to this block.
            block.hay += deficit
            deficit = 0
            for kind, x, y in self._segments(block, facts, rng):
                if kind == "hay":
                    text, used = self._hay_text(x, y)
                    parts.append(text)
                    deficit += y - x - used
                else:
                    parts.append(block.facts[x][1])
        context = "".join(parts)
        return Sample(
            task=task,
            context=context,
            question=content.question,
            answer=content.answer,
            depth=depth,
            context_tokens=len(self.encode(context)),
            gold_facts=tuple(content.gold_facts),
        )


@functools.lru_cache(maxsize=4)
def eval_factory(tokenizer) -> TaskFactory:
    """Factory over the held-out tail of the haystack (sentences the model never trained on)."""
    _, held_out = split_train_eval_sentences()
    return TaskFactory(tokenizer, tokenize_haystack(tokenizer, held_out))


def split_train_eval_sentences(eval_fraction: float = 0.1) -> tuple[list[str], list[str]]:
    sentences = sentence_texts(read_haystack())
    cut = int(len(sentences) * (1.0 - eval_fraction))
    return sentences[:cut], sentences[cut:]


def make_sample(task: str, context_tokens: int, depth: float, seed: int, tokenizer) -> Sample:
    """One evaluation sample: ``context_tokens`` tokens of context (a few fewer where the last sentence
    is cut at a word boundary) with the gold fact at ``depth``; deterministic in all arguments."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r} (expected one of {', '.join(TASKS)})")
    return eval_factory(tokenizer).make_sample(task, context_tokens, depth, seed)


def prompt_ids(tokenizer, sample: Sample) -> list[int]:
    """[BOS] + context + query: what vanilla decoding conditions on."""
    enc = tokenizer(sample.context + sample.query, add_special_tokens=False)["input_ids"]
    return [tokenizer.bos_token_id, *enc]


def ci_samples(tokenizer, n: int = 10, context_tokens: int = 512) -> list[Sample]:
    """The fixed short set the CPU CI test decodes (single needle, depths spread over 0..1)."""
    return [
        make_sample("needle", context_tokens, round(i / max(n - 1, 1), 3), 1000 + i, tokenizer)
        for i in range(n)
    ]


__all__ = ["TASKS", "Sample", "TaskFactory", "ci_samples", "format_query", "make_sample", "prompt_ids"]
