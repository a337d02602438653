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
The names, codes and fact templates, and what each task plants and asks, are ``task_facts.py``'s; this
module lays them out over the haystack as text or ids.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import torch

from ..training.corpus import Haystack, read_haystack, sentence_texts, tokenize_haystack
from .task_facts import TASKS, Block, task_content


def format_query(question: str) -> str:
    return f"\nQuestion: {question}\nAnswer:"


def format_answer(answer: str) -> str:
    """The text the model generates for ``answer`` (before its EOS)."""
    return f" {answer}"


def render_task_text(task: str, rng: random.Random) -> str:
    """Facts, question and answer of one random sample as plain text (tokenizer training)."""
    content = task_content(task, rng.random(), 300, rng)
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
        content = task_content(task, depth, max(context_tokens, 1), rng)
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
