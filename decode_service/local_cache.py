"""KV of a decode forward's own rows, kept across denoising steps so that a step can forward only some rows.

A decode step forwards its *local* rows (vanilla: prompt + response; pdllm: query suffix + response) on
top of whatever the method's attention backend adds (pdllm's static chunk KV, which stays as it is). A
decode policy (``decode_service/policies``) reuses the K/V of some local rows across steps:

- a *refresh* forward runs every local row; :class:`LocalCacheAttention` keeps each layer's K/V in a
  :class:`LocalKVCache` and otherwise passes the call through unchanged (so a refresh step computes exactly
  what a plain step computes);
- a *partial* forward runs rows ``[lo, hi)`` only (their tokens and positions); at every layer they attend
  to the cached K/V with rows ``[lo, hi)`` replaced by their fresh K/V, through the same inner backend.

A cache may hold only some rows per layer (an eviction policy's ``keep``, Sparse-dLLM): a partial forward
then sees the held rows outside ``[lo, hi)`` and its own, in ascending row order, so a cache that holds
every row gives exactly the full cache's K/V.

A policy may also *recompute some cached rows* at a layer during a partial forward (Polestar-Cache's
drift-triggered refresh): ``rows_hook`` is called per layer with the merged K/V (every local row, the cache
holding every row) and returns them with some rows replaced; it writes those rows into the cache itself, so
later steps read them too. How it gets those rows' inputs (cached hidden states) is its own business.

K is cached after RoPE (each row at its own position), so cached and fresh rows mix in any order. The
model's forward is unchanged (explicit positions, ``logits_at`` relative to the forwarded rows); this
backend is its one seam, as for every other method.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from pdllm.shared.model.attention import AttentionBackend

# Per layer, from the refresh's q and k: the ascending local rows the cache keeps (None: all).
KeepRows = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor | None]
# Per layer (layer, q, k, v, cache, inner, record): a refresh forward (``record``: every row, k/v already
# stored) or a partial one (k/v merged over every local row); returns k/v with recomputed rows replaced.
RowsHook = Callable[
    [int, torch.Tensor, torch.Tensor, torch.Tensor, "LocalKVCache", AttentionBackend, bool],
    tuple[torch.Tensor, torch.Tensor],
]


@dataclass
class LocalKVCache:
    """Per-layer ``[B, Hkv, n, D]`` keys and values of the local rows ``held[layer]`` (ascending; None:
    all ``N`` rows), from the last refresh."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    # On the host: a partial step finds where its rows fall among them without a device sync.
    held: list[torch.Tensor | None] = field(default_factory=list)
    # Per-session state a policy's ``rows_hook`` keeps beside the K/V (Polestar: clustered hidden states,
    # drift proxies); the policy objects stay stateless, the session owns everything that changes.
    aux: dict[str, object] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return bool(self.keys)

    @property
    def rows(self) -> int:
        """Entries of layer 0 (all local rows unless the cache evicts)."""
        return int(self.keys[0].shape[2]) if self.keys else 0

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, held: torch.Tensor | None = None) -> None:
        """Keep layer ``layer``'s K/V of all rows, or of the ascending rows ``held`` only."""
        if layer == 0:
            self.keys.clear()
            self.values.clear()
            self.held.clear()
        if layer != len(self.keys):
            raise ValueError(f"layer {layer} stored out of order (have {len(self.keys)} layers)")
        if held is not None:
            k, v = k.index_select(2, held), v.index_select(2, held)
            held = held.cpu()  # one sync per layer and refresh, none per cached step
        self.keys.append(k)
        self.values.append(v)
        self.held.append(held)

    def split(self, layer: int, lo: int, hi: int) -> tuple[int, int]:
        """Entries of layer ``layer`` before row ``lo`` and before row ``hi``: a partial forward of rows
        ``[lo, hi)`` reads entries ``[:a]`` and ``[b:]`` and replaces those between by its own rows."""
        held = self.held[layer]
        if held is None:
            return lo, hi
        a, b = torch.searchsorted(held, torch.tensor([lo, hi])).tolist()
        return int(a), int(b)

    def replace(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite the K/V of local ``rows`` at ``layer`` (a cache holding every row); out of place, so
        a tensor handed out earlier keeps its values."""
        if self.held[layer] is not None:
            raise ValueError("rows are replaced in a cache that holds every row, not an evicting one")
        self.keys[layer] = self.keys[layer].index_copy(2, rows, k)
        self.values[layer] = self.values[layer].index_copy(2, rows, v)

    def num_bytes(self) -> int:
        tensors = (*self.keys, *self.values)
        extra = sum(int(getattr(a, "num_bytes", lambda: 0)()) for a in self.aux.values())
        return sum(t.numel() * t.element_size() for t in tensors) + extra


@dataclass
class LocalCacheAttention:
    """One forward's attention over the local rows: ``record`` (a refresh: every row forwarded, K/V kept)
    or partial (rows ``[lo, hi)`` forwarded, the rest read from ``cache``).

    ``visible[layer]``: the local rows that layer's queries may see, ascending (None: all), over a cache
    that holds every row; the forwarded rows must be among them. ``keep`` (with ``record``): per layer, the
    rows the cache holds (an evicting refresh; the refresh itself still attends to every row). ``rows_hook``:
    per layer, recompute some cached rows (see the module docstring)."""

    inner: AttentionBackend
    cache: LocalKVCache
    lo: int = 0
    hi: int = 0
    record: bool = False
    visible: Sequence[torch.Tensor | None] | None = None
    keep: KeepRows | None = None
    rows_hook: RowsHook | None = None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.record:
            self.cache.store(layer, k, v, self.keep(layer, q, k) if self.keep is not None else None)
        else:
            if not self.cache.ready:
                raise RuntimeError("a partial decode forward needs a refreshed local KV cache first")
            if k.shape[2] != self.hi - self.lo:
                raise ValueError(f"forward has {k.shape[2]} rows, the plan [{self.lo}, {self.hi})")
            if self.visible is not None and self.cache.held[layer] is not None:
                raise ValueError("visible rows index a cache that holds every row, not an evicting one")
            ck, cv = self.cache.keys[layer], self.cache.values[layer]
            a, b = self.cache.split(layer, self.lo, self.hi)
            k = torch.cat([ck[:, :, :a], k, ck[:, :, b:]], dim=2)
            v = torch.cat([cv[:, :, :a], v, cv[:, :, b:]], dim=2)
        if self.rows_hook is not None:
            k, v = self.rows_hook(layer, q, k, v, self.cache, self.inner, self.record)
        keep = self.visible[layer] if self.visible is not None else None
        if keep is not None:
            k, v = k.index_select(2, keep), v.index_select(2, keep)
        return self.inner(layer, q, k, v)
