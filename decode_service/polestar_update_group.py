"""Polestar-Cache's update for all of a round's updating sessions (same policy) as one store.

Per layer, one set of ops over every session (``policies/polestar_batch.py``): the block's fresh K/V into
the spare slots, the carried rows' re-encode, the drift proxy, the top-M choice, then one recompute over
the sessions' padded row lists laid end to end (session ``s``: its ``bound`` rows, drifting rows first, as
``polestar_device.padded_rows`` picks them), one masked K/V write, one split-S call with an entry per
session and one o_proj/MLP. The row lists' offsets come from the refresh's bounds, laid out once per round,
so nothing is read back from the device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import torch

from pdllm.decode_service.policies.polestar import Polestar, PolestarState
from pdllm.decode_service.policies.polestar_batch import (
    StackedLayer,
    choose_batched,
    forced_batched,
    kl_drift_batched,
    pad_stack,
)
from pdllm.decode_service.policies.polestar_device import masked_rows
from pdllm.decode_service.round_attention import PagedBatchAttention
from pdllm.shared.decode_policy import replay_ceil
from pdllm.shared.generation.device_sampler import to_device

if TYPE_CHECKING:
    from pdllm.decode_service.polestar_rounds import PolestarBatchSession


@dataclass
class RoundLayout:
    """An update round's host-known layout, on the device: fresh rows and their slots, every local row's
    slot ``[S, 2, N]``, the split-S tables, and per layer the padded row lists' picks and offsets."""

    fresh: torch.Tensor  # [3, F]: packed row, page, slot in page
    slots: torch.Tensor  # [S, 2, N]
    key_valid: torch.Tensor  # [S, N]
    tables: torch.Tensor  # [S, pages] int32
    kv_lens: torch.Tensor  # [S] int32
    starts: torch.Tensor  # [S] each session's first position
    picks: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (flat pick s N + j, session) [R]
    q_offsets: list[torch.Tensor]  # per layer [S + 1] int32

    @classmethod
    def of(cls, sessions: list[PolestarBatchSession], bases: list[int], device: torch.device) -> RoundLayout:
        n = max(s.refresh_rows for s in sessions)
        fresh = []
        for s, b in zip(sessions, bases, strict=True):
            lo, hi = s.span
            assert s.row_slots is not None
            fresh.append(
                torch.cat([torch.arange(b + lo, b + hi, device=device)[None], s.row_slots[:, lo:hi]])
            )
        layers = len(sessions[0].polestar.bounds)
        flat, owner, offs = [], [], []
        for layer in range(layers):
            bounds = [s.polestar.bounds[layer] for s in sessions]
            flat += [i * n + j for i, b in enumerate(bounds) for j in range(b)]
            owner += [i for i, b in enumerate(bounds) for _ in range(b)]
            offs.append([0, *accumulate(bounds)])
        ints = to_device([*flat, *owner], torch.long, device)
        q_off = to_device(sum(offs, []), torch.int32, device).view(layers, -1)
        picks, at = [], 0
        for layer in range(layers):
            r = offs[layer][-1]
            picks.append((ints[at : at + r], ints[len(flat) + at : len(flat) + at + r]))
            at += r
        sizes = to_device([s.refresh_rows for s in sessions], torch.long, device)
        paged = [s.paged for s in sessions]
        assert all(p is not None for p in paged)
        return cls(
            fresh=torch.cat(fresh, 1),
            slots=pad_stack([s.row_slots for s in sessions], (2, n), 0),  # type: ignore[misc]
            key_valid=torch.arange(n, device=device)[None] < sizes[:, None],
            tables=pad_stack([p[1:] for p in paged], (max(p.numel() for p in paged) - 1,), 0),  # type: ignore[union-attr]
            kv_lens=torch.cat([p[:1] for p in paged]),  # type: ignore[index]
            starts=to_device([s.query_start for s in sessions], torch.long, device),
            picks=picks,
            q_offsets=list(q_off),
        )


@dataclass
class UpdateGroup:
    """An update round's store for its updating sessions (module docstring)."""

    sessions: list[PolestarBatchSession]
    bases: list[int]
    policy: Polestar
    model: Any = None
    layout: RoundLayout | None = None
    carried: torch.Tensor | None = None  # [S, N + 1] bool: rows recomputed at the layer before
    dense: torch.Tensor | None = None  # [S, N + 1, H]: their outputs
    counts: torch.Tensor | None = None  # [S] real rows recomputed this round
    slots_read: list[int] = field(default_factory=list)
    members: list[Any] = field(default_factory=list)  # the parts' own stores (round_attention.group_stores)

    def rebase(self, bases: list[int]) -> None:
        """Its sessions' first packed rows after a split moved them: the layout's packed rows follow."""
        self.bases = list(bases)
        if self.layout is not None:
            self.layout = RoundLayout.of(self.sessions, self.bases, self.layout.fresh.device)

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
        ss, device = self.sessions, k.device
        if self.layout is None:
            self.layout = RoundLayout.of(ss, self.bases, device)
            self.counts = torch.zeros(len(ss), dtype=torch.long, device=device)
        lay, kv = self.layout, attention.kv[layer]
        # The block's fresh K/V into the spare slots: the pool then holds every local row of the step.
        rows, pages, offsets = lay.fresh
        kv[0][pages, :, offsets] = k[rows]
        kv[1][pages, :, offsets] = v[rows]
        keys = kv[0][lay.slots[:, 0], :, lay.slots[:, 1]].transpose(1, 2)  # [S, Hkv, N, D]
        width = lay.slots.shape[2] + 1
        stack = StackedLayer.stack([s.polestar.stores[layer] for s in ss], width)
        if self.carried is not None:
            assert self.dense is not None
            stack.update(self.carried, self.dense)
        for i, s in enumerate(ss):  # views of the stack: no copy
            s.polestar.stores[layer] = stack.session(i, s.polestar.stores[layer].top_rows)
        bounds = [s.polestar.bounds[layer] for s in ss]
        if max(bounds) == 0:  # no cached rows in any session: nothing chosen, nothing carried
            self.carried, self.dense = None, None
            return self._done(layer)
        log_p = stack.proxy(self.model, layer, keys, lay.key_valid)
        prev = pad_stack([s.polestar.log_prev[layer] for s in ss], log_p.shape[1:], 0.0)
        kl = kl_drift_batched(log_p, prev, lay.key_valid, stack.cluster_valid)
        for i, s in enumerate(ss):
            c = stack.sizes[i][1]
            if c:
                s.polestar.log_prev[layer] = log_p[i, :, :c, : s.refresh_rows]
        propagated = self.carried is not None and self.policy.recompute == "propagated"
        if self.policy.replay_rows_per_update_layer is not None:  # a replayed count, ranked as forced_rows
            count = replay_ceil(self.policy.replay_rows_per_update_layer)
            mask = forced_batched(stack, kl, self.carried if propagated else None, count)
        else:
            chosen = choose_batched(kl, self.policy.top_clusters, self.policy.drift_threshold)
            mask = torch.zeros(len(ss), width, dtype=torch.bool, device=device)
            mask = mask.scatter_(1, stack.rows, chosen.gather(1, stack.assign))  # padding: column N, False
            if propagated:
                mask = mask | self.carried
        mask = mask[:, :-1]
        # Drifting rows first, then the other real rows, then padding columns: each ascending.
        order = (~mask).to(torch.uint8) + (~lay.key_valid).to(torch.uint8)
        idx = torch.sort(order, dim=1, stable=True).indices
        pick, sess = lay.picks[layer]
        rows = idx.flatten()[pick]
        valid = mask[sess, rows]
        x = stack.decode(sess, stack.entry_of[sess, rows])
        if self.carried is not None:  # their exact inputs, not the dequantized ones
            assert self.dense is not None
            x = masked_rows(self.carried[sess, rows], self.dense[sess, rows].to(x.dtype), x)
        qd, kd, vd = PolestarState.project(self.model, layer, x, (rows + lay.starts[sess])[None])
        at = (lay.slots[sess, 0, rows], slice(None), lay.slots[sess, 1, rows])
        # Padding rows keep their cached K/V: rows are distinct within a session, slots across sessions.
        kv[0][at] = masked_rows(valid, kd[0].transpose(0, 1), kv[0][at])
        kv[1][at] = masked_rows(valid, vd[0].transpose(0, 1), kv[1][at])
        slots = max(s.kv_tokens + s.refresh_rows for s in ss)
        out = attention.paged(
            layer, qd[0].transpose(0, 1), lay.tables, lay.kv_lens, lay.q_offsets[layer], max(bounds), slots
        )
        self._finish(layer, sess, rows, valid, x, out)
        self._done(layer)

    def _finish(
        self,
        layer: int,
        sess: torch.Tensor,
        rows: torch.Tensor,
        valid: torch.Tensor,
        x: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """The rest of the layer for the picked rows (o_proj, residual, MLP); the real rows are carried."""
        layer_mod = self.model.model.layers[layer]
        m = rows.numel()
        h = x[None] + layer_mod.self_attn.o_proj(out.reshape(1, m, -1))
        y = (h + layer_mod.mlp(layer_mod.post_attention_layernorm(h)))[0]
        s, width = len(self.sessions), self.layout.slots.shape[2] + 1  # type: ignore[union-attr]
        carried = torch.zeros(s, width, dtype=torch.bool, device=y.device)
        self.carried = carried.index_put_((sess, rows), valid)
        dense = torch.zeros(s, width, y.shape[1], dtype=y.dtype, device=y.device)
        self.dense = dense.index_put_((sess, rows), y)
        assert self.counts is not None
        self.counts.index_add_(0, sess, valid.long())

    def _done(self, layer: int) -> None:
        if layer == len(self.model.model.layers) - 1:  # the round's counts into each session's counter
            assert self.counts is not None
            for i, s in enumerate(self.sessions):
                assert s.polestar.recomputed is not None
                s.polestar.recomputed += self.counts[i]
