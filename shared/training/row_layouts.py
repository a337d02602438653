"""One training row of each layout, exactly ``t`` tokens: :class:`RowBuilder` writes the task rows
(``[BOS]`` context, question, answer region), the chunked rows of ``chunk`` mode, the next-token rows of
``causal`` mode, the facts-written-twice rows of ``recall``, haystack and prose windows for ``text``, and the
two optional kinds, long-answer rows (``eval/long_answer.py``'s layout) and infilling rows
(``eval/infilling.py``'s), each drawn only at a weight above 0 so that configs without them draw the rows
they drew before; ``data.py``'s :class:`BatchBuilder` picks the mode and length and stacks the rows.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import torch

from ..eval.infilling import GAP, SPAN_TOKENS, pick_span
from ..eval.infilling import QUESTION as INFILL_QUESTION
from ..eval.long_answer import MAX_DISTRACTORS, PASSAGE_TOKENS, make_passage, plant_paragraphs, question_about
from ..eval.task_facts import TRAIN_TASKS, fact_text
from ..eval.tasks import TaskFactory, format_answer, format_query
from .prose import ProseCorpus

if TYPE_CHECKING:
    # data.py imports this module at run time; the config is needed here for the signature alone.
    from .data import DataConfig

# Every query and answer is shorter (measured: query <= 27 tokens, answer <= 8); slack becomes extra prose.
QUERY_RESERVE = 32
GEN_RESERVE = 9
# Context tokens a task needs at least (distractor facts take up to ~100 tokens).
MIN_ROOM = {"needle_distractors": 160, "multidoc": 120, "two_hop": 64, "multi_needle": 200}
MAX_EXTRA_QA = 3
# Tokens a planted paragraph adds beyond its own: the newlines around it and the re-tokenized start of the
# sentence after it (measured over the haystack: 2 in 94% of places, 3 in 4%, 4 in <1%; more is caught below).
PARAGRAPH_SLACK = 4
# A passage needs a window of lengths this wide to be written reliably (template sentences are <= 30 tokens).
MIN_PASSAGE_WINDOW = 48
# Context tokens an infilling row keeps around its marker at least.
MIN_INFILL_CONTEXT = 64


class RowBuilder:
    """The row layouts over one task factory (haystack and tokenizer) and, for prose rows, one prose corpus."""

    def __init__(
        self, config: DataConfig, factory: TaskFactory, bos: int, eos: int, prose: ProseCorpus | None = None
    ) -> None:
        self.cfg = config
        self.f = factory
        self.bos, self.eos = bos, eos
        self.prose = prose
        if prose is None and (config.prose_text_share > 0 or config.infill_weight > 0):
            raise ValueError("prose_text_share / infill_weight need the prose corpus (DataConfig.prose_file)")
        if config.infill_weight > 0:
            self.infill_query = self.f.encode(format_query(INFILL_QUESTION))
            self.infill_gap = self.f.encode(GAP)

    def _prose_text(self, n: int, rng: random.Random) -> torch.Tensor:
        """``n`` prose tokens from a random paragraph start on (running on into the next documents)."""
        hay = self.prose.hay
        start = int(hay.offsets[rng.randrange(hay.num_sentences)])
        return hay.ids[torch.arange(start, start + n) % hay.num_tokens].long()

    def _infill_fixed(self, extra: int) -> int:
        """Tokens of an infilling row besides its context and span: BOS, marker, query, EOS padding."""
        return 1 + len(self.infill_gap) + len(self.infill_query) + 1 + extra

    def _is_infill(self, t: int, rng: random.Random) -> bool:
        """Whether this row is an infilling row (no draw at weight 0 or where no span fits)."""
        w = self.cfg.infill_weight
        if w <= 0:
            return False
        fits = t - self._infill_fixed(self.cfg.max_extra_gen) - MIN_INFILL_CONTEXT >= SPAN_TOKENS[0]
        return fits and rng.random() < w

    def _infill(self, t: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[BOS] prefix [BLANK] suffix question span EOS-padding, exactly ``t`` tokens: the span (64-256
        tokens, word-aligned by ``pick_span``) lies in one prose document, prefix and suffix are the prose
        around it, the marker at a uniform depth. Returns (ids, generation-region mask, answer mask)."""
        prose, extra = self.prose, rng.randint(0, self.cfg.max_extra_gen)
        fixed = self._infill_fixed(extra)
        n = rng.randint(SPAN_TOKENS[0], min(SPAN_TOKENS[1], t - fixed - MIN_INFILL_CONTEXT))
        hay = prose.hay
        for _ in range(200):
            a, b = prose.doc_tokens(rng.randrange(prose.num_documents))
            start = pick_span(self.f.tokenizer, hay.ids[a:b].long(), n, rng)
            if start is not None:
                break
        else:
            raise RuntimeError(f"no prose document holds a span of {n} tokens")
        s, room = a + start, t - fixed - n
        before = round(rng.random() * room)
        pieces = [
            torch.tensor([self.bos]),
            hay.ids[torch.arange(s - before, s) % hay.num_tokens].long(),
            torch.tensor(self.infill_gap),
            hay.ids[torch.arange(s + n, s + n + room - before) % hay.num_tokens].long(),
            torch.tensor(self.infill_query),
            hay.ids[s : s + n].long(),
            torch.full((1 + extra,), self.eos),
        ]
        pos = torch.arange(t)
        first = t - n - 1 - extra
        return torch.cat(pieces), pos >= first, (pos >= first) & (pos < first + n)

    def _hay(self, n: int, rng: random.Random) -> torch.Tensor:
        """``n`` prose tokens ending at a sentence boundary (so a context can follow them cleanly)."""
        hay = self.f.hay
        end = int(hay.offsets[rng.randrange(1, hay.num_sentences + 1)])
        return hay.ids[(torch.arange(end - n, end) % hay.num_tokens)].long()

    def _task(self, rng: random.Random, room: int) -> str:
        task = rng.choices(TRAIN_TASKS, weights=self.cfg.task_weights)[0]
        # Short sequences cannot hold many facts: fall back to the single needle there.
        return task if room >= MIN_ROOM.get(task, 0) else "needle"

    def _gen(self, answer: list[int], rng: random.Random) -> list[int]:
        return answer + [self.eos] * (1 + rng.randint(0, self.cfg.max_extra_gen))

    def _passage_max(self, t: int) -> int:
        """Longest passage a row of ``t`` tokens holds twice, beside the question and the EOS padding."""
        fixed = 1 + QUERY_RESERVE + 2 + self.cfg.max_extra_gen + PARAGRAPH_SLACK
        return min(PASSAGE_TOKENS[1], (t - fixed) // 2)

    def _long(self, t: int, rng: random.Random) -> bool:
        """Whether this task row is a long-answer row (no draw at weight 0 or where no passage fits)."""
        w = self.cfg.long_answer_weight
        fits = self._passage_max(t) >= PASSAGE_TOKENS[0] + MIN_PASSAGE_WINDOW
        return w > 0 and fits and rng.random() < w

    def _long_answer(self, t: int, rng: random.Random, pad: bool) -> tuple[torch.Tensor, int, int]:
        """[BOS] prose with planted paragraphs, question, gold paragraph, EOS (``pad``: up to
        ``max_extra_gen`` more): exactly ``t`` tokens. Returns (ids, answer start, answer tokens).

        Prose is whole sentences of the factory's haystack (the training split), the layout is
        ``plant_paragraphs``'s (as evaluated); distractor paragraphs fill the room the gold one leaves, up
        to ``MAX_DISTRACTORS``; the remaining few tokens are prose ending at a sentence boundary in front.
        """
        tok, lo = self.f.tokenizer, PASSAGE_TOKENS[0]
        name, gold = make_passage(tok, rng, (lo, self._passage_max(t)))
        query = self.f.encode(format_query(question_about(name)))
        answer = self.f.encode(format_answer(gold))
        tail = query + answer + [self.eos] * (1 + (rng.randint(0, self.cfg.max_extra_gen) if pad else 0))
        room = t - 1 - len(tail)  # context tokens
        free = room - len(self.f.encode(gold)) - PARAGRAPH_SLACK
        others: list[str] = []
        for _ in range(2 * MAX_DISTRACTORS):
            if len(others) == MAX_DISTRACTORS or free - PARAGRAPH_SLACK < lo + MIN_PASSAGE_WINDOW:
                break
            other, text = make_passage(tok, rng, (lo, min(PASSAGE_TOKENS[1], free - PARAGRAPH_SLACK)))
            if other != name:
                others.append(text)
                free -= len(self.f.encode(text)) + PARAGRAPH_SLACK
        hay, prose = self.f.hay, []
        i = rng.randrange(hay.num_sentences)
        while (n := int(hay.offsets[i + 1] - hay.offsets[i])) <= free:  # whole sentences while they fit
            free -= n
            prose.append(hay.sentences[i])
            i = (i + 1) % hay.num_sentences
        depth = rng.random()
        ctx = self.f.encode(plant_paragraphs(prose, gold, others, depth, rng))
        while len(ctx) > room and prose:  # rare: a layout longer than PARAGRAPH_SLACK allows
            prose.pop()
            ctx = self.f.encode(plant_paragraphs(prose, gold, others, depth, rng))
        pieces = [
            torch.tensor([self.bos]),
            self._hay(room - len(ctx), rng),
            torch.tensor(ctx),
            torch.tensor(tail),
        ]
        return torch.cat(pieces), t - len(tail) + len(query), len(answer)

    def _vanilla(self, t: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[BOS] context (question answer)* question answer-region, exactly ``t`` tokens.

        Returns (ids, generation-region mask, answer-token mask). Only multi_needle has extra question /
        answer pairs; their answers are targets too (several retrievals per sequence).
        """
        if self._is_infill(t, rng):
            return self._infill(t, rng)
        if self._long(t, rng):
            ids, start, n_answer = self._long_answer(t, rng, pad=True)
            pos = torch.arange(t)
            return ids, pos >= start, (pos >= start) & (pos < start + n_answer)
        room = t - 1 - QUERY_RESERVE - GEN_RESERVE - self.cfg.max_extra_gen
        task = self._task(rng, room)
        pairs = 1 + MAX_EXTRA_QA if task == "multi_needle" else 1
        n_ctx = t - 1 - pairs * (QUERY_RESERVE + GEN_RESERVE) - self.cfg.max_extra_gen
        if task == "multi_needle" and n_ctx < MIN_ROOM[task]:
            task, n_ctx = "needle", room
        ctx, qa, _ = self.f.build_multi_ids(task, n_ctx, rng.random(), rng)
        (query, answer), extras = qa[0], qa[1:]
        gen = self._gen(answer, rng)
        tail, answer_mask = [], []
        for q, a in [*extras, (query, gen)]:
            tail += q + a
            answer_mask += [False] * len(q) + [True] * len(a)
        slack = t - 1 - n_ctx - len(tail)
        ids = torch.cat([torch.tensor([self.bos]), self._hay(slack, rng), ctx, torch.tensor(tail)])
        targets = torch.zeros(t, dtype=torch.bool)
        targets[t - len(tail) :] = torch.tensor(answer_mask)
        gen_region = targets.clone()
        is_answer = targets.clone()
        is_answer[t - len(gen) + len(answer) :] = False  # the EOS padding is not part of the answer
        return ids, gen_region, is_answer

    def _chunked(self, t: int, rng: random.Random) -> tuple[torch.Tensor, int, int, torch.Tensor]:
        avail = t - QUERY_RESERVE - GEN_RESERVE - self.cfg.max_extra_gen
        sizes = [c for c in self.cfg.chunk_sizes if 2 * c <= avail] or [avail // 2]
        c = rng.choice(sizes)
        keep = avail // c
        extra = rng.randint(0, keep)
        n_all = keep + extra
        task = self._task(rng, n_all * (c - 1))
        ctx, query, answer, spans = self.f.build_ids(task, n_all * (c - 1), rng.random(), rng)
        gold = sorted({i // (c - 1) for s, e in spans for i in (s, e - 1)})
        gold = gold[:keep]
        others = [i for i in range(n_all) if i not in gold]
        chosen = sorted(gold + rng.sample(others, keep - len(gold)))
        gen = self._gen(answer, rng)
        slack = t - keep * c - len(query) - len(gen)
        pieces, seg = [], []
        for j, i in enumerate(chosen):
            body = ctx[i * (c - 1) : (i + 1) * (c - 1)]
            if j == 0:
                body = torch.cat([self._hay(slack, rng), body])
            pieces.append(torch.cat([torch.tensor([self.bos]), body]))
            seg.append(torch.full((body.numel() + 1,), j, dtype=torch.int16))
        pieces.append(torch.tensor(query + gen))
        seg.append(torch.full((len(query) + len(gen),), -1, dtype=torch.int16))
        return torch.cat(pieces), t - len(gen), len(answer), torch.cat(seg)

    def _causal(self, t: int, rng: random.Random) -> tuple[torch.Tensor, int, int]:
        if self._long(t, rng):
            # Always with the gold paragraph: a 128-256-token answer without its source is noise to learn,
            # and chunk scoring reads only the answer's first tokens (the name, which the question holds).
            return self._long_answer(t, rng, pad=False)
        n_ctx = t - 1 - QUERY_RESERVE - GEN_RESERVE
        task = self._task(rng, n_ctx)
        ctx, query, answer, spans = self.f.build_ids(task, n_ctx, rng.random(), rng)
        if rng.random() < self.cfg.p_causal_negative:
            keep = torch.ones(ctx.numel(), dtype=torch.bool)
            for s, e in spans:
                keep[s:e] = False
            ctx = ctx[keep]
        tail = query + answer + [self.eos]
        slack = t - 1 - ctx.numel() - len(tail)
        ids = torch.cat([torch.tensor([self.bos]), self._hay(slack, rng), ctx, torch.tensor(tail)])
        return ids, t - len(answer) - 1, len(answer)

    def _recall(self, t: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
        """Prose with facts (and a few prose sentences) each written twice at random sentence boundaries.

        Under random masking, a masked token of one mention is recoverable only from the other mention,
        found by matching its key (a name): dense supervision for the retrieval the tasks need.
        Returns (ids [t], mask of the repeated tokens [t]).
        """
        items = [self.f.encode(fact_text(rng)) for _ in range(rng.randint(*self.cfg.recall_facts))]
        hay = self.f.hay
        for _ in range(rng.randint(0, 3)):
            i = rng.randrange(hay.num_sentences)
            items.append(hay.ids[int(hay.offsets[i]) : int(hay.offsets[i + 1])][:48].tolist())
        while items and 2 * sum(len(x) for x in items) > (t - 1) // 2:
            items.pop()
        n_base = t - 1 - 2 * sum(len(x) for x in items)
        start = int(hay.offsets[rng.randrange(hay.num_sentences)])
        base = hay.ids[torch.arange(start, start + n_base) % hay.num_tokens].long()
        bounds = hay.offsets[(hay.offsets >= start) & (hay.offsets <= start + n_base)] - start
        cuts = bounds.tolist() or [0]
        slots = sorted((rng.choice(cuts), rng.random(), x) for x in items for _ in range(2))
        pieces, marks, cur = [torch.tensor([self.bos])], [torch.zeros(1, dtype=torch.bool)], 0
        for cut, _, x in slots:
            pieces += [base[cur:cut], torch.tensor(x)]
            marks += [torch.zeros(cut - cur, dtype=torch.bool), torch.ones(len(x), dtype=torch.bool)]
            cur = cut
        pieces.append(base[cur:])
        marks.append(torch.zeros(n_base - cur, dtype=torch.bool))
        return torch.cat(pieces), torch.cat(marks)
