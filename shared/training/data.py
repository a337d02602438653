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

The answer region is the answer followed by EOS up to a random generation length, as the decoder sees it.
Batches are produced on CPU worker processes by slicing the pre-tokenized haystack.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..eval.tasks import TASKS, TaskFactory

MODES = ("text", "diff_task", "sft", "chunk", "causal")
# Every query and answer is shorter (measured: query <= 27 tokens, answer <= 8); slack becomes extra prose.
QUERY_RESERVE = 32
GEN_RESERVE = 9
# Context tokens a task needs at least (distractor facts take up to ~100 tokens).
MIN_ROOM = {"needle_distractors": 160, "multidoc": 120, "two_hop": 64}


@dataclass(frozen=True)
class DataConfig:
    seq_len: int = 1024
    tokens_per_batch: int = 65536
    length_fractions: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
    length_weights: tuple[float, ...] = (0.15, 0.25, 0.25, 0.35)
    mode_weights: tuple[float, ...] = (0.1, 0.15, 0.3, 0.2, 0.25)  # in MODES order
    task_weights: tuple[float, ...] = (0.4, 0.25, 0.2, 0.15)  # in TASKS order
    max_extra_gen: int = 24  # answer region = answer + EOS + up to this many more EOS
    chunk_sizes: tuple[int, ...] = (64, 128, 256, 512)
    p_chunk_sees_query: float = 0.3
    p_causal_negative: float = 0.5


@dataclass
class Batch:
    mode: str
    ids: torch.Tensor  # [B, T] int64
    loss_region: torch.Tensor  # [B, T] bool: positions that may be masked (diffusion) / predicted (causal)
    answer_region: torch.Tensor  # [B, T] bool
    segments: torch.Tensor | None = None  # [B, T] int16 chunk index, -1 for question + answer
    sees_query: torch.Tensor | None = None  # [B] bool: chunk tokens also attend to question + answer


class BatchBuilder:
    def __init__(self, config: DataConfig, factory: TaskFactory, bos: int, eos: int) -> None:
        self.cfg = config
        self.f = factory
        self.bos, self.eos = bos, eos

    def _hay(self, n: int, rng: random.Random) -> torch.Tensor:
        """``n`` prose tokens ending at a sentence boundary (so a context can follow them cleanly)."""
        hay = self.f.hay
        end = int(hay.offsets[rng.randrange(1, hay.num_sentences + 1)])
        return hay.ids[(torch.arange(end - n, end) % hay.num_tokens)].long()

    def _task(self, rng: random.Random, room: int) -> str:
        task = rng.choices(TASKS, weights=self.cfg.task_weights)[0]
        # Short sequences cannot hold many facts: fall back to the single needle there.
        return task if room >= MIN_ROOM.get(task, 0) else "needle"

    def _gen(self, answer: list[int], rng: random.Random) -> list[int]:
        return answer + [self.eos] * (1 + rng.randint(0, self.cfg.max_extra_gen))

    def _vanilla(self, t: int, rng: random.Random) -> tuple[torch.Tensor, int]:
        """[BOS] context query answer-region of exactly ``t`` tokens; returns (ids, answer start)."""
        n_ctx = t - 1 - QUERY_RESERVE - GEN_RESERVE - self.cfg.max_extra_gen
        task = self._task(rng, n_ctx)
        ctx, query, answer, _ = self.f.build_ids(task, n_ctx, rng.random(), rng)
        gen = self._gen(answer, rng)
        slack = t - 1 - n_ctx - len(query) - len(gen)
        ids = torch.cat([torch.tensor([self.bos]), self._hay(slack, rng), ctx, torch.tensor(query + gen)])
        return ids, t - len(gen)

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
        return torch.cat(pieces), t - len(gen), torch.cat(seg)

    def _causal(self, t: int, rng: random.Random) -> tuple[torch.Tensor, int]:
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
        return ids, t - len(answer) - 1

    def build(self, rng: random.Random) -> Batch:
        cfg = self.cfg
        frac = rng.choices(cfg.length_fractions, weights=cfg.length_weights)[0]
        t = int(cfg.seq_len * frac)
        b = max(1, cfg.tokens_per_batch // t)
        mode = rng.choices(MODES, weights=cfg.mode_weights)[0]
        rows, starts, segs = [], [], []
        for _ in range(b):
            if mode == "text":
                rows.append(torch.cat([torch.tensor([self.bos]), self._hay(t - 1, rng)]))
                starts.append(t)
            elif mode == "chunk":
                ids, start, seg = self._chunked(t, rng)
                rows.append(ids)
                starts.append(start)
                segs.append(seg)
            elif mode == "causal":
                ids, start = self._causal(t, rng)
                rows.append(ids)
                starts.append(start)
            else:
                ids, start = self._vanilla(t, rng)
                rows.append(ids)
                starts.append(start)
        ids = torch.stack(rows)
        pos = torch.arange(t)[None]
        answer_region = pos >= torch.tensor(starts)[:, None]
        answer_only = mode in ("sft", "chunk")
        loss_region = answer_region.clone() if answer_only else (pos >= 1).expand(b, t).clone()
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
        while True:
            yield self.builder.build(rng)


def chunk_attention_mask(segments: torch.Tensor, sees_query: torch.Tensor) -> torch.Tensor:
    """Boolean ``[B, 1, T, T]`` (True = may attend) for a chunk-mode batch."""
    q = segments[:, :, None].long()
    k = segments[:, None, :].long()
    same_chunk = (q == k) & (q >= 0)
    from_query = (q < 0).expand_as(same_chunk)
    to_query = (k < 0) & sees_query[:, None, None]
    return (same_chunk | from_query | to_query)[:, None]
