"""Polestar-Cache in the batched rounds: the dual cache's rounds, plus per-layer stores that cluster the
cached rows' hidden states at a refresh and recompute the drifting ones at an update.

A :class:`PolestarBatchSession` is a :class:`~.policy_rounds.PolicyBatchSession` under the dual cache's row
ranges (Polestar-Cache is the dual cache with drift-triggered recomputation; its reference loop,
``tests/reference/policy.py``'s ``PolicyLogits`` with ``policies/polestar.PolestarStep``, is the
specification). Its per-layer work is ``policies/polestar_device.DevicePolestarState``'s: the reference's
values, kept and chosen on the device:

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
  them over the static KV and every local row (one split-S call on the session's pages, in the round's
  kernel), and carries their outputs to the next layer.

Refresh and update rounds run eagerly (their choices are made inside the forward). An update reads nothing
back from the device; a refresh reads once, after its last layer (the bounds of the padded row lists).
Sessions of every other kind share those rounds. Speed and profile: ``benchmarks/results/
polestar_rounds_notes.md``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch

from pdllm.decode_service.policies import StepContext, StepPlan
from pdllm.decode_service.policies.polestar import Polestar, PolestarState
from pdllm.decode_service.policies.polestar_device import DevicePolestarState, masked_rows
from pdllm.decode_service.policy_rounds import PolicyBatchSession
from pdllm.decode_service.round_attention import PagedBatchAttention
from pdllm.decode_service.rounds import RoundRows
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
    # per padded row count: the split-S call's query offsets [0, count] (built once, not per layer)
    q_offsets: dict[int, torch.Tensor] = field(default_factory=dict)

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
            self.span = (lo, hi)
            cached, n = ctx.rows - (hi - lo), ctx.rows
            slot_of = [*range(lo), *range(cached, cached + hi - lo), *range(lo, cached)]
            slots = [self.slot(j) for j in slot_of]
            pages = [p for p, _ in slots]
            self.row_slots = to_device(pages + [o for _, o in slots], torch.long, self.device).view(2, n)
            self.paged = to_device([self.kv_tokens + n, *self.pages], torch.int32, self.device)
            positions = torch.arange(self.query_start, self.query_start + n, device=self.device)
            return replace(rows, store=PolestarRecord(self, policy, positions))
        if not state.update_due(policy, ctx.unmasked):
            return rows
        return replace(rows, store=PolestarUpdate(self, policy))

    def result(self) -> GenerationResult:
        self.stats.updates = self.polestar.updates
        self.stats.rows_recomputed = self.polestar.rows_recomputed
        return super().result()


@dataclass
class PolestarRecord:
    """A refresh round's :data:`~.round_attention.LayerStore`: per layer, cluster and encode the inputs of the
    session's cached rows (``DevicePolestarState.record``) and keep their drift proxy over every local row."""

    session: PolestarBatchSession
    policy: Polestar
    positions: torch.Tensor  # [N] every local row's position
    model: Any = None
    # each layer's input [1, T, H], filled by the round's forward before the layer
    layer_inputs: dict[int, torch.Tensor] = field(default_factory=dict)

    @contextmanager
    def attach(self, model: Any) -> Iterator[None]:
        self.model = model
        yield

    def __call__(
        self, layer: int, base: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention: Any
    ) -> None:
        s = self.session
        own = slice(base, base + self.positions.numel())
        x = self.layer_inputs.pop(layer)[0, own]
        s.polestar.record(
            self.policy, self.model, layer, x, k[own].transpose(0, 1)[None], s.span, self.positions
        )
        if layer == len(self.model.model.layers) - 1:  # the reference's peak: full local K/V + the stores
            n = self.positions.numel()
            s.stats.cache_bytes = max(s.stats.cache_bytes, n * s.row_bytes + s.polestar.num_bytes())


@dataclass
class PolestarUpdate:
    """An update step's :data:`~.round_attention.LayerStore`: per layer, recompute the session's drifting cached
    rows (``DevicePolestarState.drifting`` / ``finish``, ``PolestarState.project``) over its pool pages."""

    session: PolestarBatchSession
    policy: Polestar
    model: Any = None

    @contextmanager
    def attach(self, model: Any) -> Iterator[None]:
        self.model = model
        yield

    def __call__(
        self,
        layer: int,
        base: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention: PagedBatchAttention,
    ) -> None:
        s, state = self.session, self.session.polestar
        assert s.row_slots is not None and s.paged is not None
        lo, hi = s.span
        pages, offsets = s.row_slots
        kv = attention.kv[layer]
        # The block's fresh K/V into the spare slots: the pool then holds every local row of the step.
        fresh = slice(base + lo, base + hi)
        kv[0][pages[lo:hi], :, offsets[lo:hi]] = k[fresh]
        kv[1][pages[lo:hi], :, offsets[lo:hi]] = v[fresh]
        keys = kv[0][pages, :, offsets]  # [N, Hkv, D] in row order
        picked = state.drifting(self.policy, self.model, layer, keys.transpose(0, 1)[None])
        if picked is None:
            return
        rows, valid, x = picked
        qd, kd, vd = PolestarState.project(self.model, layer, x, (rows + s.query_start)[None])
        at = (pages[rows], slice(None), offsets[rows])
        # Padding rows keep their cached K/V: the rows are distinct, so each slot is written once.
        kv[0][at] = masked_rows(valid, kd[0].transpose(0, 1), kv[0][at])
        kv[1][at] = masked_rows(valid, vd[0].transpose(0, 1), kv[1][at])
        n = rows.numel()
        if n not in s.q_offsets:
            s.q_offsets[n] = to_device([0, n], torch.int32, qd.device)
        slots = s.kv_tokens + offsets.numel()  # static KV + every local row
        out = attention.paged(
            layer, qd[0].transpose(0, 1), s.paged[1:][None], s.paged[:1], s.q_offsets[n], n, slots
        )
        state.finish(self.model, layer, rows, valid, x, out.transpose(0, 1)[None], offsets.numel())
