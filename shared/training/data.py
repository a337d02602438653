"""Training batches for the three ways the engine uses the model.

Every batch has one *mode* (one attention pattern for the whole batch, so dense batches keep the fused
attention kernels) and one sequence length:

- ``text``: haystack prose, random masking (masked-diffusion language modelling).
- ``diff_task``: [BOS] context question answer, random masking over the whole sequence.
- ``sft``: the same layout, only answer tokens masked (vanilla decoding).
- ``chunk``: [BOS chunk]...[BOS chunk] question answer, chunk tokens attend only within their chunk
  (sometimes also to question + answer), question + answer attend to everything; answer masked. This is
  how pdllm decodes over independently prefilled chunk KV.
- ``causal``: [BOS chunk] question answer [EOS] under a causal mask, next-token loss: chunk scoring
  (self-information of the question, pseudo-label likelihood). Half the chunks lack the gold fact, so
  the likelihood of the question and answer learns to depend on it.

Long-answer rows ("Quote the paragraph about <name>.", ``eval/long_answer.py``) take the share
``long_answer_weight`` of the ``diff_task`` / ``sft`` / ``causal`` task rows that can hold a passage. The
weight is a field of its own, not a sixth ``task_weights`` entry, so configs without it draw exactly the
rows they drew before (no random number is drawn for it at weight 0).

Prose (``prose.py``: documentation that Debian packages ship, the training split) enters through two fields
of its own, both without effect at their default 0 (no random number drawn): ``prose_text_share`` of the
``text`` rows are prose windows instead of haystack, and ``infill_weight`` of the ``diff_task`` / ``sft``
rows are infilling rows (a 64-256-token span of a prose document cut out, ``[BLANK]`` in its place, the span
as the answer: ``eval/infilling.py``'s layout, as evaluated).

The answer region is the answer followed by EOS up to a random generation length, as the decoder sees it.
Batches are produced on CPU worker processes by slicing the pre-tokenized haystack.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..eval.infilling import GAP, SPAN_TOKENS, pick_span
from ..eval.infilling import QUESTION as INFILL_QUESTION
from ..eval.long_answer import MAX_DISTRACTORS, PASSAGE_TOKENS, make_passage, plant_paragraphs, question_about
from ..eval.tasks import TRAIN_TASKS, TaskFactory, fact_text, format_answer, format_query
from .prose import ProseCorpus

MODES = ("text", "diff_task", "sft", "chunk", "causal", "recall")
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


@dataclass(frozen=True)
class DataConfig:
    seq_len: int = 1024
    tokens_per_batch: int = 65536
    length_fractions: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
    length_weights: tuple[float, ...] = (0.15, 0.25, 0.25, 0.35)
    # Before this many (global) steps, lengths follow curriculum_weights: short sequences carry more
    # questions per token, which is what gets retrieval going.
    curriculum_steps: int = 0
    # Before this many (global) steps, modes follow causal_phase_weights. Retrieval circuits form far
    # sooner under next-token prediction than under bidirectional denoising, and then carry over to the
    # diffusion modes (scripts/recall_toy.py shows both; Dream itself starts from an autoregressive model).
    causal_phase_steps: int = 0
    causal_phase_weights: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0, 1.0, 0.0)
    curriculum_weights: tuple[float, ...] = (0.6, 0.3, 0.1, 0.0)
    mode_weights: tuple[float, ...] = (0.05, 0.1, 0.25, 0.15, 0.25, 0.2)  # in MODES order
    task_weights: tuple[float, ...] = (0.35, 0.2, 0.15, 0.1, 0.2)  # in TRAIN_TASKS order
    max_extra_gen: int = 24  # answer region = answer + EOS + up to this many more EOS
    chunk_sizes: tuple[int, ...] = (64, 128, 256, 512)
    p_chunk_sees_query: float = 0.3
    p_causal_negative: float = 0.5
    p_causal_recall: float = 0.3  # causal rows drawn from the recall layout (induction: copy 2nd mention)
    recall_facts: tuple[int, int] = (3, 10)
    # Share of the diff_task / sft / causal task rows that are long-answer rows, among rows long enough
    # to hold a passage twice (in the context and as the answer); 0 draws nothing (older configs).
    long_answer_weight: float = 0.0
    # Prose documents (``prose.py``'s training split): a path relative to this folder, or absolute; ""
    # reads none. Used by ``text`` rows at ``prose_text_share`` and by infilling rows at ``infill_weight``
    # (share of the diff_task / sft rows whose length holds a span); 0 draws nothing (older configs).
    prose_file: str = ""
    prose_text_share: float = 0.0
    infill_weight: float = 0.0


@dataclass
class Batch:
    mode: str
    ids: torch.Tensor  # [B, T] int64
    loss_region: torch.Tensor  # [B, T] bool: positions that may be masked (diffusion) / predicted (causal)
    answer_region: torch.Tensor  # [B, T] bool: the answer's own tokens (not the EOS padding after it)
    segments: torch.Tensor | None = None  # [B, T] int16 chunk index, -1 for question + answer
    sees_query: torch.Tensor | None = None  # [B] bool: chunk tokens also attend to question + answer


class BatchBuilder:
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

    def _chunked(self, t: int, rng: random.Random) -> tuple[torch.Tensor, int, torch.Tensor]:
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

    def build(self, rng: random.Random, step: int = 1 << 62) -> Batch:
        """One batch; ``step`` (approximate global step) selects the length curriculum."""
        cfg = self.cfg
        weights = cfg.curriculum_weights if step < cfg.curriculum_steps else cfg.length_weights
        frac = rng.choices(cfg.length_fractions, weights=weights)[0]
        t = int(cfg.seq_len * frac)
        b = max(1, cfg.tokens_per_batch // t)
        mode_weights = cfg.causal_phase_weights if step < cfg.causal_phase_steps else cfg.mode_weights
        mode = rng.choices(MODES, weights=mode_weights)[0]
        rows, starts, lens, segs, repeats = [], [], [], [], {}
        vanilla_regions: dict[int, torch.Tensor] = {}
        vanilla_answers: dict[int, torch.Tensor] = {}
        for r in range(b):
            if mode == "recall" or (mode == "causal" and rng.random() < cfg.p_causal_recall):
                ids, repeats[r] = self._recall(t, rng)
                rows.append(ids)
                starts.append(t)
                lens.append(0)
            elif mode == "text":
                share = cfg.prose_text_share
                body = (
                    self._prose_text(t - 1, rng)
                    if share > 0 and rng.random() < share
                    else self._hay(t - 1, rng)
                )
                rows.append(torch.cat([torch.tensor([self.bos]), body]))
                starts.append(t)
                lens.append(0)
            elif mode == "chunk":
                ids, start, n_ans, seg = self._chunked(t, rng)
                rows.append(ids)
                starts.append(start)
                lens.append(n_ans)
                segs.append(seg)
            elif mode == "causal":
                ids, start, n_ans = self._causal(t, rng)
                rows.append(ids)
                starts.append(start)
                lens.append(n_ans)
            else:
                ids, vanilla_regions[r], vanilla_answers[r] = self._vanilla(t, rng)
                rows.append(ids)
                starts.append(t)
                lens.append(0)
        ids = torch.stack(rows)
        pos = torch.arange(t)[None]
        first = torch.tensor(starts)[:, None]
        gen_region = pos >= first
        answer_region = gen_region & (pos < first + torch.tensor(lens)[:, None])
        for r, marked in repeats.items():
            answer_region[r] = marked
        for r, region in vanilla_regions.items():
            gen_region[r] = region
            answer_region[r] = vanilla_answers[r]
        answer_only = mode in ("sft", "chunk")
        loss_region = gen_region if answer_only else (pos >= 1).expand(b, t).clone()
        batch = Batch(mode=mode, ids=ids, loss_region=loss_region, answer_region=answer_region)
        if mode == "chunk":
            batch.segments = torch.stack(segs)
            batch.sees_query = torch.rand(b, generator=torch.Generator().manual_seed(rng.getrandbits(32))) < (
                cfg.p_chunk_sees_query
            )
        return batch


class BatchStream(IterableDataset):
    """Endless batches; worker w of a DataLoader draws from its own seeded stream."""

    def __init__(self, builder: BatchBuilder, seed: int) -> None:
        super().__init__()
        self.builder = builder
        self.seed = seed

    def __iter__(self):
        info = get_worker_info()
        rng = random.Random(self.seed * 1000 + (info.id if info is not None else 0))
        workers = info.num_workers if info is not None else 1
        made = 0
        while True:
            # The loader takes batches from its workers in turn: local count x workers ~ global step.
            yield self.builder.build(rng, made * workers)
            made += 1


def chunk_attention_mask(segments: torch.Tensor, sees_query: torch.Tensor) -> torch.Tensor:
    """Boolean ``[B, 1, T, T]`` (True = may attend) for a chunk-mode batch."""
    q = segments[:, :, None].long()
    k = segments[:, None, :].long()
    same_chunk = (q == k) & (q >= 0)
    from_query = (q < 0).expand_as(same_chunk)
    to_query = (k < 0) & sees_query[:, None, None]
    return (same_chunk | from_query | to_query)[:, None]
