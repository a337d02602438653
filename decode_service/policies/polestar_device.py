"""Polestar-Cache's per-layer work in the batched rounds, with no device-to-host read in an update.

The reference (``polestar.PolestarState``) chooses the drifting clusters on the host and recomputes exactly
their rows; its row count sizes the recompute, so every layer of an update waits for the device. Here:

- the top-M clusters are chosen on the device (:func:`choose_clusters`: the reference's order, ties and
  threshold), and the rows to recompute are a ``[N]`` bool mask over local rows;
- the recompute runs over a **padded row list** of a length known on the host: the mask's rows first
  (ascending), then other local rows as padding, ``bound`` rows in all. ``bound`` per layer is the sum of
  the M largest cluster sizes (``per-layer``), or its running sum over layers capped at the cached rows
  (``propagated``: a layer's rows join the layer before's). The sizes are read once per refresh, after
  its last layer;
- padding rows are computed and dropped: the K/V writes keep the cache's old values at padding rows
  (:func:`masked_rows`), the carried inputs mark them not carried, and the recompute counter adds only
  real rows (a device scalar, read when the request's stats are).

Values equal the reference's (tested token for token, and row for row against the oracle of
``tests/oracles/polestar.py``). Planted: padding rows' K/V written unmasked -> the rounds' token tests
fail; the M smallest drifts chosen -> the recomputed rows differ from the oracle's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .polestar import Polestar, kl_drift, layer_proxy
from .polestar_device_store import DeviceClusteredHidden
from .polestar_store import split_clusters

KMEANS_ROUNDS = 20  # the reference's cap, run in full


def choose_clusters(kl: torch.Tensor, top: int, threshold: float) -> torch.Tensor:
    """``[C]`` bool: the ``top`` clusters of largest KL among those with ``KL >= threshold`` (ties: the
    lower index), as ``polestar.select_clusters`` chooses them but without leaving the device. Those at or
    above the threshold are a prefix of the descending order, so the first ``top`` of the order filtered
    are the first ``top`` of the order that pass."""
    order = torch.sort(kl, descending=True, stable=True).indices[: min(top, kl.numel())]
    chosen = torch.zeros(kl.numel(), dtype=torch.bool, device=kl.device)
    return chosen.index_copy_(0, order, kl[order] >= threshold)


def padded_rows(mask: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``bound`` local rows with ``mask``'s rows first, each group ascending (a stable sort), and
    which of them are ``mask``'s ``[bound]`` bool. Distinct rows, so masked writes never collide."""
    idx = torch.sort((~mask).to(torch.uint8), stable=True).indices[:bound]
    return idx, mask[idx]


def masked_rows(valid: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` at the real rows, ``old`` at the padding ones (rows along dim 0)."""
    return torch.where(valid.view(-1, *([1] * (new.dim() - 1))), new, old)


@dataclass
class DevicePolestarState:
    """One session's Polestar state in the rounds: per layer a :class:`DeviceClusteredHidden` store, the
    last proxy and the host bound on an update's recomputed rows; the rows carried from the layer before as
    a mask with dense inputs; the block's unmasked count at the last update; counters."""

    stores: list[DeviceClusteredHidden] = field(default_factory=list)
    log_prev: list[torch.Tensor] = field(default_factory=list)
    bounds: list[int] = field(default_factory=list)
    unmasked_at_update: int = 0
    updates: int = 0
    recomputed: torch.Tensor | None = None  # device counter of recomputed rows
    carried_mask: torch.Tensor | None = None  # [N] bool: rows recomputed at the layer before
    carried_dense: torch.Tensor | None = None  # [N, H]: their outputs (other rows: anything)

    @property
    def rows_recomputed(self) -> int:
        """Rows recomputed, summed over layers and updates (reads the device)."""
        return 0 if self.recomputed is None else int(self.recomputed)

    def num_bytes(self) -> int:
        return sum(s.num_bytes() for s in self.stores)

    def update_due(self, policy: Polestar, unmasked: int) -> bool:
        """The reference's trigger (``PolestarState.update_due``); starts the update."""
        if unmasked - self.unmasked_at_update <= policy.update_threshold:
            return False
        self.unmasked_at_update, self.updates = unmasked, self.updates + 1
        self.carried_mask, self.carried_dense = None, None
        return True

    def record(
        self,
        policy: Polestar,
        model: Any,
        layer: int,
        x: torch.Tensor,
        k: torch.Tensor,
        span: tuple[int, int],
        positions: torch.Tensor,
    ) -> None:
        """The reference's ``record`` with device stores; after the last layer, one read of every layer's
        top-M cluster sizes gives the update bounds."""
        if layer == 0:
            self.stores.clear()
            self.log_prev.clear()
        lo, hi = span
        n = x.shape[0]
        spans = split_clusters(policy.clusters, lo, n - hi)
        store = DeviceClusteredHidden.build(
            x, span, positions, spans, policy.residual_format, KMEANS_ROUNDS, policy.top_clusters
        )
        self.stores.append(store)
        self.log_prev.append(layer_proxy(model, layer, store, k) if store.clusters else torch.empty(0))
        if layer == len(model.model.layers) - 1:
            tops = torch.stack([s.top_rows for s in self.stores]).tolist()  # the refresh's one read
            cached, total = n - (hi - lo), 0
            self.bounds = []
            for top in tops:
                total = top if policy.recompute == "per-layer" else min(cached, total + top)
                self.bounds.append(total)
            if self.recomputed is None:
                self.recomputed = torch.zeros((), dtype=torch.long, device=x.device)

    def drifting(
        self, policy: Polestar, model: Any, layer: int, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """An update at ``layer``, before its attention: the padded rows to recompute ``[bound]``, which
        are real, and their inputs ``[bound, hidden]``; None when the bound is 0. ``k`` ``[1, Hkv, N, D]``:
        every local row's keys as the step sees them, in row order."""
        store, bound, carried = self.stores[layer], self.bounds[layer], self.carried_mask
        if carried is not None:
            assert self.carried_dense is not None
            store.update(carried, self.carried_dense)
        if bound == 0:  # no cached rows: nothing chosen, nothing carried
            self.carried_mask, self.carried_dense = None, None
            return None
        n = k.shape[2]
        log_p = layer_proxy(model, layer, store, k)
        chosen = choose_clusters(
            kl_drift(log_p, self.log_prev[layer]), policy.top_clusters, policy.drift_threshold
        )
        self.log_prev[layer] = log_p
        mask = store.members(chosen, n)
        if carried is not None and policy.recompute == "propagated":
            mask = mask | carried
        idx, valid = padded_rows(mask, bound)
        x = store.hidden(idx)
        if carried is not None:  # their exact inputs, not the dequantized ones
            assert self.carried_dense is not None
            x = masked_rows(carried[idx], self.carried_dense[idx].to(x.dtype), x)
        return idx, valid, x

    def finish(
        self,
        model: Any,
        layer: int,
        rows: torch.Tensor,
        valid: torch.Tensor,
        x: torch.Tensor,
        out: torch.Tensor,
        local_rows: int,
    ) -> None:
        """The rest of layer ``layer`` for the padded ``rows`` (``valid``: the real ones) from their
        attention output ``out`` ``[1, Hq, bound, D]``; the real rows' outputs are carried."""
        layer_mod = model.model.layers[layer]
        m = rows.numel()
        h = x[None] + layer_mod.self_attn.o_proj(out.transpose(1, 2).reshape(1, m, -1))
        y = (h + layer_mod.mlp(layer_mod.post_attention_layernorm(h)))[0]
        mask = torch.zeros(local_rows, dtype=torch.bool, device=rows.device)
        self.carried_mask = mask.index_copy_(0, rows, valid)
        dense = torch.zeros(local_rows, y.shape[1], dtype=y.dtype, device=y.device)
        self.carried_dense = dense.index_copy_(0, rows, y)
        assert self.recomputed is not None
        self.recomputed += valid.sum()
