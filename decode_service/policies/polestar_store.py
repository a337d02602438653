"""Polestar-Cache's store of one layer's cached hidden states: spherical k-means clusters, centroids on the
hidden states' device, residuals offloaded to CPU memory in a compact format (``polestar.py`` has the
equations and the choices)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Largest magnitudes of the compact formats: a per-row scale maps the row's absmax onto them.
FORMAT_MAX = {"int8": 127.0, "fp8": 448.0}


def split_clusters(clusters: int, prefix: int, suffix: int) -> tuple[int, int]:
    """Clusters of the prefix and the suffix span: C split by length, each non-empty span >= 1 cluster
    and at most one per row (with C = 1 and both spans non-empty, one each)."""
    if prefix == 0 or suffix == 0:
        return min(clusters, prefix), min(clusters, suffix)
    c_pre = round(clusters * prefix / (prefix + suffix))
    c_pre = max(1, min(c_pre, clusters - 1))
    c_suf = max(1, clusters - c_pre)
    return min(c_pre, prefix), min(c_suf, suffix)


def spherical_kmeans(x: torch.Tensor, k: int, rounds: int) -> torch.Tensor:
    """Cluster ids ``[n]`` of the rows of ``x`` ``[n, H]`` by cosine: initial directions the rows
    ``floor(j n / k)``, assign to the most similar direction (ties: the lower cluster), directions the
    normalized sum of their unit rows (an empty cluster keeps its own), until stable or ``rounds``."""
    n = x.shape[0]
    u = torch.nn.functional.normalize(x.float(), dim=-1)
    init = torch.tensor([j * n // k for j in range(k)], device=x.device)
    directions = u[init]
    assign = torch.full((n,), -1, dtype=torch.long, device=x.device)
    for _ in range(rounds):
        new = (u @ directions.T).argmax(dim=1)  # argmax returns the first of equal maxima
        if torch.equal(new, assign):
            break
        assign = new
        sums = torch.zeros_like(directions).index_add_(0, assign, u)
        filled = torch.bincount(assign, minlength=k) > 0
        directions = torch.where(filled[:, None], torch.nn.functional.normalize(sums, dim=-1), directions)
    return assign


def quantize(r: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row scaled codes of residuals ``r`` ``[n, H]`` (on their device) and the scales ``[n]`` (float32)."""
    r = r.float()
    scale = r.abs().amax(dim=-1) / FORMAT_MAX[fmt]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: any scale
    y = r / scale[:, None]
    codes = y.round().clamp(-127, 127).to(torch.int8) if fmt == "int8" else y.to(torch.float8_e4m3fn)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale[:, None]


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` in CPU memory: pinned when it comes from a GPU, so that fetching it back is one fast copy."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t)


@dataclass
class ClusteredHidden:
    """One layer's hidden states of the cached rows ``rows`` (ascending local rows): the cluster of each,
    the centroids ``[C, H]`` (the members' mean, on the device) with their positions (the members' mean
    position, rounded), and per row the residual to its centroid on the CPU (``codes`` + ``scales``) or,
    for ``none``, the exact hidden state."""

    rows: torch.Tensor
    assign: torch.Tensor  # [n] cluster of each row
    centroids: torch.Tensor
    centroid_positions: torch.Tensor
    fmt: str
    codes: torch.Tensor  # on the CPU: [n, H] int8 / float8_e4m3fn, or the hidden states (``none``)
    scales: torch.Tensor  # on the CPU: [n] float32 (empty for ``none``)
    local_rows: int  # rows + forwarded rows: maps a local row to its entry

    @property
    def clusters(self) -> int:
        return int(self.centroids.shape[0])

    @classmethod
    def build(
        cls,
        x: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        split_at: int,
        spans: tuple[int, int],
        fmt: str,
        rounds: int,
    ) -> ClusteredHidden:
        """Cluster ``x[rows]`` (``x``: ``[N, H]`` every local row's input), the rows before ``split_at`` and
        after it apart, with ``spans`` clusters each."""
        h = x[rows]
        before = int((rows < split_at).sum())
        assign = torch.empty(rows.numel(), dtype=torch.long, device=x.device)
        offset = 0
        for part, k in ((slice(0, before), spans[0]), (slice(before, rows.numel()), spans[1])):
            if k:
                assign[part] = spherical_kmeans(h[part], k, rounds) + offset
            offset += k
        store = cls(
            rows=rows,
            assign=assign,
            centroids=torch.zeros(offset, x.shape[1], dtype=x.dtype, device=x.device),
            centroid_positions=torch.zeros(offset, dtype=torch.long, device=x.device),
            fmt=fmt,
            codes=torch.empty(0),
            scales=torch.empty(0),
            local_rows=x.shape[0],
        )
        counts = torch.bincount(assign, minlength=offset).clamp_min(1)
        pos = torch.zeros(offset, dtype=torch.float64, device=x.device)
        pos.index_add_(0, assign, positions[rows].double())
        store.centroid_positions = (pos / counts).round().long()
        store._encode(torch.arange(rows.numel(), device=x.device), h, torch.arange(offset, device=x.device))
        return store

    def _entries(self, rows: torch.Tensor) -> torch.Tensor:
        at = torch.searchsorted(self.rows, rows)
        if not torch.equal(self.rows[at.clamp_max(self.rows.numel() - 1)], rows):
            raise ValueError("rows asked of a polestar store that does not hold them")
        return at

    def _encode(self, members: torch.Tensor, h: torch.Tensor, touched: torch.Tensor) -> None:
        """Recompute the ``touched`` clusters' centroids from the hidden states ``h`` of their ``members``
        (entries, ascending: every member of those clusters) and re-encode those residuals to the CPU."""
        sums = torch.zeros_like(self.centroids, dtype=torch.float32)
        sums.index_add_(0, self.assign[members], h.float())
        counts = torch.bincount(self.assign[members], minlength=self.clusters).clamp_min(1)
        mean = (sums / counts[:, None]).to(self.centroids.dtype)
        self.centroids[touched] = mean[touched]
        if self.fmt == "none":
            coded, scale = to_host(h), torch.empty(0)
        else:
            coded, scale = quantize(h - self.centroids[self.assign[members]], self.fmt)
            coded, scale = to_host(coded), to_host(scale)
        if self.codes.numel() == 0:
            self.codes, self.scales = coded, scale
            return
        at = members.cpu()
        self.codes[at] = coded
        if self.fmt != "none":
            self.scales[at] = scale

    def _fetch(self, at: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[n, H]`` of entries ``at``: the layer's codes copied from the CPU whole (one
        copy from pinned memory costs less than gathering rows on the host), picked and dequantized on the
        device (the same float32 products as on the host)."""
        device, dtype = self.centroids.device, self.centroids.dtype
        codes = self.codes.to(device, non_blocking=True)  # the host writes codes only after a sync
        if self.fmt == "none":
            return codes[at]
        r = dequantize(codes[at], self.scales.to(device, non_blocking=True)[at])
        return (self.centroids[self.assign[at]].float() + r).to(dtype)

    def hidden(self, rows: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[n, H]`` of local ``rows``, fetched from the CPU, dequantized."""
        return self._fetch(self._entries(rows))

    def members(self, clusters: list[int]) -> torch.Tensor:
        """Local rows (ascending) of the given clusters."""
        chosen = torch.tensor(clusters, dtype=torch.long, device=self.assign.device)
        return self.rows[torch.isin(self.assign, chosen)]

    def update(self, rows: torch.Tensor, x: torch.Tensor) -> None:
        """New hidden states ``x`` ``[n, H]`` of local ``rows``: their clusters' centroids move to the new
        members' mean and those clusters' residuals are re-encoded (only those members are fetched)."""
        keep = torch.isin(rows, self.rows)  # rows recomputed upstream are all cached rows; guard anyway
        rows, x = rows[keep], x[keep]
        if rows.numel() == 0:
            return
        at = self._entries(rows)
        touched = torch.unique(self.assign[at])
        members = torch.isin(self.assign, touched).nonzero().squeeze(1)
        h = self._fetch(members)
        h[torch.searchsorted(members, at)] = x.to(h.dtype)
        self._encode(members, h, touched)

    def num_bytes(self) -> int:
        """Bytes held: centroids (device), codes and scales (CPU); cluster ids and rows not counted."""
        tensors = (self.centroids, self.codes, self.scales)
        return sum(t.numel() * t.element_size() for t in tensors)
