"""Polestar-Cache's per-layer stores for all of a round's sessions in the same phase, as one store each.

A round's refreshing sessions (same policy) share one :class:`RecordGroup`, its updating sessions one
:class:`UpdateGroup`; each is called once per layer and runs one set of ops for all of its sessions
(``policies/polestar_batch.py``: padded to the largest session, masks for the padding). Host-known sizes
(rows, clusters, the update bounds) are laid out once per round, so an update reads nothing back and a
refresh reads once, after its last layer, for all of its sessions.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pdllm.decode_service.policies.polestar import Polestar
from pdllm.decode_service.policies.polestar_batch import (
    StackedLayer,
    kmeans_batched,
)
from pdllm.decode_service.policies.polestar_device import KMEANS_ROUNDS
from pdllm.decode_service.policies.polestar_store import split_clusters
from pdllm.shared.decode_policy import replay_ceil
from pdllm.shared.generation.device_sampler import to_device

if TYPE_CHECKING:
    from pdllm.decode_service.polestar_rounds import PolestarBatchSession


def _rows_at(bases: list[int], sizes: list[int], width: int, device: torch.device) -> torch.Tensor:
    """``[S, width]`` packed rows ``base + j`` of each session's local rows (padding: its first row)."""
    rows = [[b + (j if j < n else 0) for j in range(width)] for b, n in zip(bases, sizes, strict=True)]
    return to_device(rows, torch.long, device)


@dataclass
class RecordGroup:
    """A refresh round's store for its sessions: per layer, one batched k-means over every session's
    prefix and suffix spans, one encode and one drift proxy; one read of all bounds after the last layer."""

    sessions: list[PolestarBatchSession]
    bases: list[int]
    policy: Polestar
    model: Any = None
    layer_inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    tops: list[torch.Tensor] = field(default_factory=list)  # per layer [S] device top-M sizes
    members: list[Any] = field(default_factory=list)  # the parts' own stores (round_attention.group_stores)

    def rebase(self, bases: list[int]) -> None:
        """Its sessions' first packed rows after a split moved them (layers past the split)."""
        self.bases = list(bases)

    @contextmanager
    def attach(self, model: Any) -> Iterator[None]:
        self.model = model
        yield

    def __call__(
        self, layer: int, base: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention: Any
    ) -> None:
        x = self.layer_inputs.pop(layer)[0]
        ss, device = self.sessions, x.device
        sizes = [s.refresh_rows for s in ss]
        width = max(sizes)
        at = _rows_at(self.bases, sizes, width, device)
        xs, keys = x[at], k[at].transpose(1, 2)  # [S, N, H], [S, Hkv, N, D]
        stack, top = self._build(xs, device)
        key_valid = torch.arange(width, device=device)[None] < to_device(sizes, torch.long, device)[:, None]
        log_p = stack.proxy(self.model, layer, keys, key_valid)
        self.tops.append(top)
        for i, s in enumerate(ss):
            st = s.polestar
            if layer == 0:
                st.stores.clear()
                st.log_prev.clear()
            c, n = stack.sizes[i][1], sizes[i]
            st.stores.append(stack.session(i, top[i]))
            st.log_prev.append(log_p[i, :, :c, :n] if c else torch.empty(0))
        if layer == len(self.model.model.layers) - 1:
            self._finish(torch.stack(self.tops).tolist())  # the refresh's one read

    def _build(self, xs: torch.Tensor, device: torch.device) -> tuple[StackedLayer, torch.Tensor]:
        """Every session's store of this layer (``DeviceClusteredHidden.build``'s values) and its top-M
        cluster sizes ``[S]``."""
        ss, p = self.sessions, self.policy
        width = xs.shape[1] + 1
        spans = [split_clusters(p.clusters, s.span[0], s.refresh_rows - s.span[1]) for s in ss]
        rows = [[*range(s.span[0]), *range(s.span[1], s.refresh_rows)] for s in ss]
        e = max(len(r) for r in rows)
        kk = max(sum(sp) for sp in spans) + 1
        # k-means problems: each non-empty span of each session, rows padded to the longest
        probs = [  # (session, its rows, clusters, first entry, cluster offset)
            (i, part, k, first, off)
            for i, (r, sp) in enumerate(zip(rows, spans, strict=True))
            for part, k, first, off in (
                (r[: ss[i].span[0]], sp[0], 0, 0),
                (r[ss[i].span[0] :], sp[1], ss[i].span[0], sp[0]),
            )
            if k
        ]
        length = max([len(part) for _, part, *_ in probs], default=0)
        flat = [
            [i * xs.shape[1] + part[j] if j < len(part) else 0 for j in range(length)]
            for i, part, *_ in probs
        ]
        # each entry's (problem, index) and cluster offset; padding entries: the padding cluster
        where = [[0] * e for _ in ss]
        offset = [[kk - 1] * e for _ in ss]
        for pi, (i, part, _, first, off) in enumerate(probs):
            for j in range(len(part)):
                where[i][first + j] = pi * length + j
                offset[i][first + j] = off
        n_ent = [len(r) for r in rows]
        entry_of = [[0] * width for _ in ss]
        for i, r in enumerate(rows):
            for j, row in enumerate(r):
                entry_of[i][row] = j
        ints = to_device(
            [*sum(flat, []), *sum(where, []), *sum(offset, []), *sum(entry_of, [])], torch.long, device
        )
        np_, s = len(probs), len(ss)
        cut = [np_ * length, s * e, s * e, s * width]
        f, w, o, eo = torch.split(ints, cut)
        real = torch.arange(e, device=device)[None] < to_device(n_ent, torch.long, device)[:, None]
        assign = torch.full((s, e), kk - 1, dtype=torch.long, device=device)
        if probs:
            xp = xs.flatten(0, 1)[f].view(np_, length, -1)
            valid = (
                torch.arange(length, device=device)[None]
                < to_device([len(part) for _, part, *_ in probs], torch.long, device)[:, None]
            )
            got = kmeans_batched(xp, valid, [k for _, _, k, *_ in probs], KMEANS_ROUNDS)
            assign = torch.where(real, got.flatten()[w.view(s, e)] + o.view(s, e), assign)
        rows_t = to_device([r + [width - 1] * (e - len(r)) for r in rows], torch.long, device)
        hid = xs.shape[2]
        c = [sum(sp) for sp in spans]
        stack = StackedLayer(
            rows=rows_t,
            entry_of=eo.view(s, width),
            assign=assign,
            centroids=torch.zeros(s, kk, hid, dtype=xs.dtype, device=device),
            centroid_positions=torch.zeros(s, kk, dtype=torch.long, device=device),
            codes=torch.empty(0, device=device),
            scales=torch.empty(s, 0, device=device),
            fmt=p.residual_format,
            sizes=[(n_ent[i], c[i], ss[i].refresh_rows) for i in range(s)],
        )
        counts = stack.counts()
        starts = to_device([x.query_start for x in ss], torch.float64, device)
        pos = (starts[:, None] + rows_t.double()).flatten()
        sums = torch.zeros(s * kk, dtype=torch.float64, device=device).index_add_(
            0, stack._flat_assign(), pos
        )
        stack.centroid_positions = (sums.view(s, kk) / counts.double().clamp_min(1)).round().long()
        h = xs.gather(1, rows_t.clamp_max(width - 2)[..., None].expand(-1, -1, hid))
        stack.encode(h, None)
        sizes = counts.masked_fill(~stack.cluster_valid, 0).sort(dim=1, descending=True).values
        return stack, sizes[:, : min(p.top_clusters, kk)].sum(1).long()

    def _finish(self, tops: list[list[int]]) -> None:
        """Each session's per-layer bounds on an update's recomputed rows (a replayed count: that count), its
        counter and peak bytes."""
        forced = self.policy.replay_rows_per_update_layer
        for i, s in enumerate(self.sessions):
            st = s.polestar
            cached, total = s.refresh_rows - (s.span[1] - s.span[0]), 0
            st.bounds = []
            for layer_tops in tops:
                top = layer_tops[i]
                total = top if self.policy.recompute == "per-layer" else min(cached, total + top)
                st.bounds.append(total if forced is None else min(cached, replay_ceil(forced)))
            if st.recomputed is None:
                st.recomputed = torch.zeros((), dtype=torch.long, device=s.device)
            s.stats.cache_bytes = max(s.stats.cache_bytes, s.refresh_rows * s.row_bytes + st.num_bytes())
