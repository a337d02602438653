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

Block-decoding masks (``block_mask_share``, default 0: no random number drawn) give a share of the ``sft`` /
``chunk`` rows the mask a left-to-right block decoder creates: the generation region split into blocks of
``block_mask_length`` from its first token, the blocks before a uniformly drawn one clean, that block masked
at the row's ratio, every later token masked. This module draws which rows and which block
(``Batch.block_bounds``); ``objective.py`` draws the masks. ``diff_task`` rows keep one ratio over the whole
row: their context is masked too, not the clean prompt a block decoder reads.

The answer region is the answer followed by EOS up to a random generation length, as the decoder sees it.
Batches are produced on CPU worker processes by slicing the pre-tokenized haystack. Each row's token layout
is ``row_layouts.py``'s; this module draws the length and mode and stacks the rows into a :class:`Batch`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch.utils.data import IterableDataset, get_worker_info

from .row_layouts import RowBuilder

MODES = ("text", "diff_task", "sft", "chunk", "causal", "recall")


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
    # Share of the sft / chunk rows masked as a block decoder sees them (see the module docstring), blocks of
    # block_mask_length tokens from the generation region's start; 0 draws nothing (older configs).
    block_mask_share: float = 0.0
    block_mask_length: int = 32


@dataclass
class Batch:
    mode: str
    ids: torch.Tensor  # [B, T] int64
    loss_region: torch.Tensor  # [B, T] bool: positions that may be masked (diffusion) / predicted (causal)
    answer_region: torch.Tensor  # [B, T] bool: the answer's own tokens (not the EOS padding after it)
    segments: torch.Tensor | None = None  # [B, T] int16 chunk index, -1 for question + answer
    sees_query: torch.Tensor | None = None  # [B] bool: chunk tokens also attend to question + answer
    # [B, 2] int64: the current block [start, end) of a block-decoding row, (-1, -1) for other rows; None
    # where the batch has no block-decoding draw (block_mask_share 0, or a mode other than sft / chunk).
    block_bounds: torch.Tensor | None = None


class BatchBuilder(RowBuilder):
    """Draws a batch: its length (curriculum first), its mode (causal phase first), then one row of that
    mode's layout per slot, stacked with the regions the loss reads."""

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
        if answer_only and cfg.block_mask_share > 0:
            batch.block_bounds = block_bounds(loss_region, cfg.block_mask_share, cfg.block_mask_length, rng)
        return batch


def block_bounds(region: torch.Tensor, share: float, length: int, rng: random.Random) -> torch.Tensor:
    """``[B, 2]`` int64: for a ``share`` of the rows, the current block ``[start, end)`` of a block decoder.

    Blocks of ``length`` tokens start at the first token of the row's last run of ``region`` (the answer
    being generated, with its EOS padding); the block is drawn uniformly among them and ends at most at the
    run's end. Earlier runs (multi_needle's earlier answers) lie before it, as prompt. Other rows: -1.
    """
    out = torch.full((region.shape[0], 2), -1, dtype=torch.int64)
    for r in range(region.shape[0]):
        if rng.random() >= share:
            continue
        idx = region[r].nonzero().flatten()
        if idx.numel() == 0:
            continue
        gaps = (idx[1:] - idx[:-1] > 1).nonzero().flatten()
        first = int(idx[int(gaps[-1]) + 1]) if gaps.numel() else int(idx[0])
        last = int(idx[-1]) + 1
        start = first + length * rng.randrange(-(-(last - first) // length))
        out[r, 0], out[r, 1] = start, min(start + length, last)
    return out


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
