"""The decode-policy interface: the per-step plan a policy returns and the counters of what it saved (the
config that selects one is ``shared/decode_policy.py``'s)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

import torch

from pdllm.decode_service.local_cache import RowsHook


@dataclass(frozen=True)
class StepContext:
    """Where one denoising step stands, in local rows (the rows a plain step forwards: vanilla's prompt +
    response, pdllm's query suffix + response; the static chunk KV is not among them)."""

    step: int  # forwards so far in this decode (0: the first)
    block: int  # the current semi-autoregressive block
    step_in_block: int  # forwards so far in this block (0: the block's first step)
    block_start: int  # local row of the block's first token
    block_end: int  # one past the block's last local row
    rows: int  # local rows in all
    # Rows just before the block whose hidden states its logits need: 1 for shifted-logit models (Dream
    # predicts token i from the state at i - 1), 0 otherwise (LLaDA).
    lead: int
    # Tokens of the block already unmasked when the step runs (Polestar-Cache's update trigger counts them).
    unmasked: int = 0
    # Local rows [0, protected) an evicting policy keeps whatever their saliency: pdllm's question (the
    # prompt's context is its static chunk KV, already selected and never evicted); 0 under vanilla.
    protected: int = 0


class RowSelector(Protocol):
    """Which local rows a layer's cache keeps, from that layer's ``q`` ``[B, Hq, N, D]`` and ``k``
    ``[B, Hkv, N, D]`` (RoPE applied) at a refresh that forwards all ``N`` local rows: ascending row
    indices (a 1-D long tensor on their device), or None for all of them."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None: ...


@dataclass(frozen=True)
class StepPlan:
    """What one step forwards. ``refresh``: every local row, its K/V becoming the cache (unless ``record``
    is False: a plain full step that leaves the cache as it is); else rows ``[lo, hi)``, every other row's
    K/V read from the cache of the last refresh. ``keep`` (refresh steps): per layer, the rows whose K/V
    the cache holds (the others are evicted: later partial steps see only those and their own rows).
    ``visible``: per layer, the local rows its queries may see (None: all), over a cache that holds every
    row."""

    refresh: bool
    lo: int = 0
    hi: int = 0
    visible: Sequence[torch.Tensor | None] | None = None
    record: bool = True
    keep: RowSelector | None = None
    # Per layer, recompute some cached rows (``local_cache.RowsHook``; Polestar-Cache), on refresh and
    # partial steps; ``attach`` (when it has one) wraps the forward, e.g. to read layer inputs.
    rows_hook: RowsHook | None = None

    @classmethod
    def full(cls, ctx: StepContext) -> StepPlan:
        return cls(refresh=True, lo=0, hi=ctx.rows)

    def check(self, ctx: StepContext) -> None:
        """The plan must forward every row the step's logits are read from."""
        lo, hi = (0, ctx.rows) if self.refresh else (self.lo, self.hi)
        if not (0 <= lo <= ctx.block_start - ctx.lead and ctx.block_end <= hi <= ctx.rows):
            raise ValueError(
                f"plan rows [{lo}, {hi}) must cover rows [{ctx.block_start - ctx.lead}, {ctx.block_end}) "
                f"of the step's block (local rows: {ctx.rows})"
            )


class CachePolicy(Protocol):
    """Decides, per step, which local rows a decode step forwards and when the cache is refreshed.

    A policy never decides what to unmask (the sampler does) and never sees the static chunk KV (the
    method's attention backend does). Stateless: the decode loop owns the cache and the counters, so one
    policy object may serve many sessions.
    """

    name: str

    def plan(self, ctx: StepContext) -> StepPlan: ...


@dataclass
class CacheStats:
    """What a policy saved: forwards, refreshes among them (forwards whose K/V became the cache), local
    rows forwarded in all, peak cache bytes; and for policies that recompute cached rows selectively
    (Polestar-Cache), the steps that did and the cached rows they recomputed, summed over layers."""

    forwards: int = 0
    refreshes: int = 0
    rows_forwarded: int = 0
    cache_bytes: int = 0
    updates: int = 0
    rows_recomputed: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def refresh_due(ctx: StepContext, refresh_steps: int | None) -> bool:
    """Fast-dLLM's rule: a block's first step refreshes (the previous block has just completed, so the
    cache must take in its tokens); ``refresh_steps`` adds a refresh every N steps within a block."""
    if ctx.step_in_block == 0:
        return True
    return refresh_steps is not None and ctx.step_in_block % refresh_steps == 0
