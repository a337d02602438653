"""Sparse-dLLM (Song et al., 2025, ``../shared/papers/sparse-dllm.txt``): delayed bidirectional sparse caching.

Per block of the response (block length b, local rows N, the block at rows ``[o, o + b)``):

- **delayed cache updates** (the paper's Algorithms 2-4, delay x, default 1): the block's first x steps are
  plain full steps (cache state 0: no cache is read or written); step x is a full step that also takes the
  cache (state 1); later steps forward the block only (state 2). The K/V outside the block move most between
  a block's first and second step (the paper's Fig. 4), so the cache is taken one step late;
- **bidirectional eviction** (Algorithm 1): at the caching step, per layer, the candidates are all rows
  outside the block, before it (prefix) *and* after it (suffix, the later masked blocks):
  ``K_f = [K[:o], K[o + b:]]``. Their saliency is the block queries' attention logits
  ``A = Q_b K_f^T / sqrt(d)``, averaged over the block's queries and all query heads (the released code
  averages the queries first, ``mean(Q_b) K_f^T``: the same by linearity), max-pooled over neighbouring
  candidates (kernel s, stride 1, padding s // 2; SnapKV's trick, so a salient token keeps its
  neighbours), and the top ``floor((N - b) * r)`` candidates are kept: the cache holds their K/V only,
  one selection per layer shared by its KV heads, as in the released code;
- **full refresh at block transitions**: every block starts over with plain steps and takes a new cache.

A cached step's queries (the block) attend to the kept rows and to their own fresh K/V; the caching step
itself attends to every row. With a shifted-logit model (Dream) the row before the block is forwarded too
(the block's first token is predicted from it, as for the dual cache), so it is always seen fresh whether
kept or not. Ties among pooled scores (max-pooling makes them) go to the earlier row, on every device.
Under pdllm the static chunk KV is the method's and is not evicted, and the question's local rows are
always kept (``StepContext.protected``; **choice**): the candidates are the response rows outside the block.
In the paper the question competes for the r share with the whole prompt's context, where its salient
tokens survive; among pdllm's few local rows, r = 0.5 would drop half the question itself. Measured on the
shipped model (needle at 16x its training length, pdllm, block 4, 40 samples): evicting the question
cost 17.5 points (80% against 97.5% without a policy); protected, the accuracy is plain decoding's.

**Exact identities** (tested): with r = 1 every candidate is kept, so the cache is the dual cache's
(``[cache[:lo], fresh, cache[hi:]]`` over the same rows): delay 0 and r = 1 is Fast-dLLM's dual cache token
for token; delay 1 and r = 1 is the dual cache refreshed at each block's first two steps. With at most
x + 1 steps per block, or ``refresh_steps`` 1, every step is a full step: plain decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdllm.shared.decode_policy_settings import paper_default

from .base import StepContext, StepPlan


def saliency(q: torch.Tensor, k: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Importance ``[N - (end - start)]`` of every local row outside the block ``[start, end)`` (rows in
    order, the block left out): the block queries' attention logits, averaged over queries and heads.

    ``q`` ``[1, Hq, N, D]`` and ``k`` ``[1, Hkv, N, D]`` from a forward of all N local rows. Computed in
    float32: bf16 logits would tie far more often and make the selection depend on rounding.
    """
    if q.shape[0] != 1 or k.shape[0] != 1:
        raise ValueError(f"Sparse-dLLM selects per request: batch 1, got q {tuple(q.shape)}")
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[3]
    q_mean = q[0, :, start:end].float().mean(dim=1)  # [Hq, D]
    candidates = torch.cat([k[0, :, :start], k[0, :, end:]], dim=1).float()  # [Hkv, M, D]
    # Query head h reads KV head h // group (GQA); grouping the queries avoids repeating the keys.
    grouped = q_mean.view(kv_heads, heads // kv_heads, dim)
    logits = torch.einsum("hgd,hmd->hgm", grouped, candidates) / math.sqrt(dim)
    return logits.mean(dim=(0, 1))


def keep_rows(
    scores: torch.Tensor, start: int, end: int, retention: float, kernel: int, protected: int = 0
) -> torch.Tensor:
    """The local rows a layer keeps (ascending), from the candidates' ``scores`` (:func:`saliency`): the
    ``protected`` first rows, and the top ``floor((M - protected) r)`` of the other M - protected."""
    m = scores.shape[0]
    pooled = scores
    if kernel > 1:  # max_pool1d pads with -inf, so an edge candidate pools over its real neighbours only
        pooled = F.max_pool1d(scores[None, None], kernel, stride=1, padding=kernel // 2)[0, 0]
    n = int((m - protected) * retention)  # the paper's floor(|I| * r)
    # A stable descending sort breaks ties by position (torch.topk's choice among ties is unspecified).
    chosen = torch.sort(pooled[protected:], descending=True, stable=True).indices[:n] + protected
    chosen = torch.cat([torch.arange(protected, device=chosen.device), chosen])
    rows = chosen + (chosen >= start).to(chosen.dtype) * (end - start)  # candidate -> local row
    return torch.sort(rows).values


def kept_count(rows: int, keep: SaliencyKeep) -> int:
    """How many local rows ``keep`` keeps out of ``rows`` (a fixed count: the batched rounds' cache slots)."""
    return keep.protected + int((rows - (keep.end - keep.start) - keep.protected) * keep.retention)


@dataclass(frozen=True)
class SaliencyKeep:
    """The caching step's per-layer selection (a :class:`~.base.RowSelector`) for the block
    ``[start, end)``; rows ``[0, protected)`` are always kept (``StepContext.protected``)."""

    start: int
    end: int
    retention: float
    kernel: int
    protected: int = 0

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        scores = saliency(q, k, self.start, self.end)
        return keep_rows(scores, self.start, self.end, self.retention, self.kernel, self.protected)


@dataclass(frozen=True)
class SparseDLLM:
    """Plain steps until ``delay_steps`` into a block, then a full step that takes a cache of the
    saliency-selected rows outside the block, then block-only steps over it. ``refresh_steps``: also take
    a new cache every N steps within a block (1: every step is full, plain decoding)."""

    retention: float = paper_default("sparse_retention")
    pool_kernel: int = paper_default("sparse_pool_kernel")
    delay_steps: int = paper_default("sparse_delay_steps")
    refresh_steps: int | None = None
    name: str = "sparse-dllm"

    def __post_init__(self) -> None:
        # The settings schema says the same for users; this guards direct construction.
        if not 0 < self.retention <= 1 or self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ValueError(f"need 0 < retention <= 1 and an odd pool kernel >= 1, got {self}")
        if self.delay_steps < 0 or (self.refresh_steps is not None and self.refresh_steps < 1):
            raise ValueError(f"need delay_steps >= 0 and refresh_steps >= 1, got {self}")

    def plan(self, ctx: StepContext) -> StepPlan:
        i = ctx.step_in_block
        if i < self.delay_steps:
            return StepPlan(refresh=True, lo=0, hi=ctx.rows, record=False)
        every = self.refresh_steps
        if i == self.delay_steps or (every is not None and i % every == 0):
            keep = SaliencyKeep(
                ctx.block_start, ctx.block_end, self.retention, self.pool_kernel, ctx.protected
            )
            return StepPlan(refresh=True, lo=0, hi=ctx.rows, keep=keep)
        return StepPlan(refresh=False, lo=ctx.block_start - ctx.lead, hi=ctx.block_end)
