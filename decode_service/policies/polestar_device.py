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

import torch

from .polestar import Polestar, replay_due
from .polestar_device_store import DeviceClusteredHidden

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
    last proxy and the host bound on an update's recomputed rows; the block's unmasked count at the last
    update; counters. The per-layer work runs batched over sessions (``polestar_record_group``,
    ``polestar_update_group``)."""

    stores: list[DeviceClusteredHidden] = field(default_factory=list)
    log_prev: list[torch.Tensor] = field(default_factory=list)
    bounds: list[int] = field(default_factory=list)
    unmasked_at_update: int = 0
    updates: int = 0
    forwards: int = 0  # refreshes and cached steps (a replayed update rate counts them)
    recomputed: torch.Tensor | None = None  # device counter of recomputed rows

    @property
    def rows_recomputed(self) -> int:
        """Rows recomputed, summed over layers and updates (reads the device)."""
        return 0 if self.recomputed is None else int(self.recomputed)

    def num_bytes(self) -> int:
        return sum(s.num_bytes() for s in self.stores)

    def update_due(self, policy: Polestar, unmasked: int) -> bool:
        """The reference's trigger (``PolestarState.update_due``, a replayed rate's included); starts the
        update."""
        self.forwards += 1
        rate = policy.replay_updates_per_forward
        if rate is not None and not replay_due(rate, self.forwards, self.updates):
            return False
        if rate is None and unmasked - self.unmasked_at_update <= policy.update_threshold:
            return False
        self.unmasked_at_update, self.updates = unmasked, self.updates + 1
        return True
