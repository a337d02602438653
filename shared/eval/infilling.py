"""An infilling task: a span of 64-256 tokens is cut out of a held-out prose document, the model writes it.

A sample is a window of held-out prose (``shared/training/prose.py``'s ``prose_heldout.txt.gz``; documents
whose path hashes into the held-out split, never trained on) with one span of the document replaced by the
marker :data:`GAP`; the question asks for the missing text and the answer is the span, verbatim. Scored by
:func:`score_infill`: the share of the span's tokens the response has at the same position (token
accuracy), and whether it is the span exactly.

How the masked span is expressed. The most direct form for a dLLM would be the document with the span's
positions left as mask tokens, so that the response slots *are* the span. Neither decode path can run that:
vanilla decodes response slots appended after the whole prompt (``generation/plain.py``), and pdllm
prefills the context in chunks whose K/V stay fixed while only the query and the response are denoised
(``shared/prompt.py``: ``[BOS] instruction context query`` then the response). Mask tokens inside the
context would never be updated, and user text cannot even carry a mask token (``encode_prompt`` splits
special tokens). So the span leaves the document and becomes the response, with a visible marker where it
was, in the prompt format of every other task:

    [BOS] <prefix> [BLANK]<suffix> "\\nQuestion: Write the missing text that replaces [BLANK].\\nAnswer:"
    -> the model generates the span (it starts with a space, as ``format_answer`` answers do), then [EOS]

Both methods run it unchanged (pdllm must also select the chunk that holds the marker), and the model is
trained on exactly this layout (``shared/training/data.py``, ``DataConfig.infill_weight``, through
:func:`pick_span` and the same marker and question). The span starts at a word (a token led by a space)
and ends before a token led by whitespace, so the marker, the prefix and the suffix tokenize as they do in
the document and the span's tokens are the document's own tokens.

``length`` of the eval grid is the context's size in tokens and ``depth`` is where the marker sits in it
(0: start, 1: end). A document shorter than the window is extended with its neighbours in the held-out
file (blank line between documents); the span always lies inside one document.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..training.prose import HELDOUT_FILE, PROSE_DIR, read_documents
from .long_answer import PassageScore
from .tasks import format_query

INFILLING = "infilling"  # the task's name in ``pdllm eval --tasks`` and in the report rows
SPAN_TOKENS = (64, 256)
GAP = " [BLANK]"
QUESTION = "Write the missing text that replaces [BLANK]."
DOC_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class InfillSample:
    context: str  # the window with the span replaced by GAP
    question: str
    answer: str  # the span's text (decoded from its tokens)
    answer_ids: tuple[int, ...]  # the span's tokens, as the document tokenizes
    depth: float
    context_tokens: int
    span_tokens: int
    document: int  # index of the span's document in the held-out file

    @property
    def query(self) -> str:
        return format_query(self.question)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@functools.lru_cache(maxsize=4)
def _leading(tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Per vocabulary id: (token starts with a space, token starts with whitespace)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    text = [tokenizer.convert_tokens_to_string([t]) if t else "" for t in tokens]
    special = set(tokenizer.all_special_ids)
    space = torch.tensor([i not in special and s[:1] == " " for i, s in enumerate(text)])
    ws = torch.tensor([i not in special and s[:1].isspace() for i, s in enumerate(text)])
    return space, ws


def span_starts(tokenizer: Any, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Every start ``s`` (>= 1) of an ``n``-token span of ``ids`` that begins with a space-led token and ends
    at the end of ``ids`` or before a whitespace-led token."""
    space, ws = _leading(tokenizer)
    length = ids.numel()
    if n < 1 or length < n + 1:
        return torch.empty(0, dtype=torch.long)
    s = torch.arange(1, length - n + 1)
    ok = space[ids[s]]
    end = s + n
    ok &= (end == length) | ws[ids[end.clamp(max=length - 1)]]
    return s[ok]


def pick_span(tokenizer: Any, ids: torch.Tensor, n: int, rng: random.Random) -> int | None:
    """A seeded choice among :func:`span_starts` (None where there is none)."""
    starts = span_starts(tokenizer, ids, n)
    return int(starts[rng.randrange(starts.numel())]) if starts.numel() else None


@functools.lru_cache(maxsize=1)
def held_out_documents(path: Path = PROSE_DIR / HELDOUT_FILE) -> tuple[str, ...]:
    """The held-out prose documents (paragraphs joined by newlines), read once."""
    return tuple("\n".join(d) for d in read_documents(path))


def make_infill_sample(
    tokenizer: Any,
    context_tokens: int,
    depth: float,
    seed: int,
    docs: Sequence[str] | None = None,
    bounds: tuple[int, int] = SPAN_TOKENS,
) -> InfillSample:
    """About ``context_tokens`` tokens of ``docs`` (default: the held-out prose) around a span of
    ``bounds`` tokens, the marker at ``depth`` of the context; deterministic in all arguments."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    docs = list(docs) if docs is not None else list(held_out_documents())
    room = context_tokens - len(_encode(tokenizer, GAP))
    if room < 0 or not docs:
        raise ValueError(f"{INFILLING}: no room for a context of {context_tokens} tokens")
    rng = random.Random(f"infilling:{context_tokens}:{depth}:{seed}")
    n = rng.randint(*bounds)
    first = rng.randrange(len(docs))
    for k in (first + i for i in range(len(docs))):
        k %= len(docs)
        ids = torch.tensor(_encode(tokenizer, docs[k]), dtype=torch.long)
        start = pick_span(tokenizer, ids, n, rng)
        if start is not None:
            break
    else:
        raise ValueError(f"{INFILLING}: no document holds a span of {n} tokens")
    doc = ids.tolist()
    sep = _encode(tokenizer, DOC_SEPARATOR)
    n_before = round(depth * room)
    before, i = doc[:start], k
    while len(before) < n_before:
        i = (i - 1) % len(docs)
        before = _encode(tokenizer, docs[i]) + sep + before
    after, j = doc[start + n :], k
    while len(after) < room - n_before:
        j = (j + 1) % len(docs)
        after = after + sep + _encode(tokenizer, docs[j])
    prefix = tokenizer.decode(before[len(before) - n_before :]) if n_before else ""
    suffix = tokenizer.decode(after[: room - n_before])
    answer_ids = tuple(doc[start : start + n])
    context = prefix + GAP + suffix
    return InfillSample(
        context=context,
        question=QUESTION,
        answer=tokenizer.decode(list(answer_ids)),
        answer_ids=answer_ids,
        depth=depth,
        context_tokens=len(_encode(tokenizer, context)),
        span_tokens=n,
        document=k,
    )


def make_eval_sample(tokenizer: Any, context_tokens: int, depth: float, seed: int) -> InfillSample:
    """The sample ``pdllm eval --tasks infilling`` scores: held-out prose, spans of 64-256 tokens."""
    if context_tokens < SPAN_TOKENS[0]:
        raise ValueError(
            f"{INFILLING}: context length {context_tokens} is too short (at least {SPAN_TOKENS[0]})"
        )
    return make_infill_sample(tokenizer, context_tokens, depth, seed)


def infill_gen_length(sample: InfillSample, block_length: int) -> int:
    """Response slots for ``sample``: its span and an EOS, rounded up to whole blocks."""
    return -(-(sample.span_tokens + 1) // block_length) * block_length


def score_infill(got: Sequence[int], want: Sequence[int]) -> PassageScore:
    """Token accuracy: the share of the span's tokens that the response (token ids, trimmed at EOS) has at
    the same position; a short response misses the rest, extra tokens cost nothing more. Exact: the same ids."""
    hits = sum(g == w for g, w in zip(got, want, strict=False))
    return PassageScore(
        exact=list(got) == list(want), token_accuracy=hits / len(want) if want else float(not got)
    )
