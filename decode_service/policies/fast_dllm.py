"""Fast-dLLM's approximate KV caches (Wu et al., 2025), as described in Polestar-Cache (§A.2, eq. 7),
Sparse-dLLM (related work) and Prefilling-dLLM (related work).

Semi-autoregressive decoding fills one block of the response at a time. At a block's first step the whole
local sequence is forwarded and every row's K/V is cached (the refresh: the block just completed enters
the cache with its final tokens). The block's later steps reuse that cache:

- **prefix cache**: the rows before the block are read from the cache; the block and everything after it
  (the still-masked later blocks) are forwarded, ``K/V = [cache[:b], fresh[b:]]``;
- **dual cache**: the later blocks are read from the cache too; only the block is forwarded,
  ``K/V = [cache[:b], fresh[b:e], cache[e:]]``, so a cached step costs O(block) rows.

Queries of the forwarded rows attend to all of those K/V (plus, under pdllm, the static chunk KV). With a
shifted-logit model (Dream) the row just before the block is forwarded too, because the block's first token
is predicted from its hidden state; its fresh K/V replace the cached ones for that step (exact Dream
logits at the cost of one row; Fast-dLLM's own Dream code instead reads that token from its own row).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import StepContext, StepPlan, refresh_due


@dataclass(frozen=True)
class PrefixCache:
    """Cache the KV before the current block; forward the block and the rows after it."""

    refresh_steps: int | None = None
    name: str = "prefix-cache"

    def plan(self, ctx: StepContext) -> StepPlan:
        if refresh_due(ctx, self.refresh_steps):
            return StepPlan.full(ctx)
        return StepPlan(refresh=False, lo=ctx.block_start - ctx.lead, hi=ctx.rows)


@dataclass(frozen=True)
class DualCache:
    """Cache the KV before and after the current block; forward the block only."""

    refresh_steps: int | None = None
    name: str = "dual-cache"

    def plan(self, ctx: StepContext) -> StepPlan:
        if refresh_due(ctx, self.refresh_steps):
            return StepPlan.full(ctx)
        return StepPlan(refresh=False, lo=ctx.block_start - ctx.lead, hi=ctx.block_end)
