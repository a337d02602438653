"""Polestar-Cache's per-layer store work over several sessions at once: one set of ops for all of them.

A :class:`StackedLayer` is one layer's ``DeviceClusteredHidden`` of ``S`` sessions padded to the largest:
``E`` entries, ``K = max C + 1`` clusters and ``W = max N + 1`` local-row columns. Padding entries belong
to the session's padding cluster ``K - 1`` (never chosen: its drift is ``-inf``) and sit at column
``W - 1`` (no session's row), so nothing written through them reaches a real row. Sums run over
``index_add_`` with each cluster owned by one session and its members in entry order, so on the CPU every
value equals the single-session store's (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdllm.shared.generation.device_sampler import to_device

from .polestar import _project
from .polestar_device_store import DeviceClusteredHidden, _bits
from .polestar_store import quantize


def pad_stack(ts: list[torch.Tensor], shape: tuple[int, ...], fill: float | bool) -> torch.Tensor:
    """``ts`` stacked on a new dim 0, each padded with ``fill`` up to ``shape``."""
    out = ts[0].new_full((len(ts), *shape), fill)
    for i, t in enumerate(ts):
        out[(i, *(slice(0, d) for d in t.shape))] = t
    return out


@dataclass
class StackedLayer:
    """One layer's stores of ``S`` sessions, padded (module docstring)."""

    rows: torch.Tensor  # [S, E] local row of each entry (padding: W - 1)
    entry_of: torch.Tensor  # [S, W] entry of each local row (not cached, padding: 0)
    assign: torch.Tensor  # [S, E] (padding: K - 1)
    centroids: torch.Tensor  # [S, K, H]
    centroid_positions: torch.Tensor  # [S, K]
    codes: torch.Tensor  # [S, E, H]
    scales: torch.Tensor  # [S, E] (``none``: [S, 0])
    fmt: str
    sizes: list[tuple[int, int, int]]  # per session (entries, clusters, local rows)

    @property
    def width(self) -> int:
        return int(self.entry_of.shape[1])

    @property
    def cluster_valid(self) -> torch.Tensor:
        """``[S, K]`` bool: real clusters."""
        # a pinned copy: a pageable one would sync the device inside an update round
        c = to_device([k for _, k, _ in self.sizes], torch.long, self.assign.device)
        return torch.arange(self.centroids.shape[1], device=c.device) < c[:, None]

    @classmethod
    def stack(cls, stores: list[DeviceClusteredHidden], width: int) -> StackedLayer:
        """Pad and stack the sessions' stores (``width``: at least every session's local rows + 1)."""
        e = max(s.rows.numel() for s in stores)
        k = max(s.clusters for s in stores) + 1
        h = stores[0].centroids.shape[1]
        fmt = stores[0].fmt
        scales = [s.scales for s in stores]
        return cls(
            rows=pad_stack([s.rows for s in stores], (e,), width - 1),
            entry_of=pad_stack([s.entry_of for s in stores], (width,), 0),
            assign=pad_stack([s.assign for s in stores], (e,), k - 1),
            centroids=pad_stack([s.centroids for s in stores], (k, h), 0),
            centroid_positions=pad_stack([s.centroid_positions for s in stores], (k,), 0),
            codes=pad_stack([_bits(s.codes) for s in stores], (e, h), 0).view(stores[0].codes.dtype),
            scales=pad_stack(scales, (0 if fmt == "none" else e,), 1),
            fmt=fmt,
            sizes=[(s.rows.numel(), s.clusters, s.entry_of.numel()) for s in stores],
        )

    def session(self, i: int, top_rows: torch.Tensor) -> DeviceClusteredHidden:
        """Session ``i``'s store as views of the stack (no copy)."""
        n, c, big_n = self.sizes[i]
        return DeviceClusteredHidden(
            rows=self.rows[i, :n],
            entry_of=self.entry_of[i, :big_n],
            assign=self.assign[i, :n],
            centroids=self.centroids[i, :c],
            centroid_positions=self.centroid_positions[i, :c],
            fmt=self.fmt,
            codes=self.codes[i, :n],
            scales=self.scales[i, :n] if self.fmt != "none" else self.scales[i],
            top_rows=top_rows,
        )

    def _flat_assign(self) -> torch.Tensor:
        """``[S * E]`` cluster ids over all sessions' ``K`` clusters each (``s K + c``)."""
        k = self.centroids.shape[1]
        offsets = torch.arange(self.assign.shape[0], device=self.assign.device)[:, None] * k
        return (self.assign + offsets).flatten()

    def counts(self) -> torch.Tensor:
        """Members per cluster ``[S, K]`` (float32, exact integers)."""
        s, k = self.centroids.shape[:2]
        ones = torch.ones(self.assign.numel(), device=self.assign.device)
        return torch.zeros(s * k, device=ones.device).index_add_(0, self._flat_assign(), ones).view(s, k)

    def encode(self, h: torch.Tensor, touched: torch.Tensor | None) -> None:
        """``DeviceClusteredHidden._encode`` for every session: entries' hidden states ``h`` ``[S, E, H]``;
        ``touched`` ``[S, K]`` bool (None: the build, every cluster)."""
        s, k, hid = self.centroids.shape
        sums = torch.zeros(s * k, hid, dtype=torch.float32, device=h.device)
        sums.index_add_(0, self._flat_assign(), h.flatten(0, 1).float())
        mean = (sums.view(s, k, hid) / self.counts().clamp_min(1)[..., None]).to(self.centroids.dtype)
        self.centroids = mean if touched is None else torch.where(touched[..., None], mean, self.centroids)
        if self.fmt == "none":
            coded, scale = h, self.scales
        else:
            picked = self.centroids.gather(1, self.assign[..., None].expand(-1, -1, hid))
            coded, scale = quantize((h - picked).flatten(0, 1), self.fmt)
            coded, scale = coded.view(h.shape), scale.view(h.shape[:2])
        if touched is None:
            self.codes, self.scales = coded, scale
            return
        redo = touched.gather(1, self.assign)
        self.codes = torch.where(redo[..., None], _bits(coded), _bits(self.codes)).view(self.codes.dtype)
        if self.fmt != "none":
            self.scales = torch.where(redo, scale, self.scales)

    def decode(self, sess: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[m, H]`` of entries ``entries`` of sessions ``sess`` (both ``[m]``)."""
        codes = self.codes[sess, entries]
        if self.fmt == "none":
            return codes
        r = codes.float() * self.scales[sess, entries][:, None]
        return (self.centroids[sess, self.assign[sess, entries]].float() + r).to(self.centroids.dtype)

    def update(self, carried: torch.Tensor, carried_x: torch.Tensor) -> None:
        """``DeviceClusteredHidden.update`` for every session: ``carried`` ``[S, W]`` bool, their new inputs
        ``carried_x`` ``[S, W, H]`` (a session with nothing carried keeps its values)."""
        s, e = self.assign.shape
        sess = torch.arange(s, device=self.assign.device)[:, None].expand(s, e)
        new = carried.gather(1, self.rows)
        h = self.decode(sess.flatten(), torch.arange(e, device=sess.device).repeat(s)).view(s, e, -1)
        fresh = carried_x.gather(1, self.rows[..., None].expand(-1, -1, h.shape[-1]))
        h = torch.where(new[..., None], fresh.to(h.dtype), h)
        k = self.centroids.shape[1]
        hit = torch.zeros(s * k, device=h.device).index_add_(0, self._flat_assign(), new.flatten().float())
        self.encode(h, hit.view(s, k) > 0)

    def proxy(self, model: object, layer: int, keys: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
        """Every session's drift proxy ``[S, Hq, K, Nk]`` against its keys ``keys`` ``[S, Hkv, Nk, D]``
        (``key_valid`` ``[S, Nk]``: real rows; the others get probability 0)."""
        s, k, hid = self.centroids.shape
        rope = model.model.rotary_emb  # type: ignore[attr-defined]
        cos, sin = rope(self.centroid_positions.view(1, s * k), self.centroids.dtype)
        q, _, _ = _project(model.model.layers[layer], self.centroids.view(1, s * k, hid), cos, sin)  # type: ignore[attr-defined]
        q = q[0].unflatten(1, (s, k)).transpose(0, 1)  # [S, Hq, K, D]
        groups = q.shape[1] // keys.shape[1]
        kf = keys.float().repeat_interleave(groups, dim=1)
        logits = torch.einsum("shcd,shnd->shcn", q.float(), kf) / q.shape[-1] ** 0.5
        logits = logits.masked_fill(~key_valid[:, None, None, :], float("-inf"))
        return torch.log_softmax(logits, dim=-1)


def kl_drift_batched(
    log_p: torch.Tensor, log_prev: torch.Tensor, key_valid: torch.Tensor, cluster_valid: torch.Tensor
) -> torch.Tensor:
    """``polestar.kl_drift`` per session ``[S, K]`` from ``[S, Hq, K, Nk]``: padding keys add 0, padding
    clusters get ``-inf`` (never chosen)."""
    term = log_p.exp() * (log_p - log_prev)
    term = term.masked_fill(~key_valid[:, None, None, :], 0.0)
    kl = term.sum(-1).mean(1)
    return kl.masked_fill(~cluster_valid, float("-inf"))


def choose_batched(kl: torch.Tensor, top: int, threshold: float) -> torch.Tensor:
    """``polestar_device.choose_clusters`` per session: ``[S, K]`` bool from ``[S, K]`` drifts."""
    order = torch.sort(kl, dim=1, descending=True, stable=True).indices[:, : min(top, kl.shape[1])]
    passed = kl.gather(1, order) >= threshold
    return torch.zeros_like(kl, dtype=torch.bool).scatter_(1, order, passed)


def forced_batched(
    stack: StackedLayer, kl: torch.Tensor, carried: torch.Tensor | None, count: int
) -> torch.Tensor:
    """``polestar.forced_rows`` per session: ``[S, W]`` bool, the ``count`` cached rows of each (all if
    fewer) ranked carried first (``carried`` ``[S, W]`` or None), then by their cluster's descending drift
    ``kl`` ``[S, K]`` (ties: the lower cluster), then ascending."""
    s, width = stack.entry_of.shape
    device = kl.device
    real = stack.cluster_valid.gather(1, stack.assign)  # [S, E]: entries of real clusters
    cached = torch.zeros(s, width, dtype=torch.bool, device=device).scatter_(1, stack.rows, real)
    drift = torch.full((s, width), float("-inf"), device=device).scatter_(
        1, stack.rows, kl.gather(1, stack.assign).float()
    )
    cluster = torch.full((s, width), kl.shape[1], dtype=torch.long, device=device)
    cluster = cluster.scatter_(1, stack.rows, stack.assign)
    tier = torch.where(cached, 1, 2)  # not cached: last, never taken
    if carried is not None:
        tier = torch.where(carried & cached, 0, tier)
    # Successive stable sorts: the last key sorted is the first one compared.
    perm = torch.sort(cluster, dim=1, stable=True).indices
    perm = perm.gather(1, torch.sort(drift.gather(1, perm), dim=1, descending=True, stable=True).indices)
    perm = perm.gather(1, torch.sort(tier.gather(1, perm), dim=1, stable=True).indices)
    place = torch.arange(width, device=device).expand(s, width)
    rank = torch.empty_like(perm).scatter_(1, perm, place)
    return cached & (rank < count)


def kmeans_batched(x: torch.Tensor, valid: torch.Tensor, ks: list[int], rounds: int) -> torch.Tensor:
    """``polestar_device_store.kmeans_fixed`` of ``P`` problems at once: rows ``x`` ``[P, L, H]`` (``valid``
    ``[P, L]``: a prefix of real rows), ``ks[p]`` clusters each (>= 1). Cluster ids ``[P, L]``; padding
    rows get the problem's padding cluster ``max(ks)``, whose direction is never chosen."""
    p, length, _ = x.shape
    kk = max(ks) + 1
    device = x.device
    u = F.normalize(x.float(), dim=-1)
    n = valid.sum(1)
    ksz = to_device(ks, torch.long, device)
    j = torch.arange(kk, device=device)
    init = torch.div(j[None] * n[:, None], ksz[:, None].clamp_min(1), rounding_mode="floor").clamp_max(
        length - 1
    )
    directions = u.gather(1, init[..., None].expand(-1, -1, u.shape[-1]))  # [P, Kk, H]
    real = j[None] < ksz[:, None]  # [P, Kk]
    flat = torch.arange(p, device=device)[:, None] * kk
    ones = valid.flatten().float()
    assign = torch.zeros(p, length, dtype=torch.long, device=device)
    for _ in range(rounds):
        sims = torch.bmm(u, directions.transpose(1, 2)).masked_fill(~real[:, None, :], float("-inf"))
        assign = torch.where(valid, sims.argmax(dim=2), kk - 1)
        ids = (assign + flat).flatten()
        sums = torch.zeros(p * kk, u.shape[-1], device=device).index_add_(0, ids, u.flatten(0, 1))
        filled = (torch.zeros(p * kk, device=device).index_add_(0, ids, ones) > 0).view(p, kk)
        directions = torch.where(filled[..., None], F.normalize(sums.view(p, kk, -1), dim=-1), directions)
    return assign
