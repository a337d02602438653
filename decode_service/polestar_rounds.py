"""Polestar-Cache in the batched rounds: the dual cache's rounds, plus per-layer stores that cluster the
cached rows' hidden states at a refresh and recompute the drifting ones at an update.

A :class:`PolestarBatchSession` is a :class:`~.policy_rounds.PolicyBatchSession` under the dual cache's row
ranges (Polestar-Cache is the dual cache with drift-triggered recomputation; its reference loop,
``tests/reference/policy.py``'s ``PolicyLogits`` with ``policies/polestar.PolestarStep``, is the
specification). Its per-layer work is the reference's values, kept and chosen on the device, and run for all
of a round's sessions in the same phase (same policy) at once: its :class:`PolestarRecord` /
:class:`PolestarUpdate` parts become one ``polestar_record_group.RecordGroup`` / ``polestar_update_group.
UpdateGroup`` per round (``round_attention.group_stores``), one set of ops per layer over those sessions:

- a **refresh** round stores the cached rows' K/V as the dual cache does and, at every layer,
  :class:`PolestarRecord` clusters those rows' layer inputs (read by a forward pre-hook), keeps the
  centroids and the residual codes on the device (``polestar_device_store``: its GPU memory cost);
- a **cached step with no update due** (§4.3: no more than T tokens unmasked since the last update) is a
  plain dual-cache step: it shares graph-replayed rounds with any other session;
- an **update** step forwards the block as the dual cache does and, at every layer before the round's
  attention, :class:`PolestarUpdate` writes the block's fresh K/V into the session's spare cache slots (so
  the pool holds every local row), computes the drift proxy over them, recomputes the chosen rows' q/k/v
  from their stored inputs over a padded row list of a length known on the host, writes the real rows' K/V
  over their cache slots (the block's queries, in the round's attention just after, read them), attends
  them over the static KV and every local row (one split-S call, an entry per session, in the round's
  kernel), and carries their outputs to the next layer.

Refresh and update rounds run eagerly (their choices are made inside the forward). An update reads nothing
back from the device; a refresh reads once, after its last layer (the bounds of the padded row lists of all
its sessions).
Sessions of every other kind share those rounds. Speed and profile: ``benchmarks/results/
polestar_rounds_notes.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from pdllm.decode_service.polestar_record_group import RecordGroup
from pdllm.decode_service.polestar_update_group import UpdateGroup
from pdllm.decode_service.policies import StepContext, StepPlan
from pdllm.decode_service.policies.polestar import Polestar
from pdllm.decode_service.policies.polestar_device import DevicePolestarState
from pdllm.decode_service.policy_rounds import PolicyBatchSession
from pdllm.decode_service.round_packing import RoundRows
from pdllm.shared.generation.device_sampler import to_device
from pdllm.shared.generation.sampler import GenerationResult


@dataclass
class PolestarBatchSession(PolicyBatchSession):
    """A batched session under Polestar-Cache. Its cache slots: the dual cache's (rows ``[0, lo)`` then
    ``[hi, N)``), then ``hi - lo`` spare slots where an update puts the block's fresh K/V."""

    runs: ClassVar[tuple[str, ...]] = ("polestar",)
    polestar: DevicePolestarState = field(default_factory=DevicePolestarState)
    # (page, slot in page) of every local row, ``[2, N]`` long on the device, from the last refresh
    row_slots: torch.Tensor | None = None
    # int32 on the device: the slots an update's recomputed rows read (static KV + every local row), then
    # the session's pages (the split-S call's kv_lens and page table)
    paged: torch.Tensor | None = None
    span: tuple[int, int] = (0, 0)  # the forwarded rows [lo, hi) of the block's cached steps
    refresh_rows: int = 0  # local rows N at the last refresh (a block's updates see the same rows)

    def _plan(self, ctx: StepContext) -> StepPlan:
        # The reference's rows hook is what the stores below do in the rounds.
        return self._batchable(replace(self.policy.plan(ctx), rows_hook=None), ctx)

    def round_rows(self) -> RoundRows:
        ctx = self.context()
        plan = self._plan(ctx)
        rows = self._rows(ctx, plan)
        policy = self.policy
        assert isinstance(policy, Polestar)
        state = self.polestar
        lo, hi = ctx.block_start - ctx.lead, ctx.block_end
        if plan.refresh:
            state.unmasked_at_update = ctx.unmasked
            state.forwards += 1
            self.span = (lo, hi)
            cached, n = ctx.rows - (hi - lo), ctx.rows
            slot_of = [*range(lo), *range(cached, cached + hi - lo), *range(lo, cached)]
            slots = [self.slot(j) for j in slot_of]
            pages = [p for p, _ in slots]
            self.row_slots = to_device(pages + [o for _, o in slots], torch.long, self.device).view(2, n)
            self.paged = to_device([self.kv_tokens + n, *self.pages], torch.int32, self.device)
            self.refresh_rows = n
            return replace(rows, store=PolestarRecord(self, policy))
        if not state.update_due(policy, ctx.unmasked):
            return rows
        return replace(rows, store=PolestarUpdate(self, policy))

    def result(self) -> GenerationResult:
        self.stats.updates = self.polestar.updates
        self.stats.rows_recomputed = self.polestar.rows_recomputed
        return super().result()


@dataclass
class PolestarRecord:
    """A refresh round's part for one session: the round's refreshing sessions of the same policy become one
    ``polestar_record_group.RecordGroup`` (``round_attention.group_stores``), called once per layer."""

    session: PolestarBatchSession
    policy: Polestar

    @property
    def group_key(self) -> tuple[str, Polestar]:
        return ("polestar-record", self.policy)

    @staticmethod
    def grouped(parts: list[tuple[int, PolestarRecord]]) -> RecordGroup:
        return RecordGroup([p.session for _, p in parts], [b for b, _ in parts], parts[0][1].policy)


@dataclass
class PolestarUpdate:
    """An update step's part for one session: the round's updating sessions of the same policy become one
    ``polestar_update_group.UpdateGroup``, called once per layer."""

    session: PolestarBatchSession
    policy: Polestar

    @property
    def group_key(self) -> tuple[str, Polestar]:
        return ("polestar-update", self.policy)

    @staticmethod
    def grouped(parts: list[tuple[int, PolestarUpdate]]) -> UpdateGroup:
        return UpdateGroup([p.session for _, p in parts], [b for b, _ in parts], parts[0][1].policy)
