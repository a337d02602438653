"""Polestar-Cache's per-layer store for the batched rounds: the reference store's values
(``polestar_store.ClusteredHidden``: same clusters, centroids, codes and scales), held on the hidden states'
device and updated by device ops only, so an update reads nothing back to the host.

Differences from the reference store, none of them in the values:

- **Residual codes on the device.** The reference offloads them to CPU memory (the paper's choice, to save
  GPU memory) and pays a device-to-host copy and a host scatter per layer per update. Here an update
  re-encodes on the device and keeps the old codes of untouched clusters with a ``where``.
  GPU memory per request, per layer, with ``n`` cached rows, ``N`` local rows, hidden size ``H``, ``C``
  clusters: ``n H`` bytes of int8/fp8 codes (``2 n H`` for ``none`` in bf16) + ``4 n`` (scales) +
  ``16 n`` (rows, cluster ids) + ``8 N`` (row -> entry map) + ``2 C H + 8 C`` (centroids, positions).
  At Dream-7B shapes (``H`` = 3584, 28 layers) with a 1K prompt and gen 256 (``n`` ~ 1,272 rows): about
  28 x 1,272 x 3,604 B = 128 MB per request for int8 codes, 1.75x the dual cache's K/V of the same rows
  (``2 x 4 x 128 x 2`` = 2,048 B per row per layer). An update adds transient float32 buffers of
  ``4 n H`` bytes (18 MB) per layer. Beside the store, each layer keeps its last drift proxy on the device
  (``4 Hq C N`` bytes: 1.2 MB per layer at C = 8, 33 MB per request), as the reference does.
- **K-means with a fixed round count** (:func:`kmeans_fixed`): no convergence check that reads the device.
- **Cluster sizes' top-M sum** (:attr:`DeviceClusteredHidden.top_rows`): a device scalar, read once per
  refresh by the caller; it bounds the rows an update recomputes at the layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .polestar_store import quantize


def kmeans_fixed(x: torch.Tensor, k: int, rounds: int) -> torch.Tensor:
    """``polestar_store.spherical_kmeans``'s cluster ids ``[n]`` with all ``rounds`` rounds run and no
    convergence check. Equal to it where ``index_add_`` is deterministic (CPU; tested): once an assignment
    repeats, the directions computed from it repeat too, so rounds past convergence change nothing. On CUDA
    its float atomics may reorder a sum, so a later round could flip a near-tie the converging version never
    revisits. Cluster occupancy by ``index_add_`` (``bincount`` sizes its output from the device on CUDA)."""
    n = x.shape[0]
    u = F.normalize(x.float(), dim=-1)
    init = torch.div(torch.arange(k, device=x.device) * n, k, rounding_mode="floor")
    directions = u[init]
    ones = torch.ones(n, device=x.device)
    assign = torch.zeros(n, dtype=torch.long, device=x.device)
    for _ in range(rounds):
        assign = (u @ directions.T).argmax(dim=1)  # argmax returns the first of equal maxima
        sums = torch.zeros_like(directions).index_add_(0, assign, u)
        filled = torch.zeros(k, device=x.device).index_add_(0, assign, ones) > 0
        directions = torch.where(filled[:, None], F.normalize(sums, dim=-1), directions)
    return assign


def cluster_sizes(assign: torch.Tensor, clusters: int) -> torch.Tensor:
    """Members per cluster ``[C]`` (float32, exact integers), without ``bincount``'s host read."""
    ones = torch.ones(assign.numel(), device=assign.device)
    return torch.zeros(clusters, device=assign.device).index_add_(0, assign, ones)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@dataclass
class DeviceClusteredHidden:
    """One layer's cached rows ``rows`` (ascending local rows, on the device): cluster ids, centroids
    ``[C, H]`` (the members' mean) and their positions, per row the residual codes to its centroid and
    the scales (``none``: the exact hidden states), all on the device."""

    rows: torch.Tensor
    entry_of: torch.Tensor  # [N] local row -> its entry (rows not cached: 0, read only as padding)
    assign: torch.Tensor  # [n]
    centroids: torch.Tensor
    centroid_positions: torch.Tensor
    fmt: str
    codes: torch.Tensor  # [n, H] int8 / float8_e4m3fn, or the hidden states (``none``)
    scales: torch.Tensor  # [n] float32 (empty for ``none``)
    top_rows: torch.Tensor  # 0-dim: the sum of the ``top`` largest cluster sizes

    @property
    def clusters(self) -> int:
        return int(self.centroids.shape[0])

    @classmethod
    def build(
        cls,
        x: torch.Tensor,
        span: tuple[int, int],
        positions: torch.Tensor,
        spans: tuple[int, int],
        fmt: str,
        rounds: int,
        top: int,
    ) -> DeviceClusteredHidden:
        """Cluster the inputs ``x`` ``[N, H]`` of the rows outside the forwarded ``span`` ``[lo, hi)``,
        the rows before it and after it apart, with ``spans`` clusters each (the reference's
        ``ClusteredHidden.build``, whose ``split_at`` is ``lo``)."""
        lo, hi = span
        big_n, device = x.shape[0], x.device
        rows = torch.cat([torch.arange(0, lo, device=device), torch.arange(hi, big_n, device=device)])
        n = rows.numel()
        h = x[rows]
        assign = torch.empty(n, dtype=torch.long, device=device)
        offset = 0
        for part, k in ((slice(0, lo), spans[0]), (slice(lo, n), spans[1])):
            if k:
                assign[part] = kmeans_fixed(h[part], k, rounds) + offset
            offset += k
        counts = cluster_sizes(assign, offset)
        pos = torch.zeros(offset, dtype=torch.float64, device=device)
        pos.index_add_(0, assign, positions[rows].double())
        top_rows = counts.sort(descending=True).values[: min(top, offset)].sum().long()
        store = cls(
            rows=rows,
            entry_of=torch.zeros(big_n, dtype=torch.long, device=device).index_copy_(
                0, rows, torch.arange(n, device=device)
            ),
            assign=assign,
            centroids=torch.zeros(offset, x.shape[1], dtype=x.dtype, device=device),
            centroid_positions=(pos / counts.double().clamp_min(1)).round().long(),
            fmt=fmt,
            codes=torch.empty(0, device=device),
            scales=torch.empty(0, device=device),
            top_rows=top_rows,
        )
        store._encode(h, torch.ones(offset, dtype=torch.bool, device=device))
        return store

    def _encode(self, h: torch.Tensor, touched: torch.Tensor) -> None:
        """Every entry's hidden state ``h`` ``[n, H]``: the ``touched`` clusters' (``[C]`` bool) centroids
        move to their members' mean and their members' residuals are re-encoded; the rest keep theirs.
        Sums over every entry in entry order: a cluster's sum adds its members in the reference's order."""
        sums = torch.zeros(self.centroids.shape, dtype=torch.float32, device=h.device)
        sums.index_add_(0, self.assign, h.float())
        counts = cluster_sizes(self.assign, self.clusters).clamp_min(1)
        mean = (sums / counts[:, None]).to(self.centroids.dtype)
        self.centroids = torch.where(touched[:, None], mean, self.centroids)
        if self.fmt == "none":
            coded, scale = h, self.scales
        else:
            coded, scale = quantize(h - self.centroids[self.assign], self.fmt)
        if self.codes.numel() == 0:  # the build: every cluster touched
            self.codes, self.scales = coded, scale
            return
        redo = touched[self.assign]
        # As bytes: the same bits, and ``where`` need not know float8 on every device.
        picked = torch.where(redo[:, None], _bits(coded), _bits(self.codes))
        self.codes = picked.view(self.codes.dtype)
        if self.fmt != "none":
            self.scales = torch.where(redo, scale, self.scales)

    def _decode(self, at: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[m, H]`` of entries ``at`` (the reference's ``_fetch`` arithmetic)."""
        if self.fmt == "none":
            return self.codes[at]
        r = self.codes[at].float() * self.scales[at][:, None]
        return (self.centroids[self.assign[at]].float() + r).to(self.centroids.dtype)

    def hidden(self, rows: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[m, H]`` of local ``rows`` (a row not cached gives its entry 0's: padding)."""
        return self._decode(self.entry_of[rows])

    def members(self, chosen: torch.Tensor, local_rows: int) -> torch.Tensor:
        """``[N]`` bool over local rows: the members of the ``chosen`` (``[C]`` bool) clusters."""
        mask = torch.zeros(local_rows, dtype=torch.bool, device=chosen.device)
        return mask.index_copy_(0, self.rows, chosen[self.assign])

    def update(self, carried: torch.Tensor, carried_x: torch.Tensor) -> None:
        """New inputs ``carried_x`` ``[N, H]`` of the local rows where ``carried`` (``[N]`` bool): their
        clusters' centroids move to the new members' mean and those clusters' residuals are re-encoded."""
        new = carried[self.rows]
        h = self._decode(torch.arange(self.rows.numel(), device=self.rows.device))
        h = torch.where(new[:, None], carried_x[self.rows].to(h.dtype), h)
        hit = torch.zeros(self.clusters, device=h.device).index_add_(0, self.assign, new.float()) > 0
        self._encode(h, hit)

    def num_bytes(self) -> int:
        """Bytes of centroids, codes and scales (the reference's count); ids and maps not counted."""
        tensors = (self.centroids, self.codes, self.scales)
        return sum(t.numel() * t.element_size() for t in tensors)
