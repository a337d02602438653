"""The rounds' attention: every entry's queries over its own pool pages and its own fresh rows.

:class:`PagedBatchAttention` is the backend a round's forward passes to every layer: it stores the K/V a
round writes into the pool (``writes``, then the per-layer ``stores``), then runs one ragged attention call
(``kernels/ragged_attention``) over all entries, a carried chunk-prefill piece's rows included: the entries
through split-S (the Triton kernel, or :func:`gathered_attention` off the GPU). Where a policy's edit asks
for it (``wants_lse``), the call also keeps each entry row's log-sum-exp in :attr:`PagedBatchAttention.lse`.
Polestar's recompute attends through :meth:`PagedBatchAttention.paged`, the same entry point.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from pdllm.kernels.gathered_attention import gathered_attention, row_lse
from pdllm.kernels.ragged_attention import DecodeRows, Group, RaggedBatch, ragged_attention

if TYPE_CHECKING:
    from pdllm.decode_service.layer_edits import LayerEdits
    from pdllm.decode_service.prefill_rows import PrefillRows

__all__ = [
    "ROUND_ATTENTIONS",
    "LayerStore",
    "PagedBatchAttention",
    "gathered_attention",
    "group_stores",
    "row_lse",
]

ROUND_ATTENTIONS = ("torch", "triton")

LayerStore = Callable[[int, int, torch.Tensor, torch.Tensor, torch.Tensor, "PagedBatchAttention"], None]
"""``(layer, first packed row, q [1, Hq, T, D], k [T, Hkv, D], v [T, Hkv, D], the round's attention)``,
called before the layer's attention; it may store into ``attention.kv`` (the pool's K/V) and attend with
``attention.paged``. A store with an ``attach(model)`` context manager has it entered around the forward;
one with a ``layer_inputs`` dict gets each layer's input ``[1, T, H]`` there, under the layer's index, before
the layer runs (Polestar-Cache's refresh)."""


def group_stores(stores: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """``stores`` (first packed row, store) with those that share a ``group_key`` replaced by one store,
    their type's ``grouped`` of them (in the first one's place): one call per layer for all of them.
    Grouped stores touch only their own sessions' rows and slots, so their order does not matter. A grouped
    store gets ``members`` (its parts' stores, in order) and must have ``rebase(bases)``: a split round moves
    the rows of the layers after it."""
    groups: dict[Any, list[tuple[int, Any]]] = {}
    out: list[tuple[int, Any]] = []
    for base, store in stores:
        key = getattr(store, "group_key", None)
        if key is None:
            out.append((base, store))
        elif key in groups:
            groups[key].append((base, store))
        else:
            groups[key] = [(base, store)]
            out.append((base, groups[key]))
    grouped: list[tuple[int, Any]] = []
    for b, s in out:
        if isinstance(s, list):
            store = type(s[0][1]).grouped(s)
            store.members = [m for _, m in s]  # the parts' own stores, so a later split can rebase them
            s = store
        grouped.append((b, s))
    return grouped


class PagedBatchAttention:
    """Every session's queries attend to its own static KV (pool pages) and to its own local tokens.

    ``kernel``: "triton" (the split-S kernel, CUDA or the Triton interpreter) or "torch" (gathered KV and
    SDPA per session, :func:`gathered_attention`, for CPU). All sizes are fixed on the host, so no call reads the device.

    ``writes`` (optional, three long tensors ``[W]``: packed row, pool page, slot in page): rows whose
    fresh K/V each layer also stores in the pool, where later rounds read them as paged KV (a decode
    policy's cache of local rows). Each layer stores before it attends, so an entry may read slots another
    entry of the same round stores (block diffusion: a finished block's record, earlier model blocks).

    ``lse``: after a layer call, each packed row's natural-log log-sum-exp ``[T, Hq]`` float32 of the
    scores it was normalized over (its static KV pages, then its entry's local rows as the edits left
    them), when some edit ``wants_lse``; else None (and not computed).
    """

    def __init__(
        self,
        kv: torch.Tensor,
        page_table: torch.Tensor,
        kv_lens: torch.Tensor,
        q_offsets: torch.Tensor,
        max_q_len: int,
        max_kv_len: int,
        kernel: str,
        writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        stores: list[tuple[int, LayerStore]] | None = None,
        drop: torch.Tensor | None = None,
    ) -> None:
        if kernel not in ROUND_ATTENTIONS:
            raise ValueError(f"round attention must be one of {ROUND_ATTENTIONS}, got {kernel!r}")
        self.kv, self.page_table, self.kv_lens, self.q_offsets = kv, page_table, kv_lens, q_offsets
        self.max_q_len, self.max_kv_len, self.kernel = max_q_len, max_kv_len, kernel
        self.writes, self.stores, self.drop = writes, stores or [], drop  # drop: [layers, sessions]
        self.edits: list[LayerEdits] = []  # a policy's edits of some parts' layers (``layer_edits.py``)
        # A chunk-prefill forward's rows after the round's (``prefill_rows.py``): a piece group of the call.
        self.prefill: PrefillRows | None = None
        self.lse: torch.Tensor | None = None

    @property
    def edit_ffn(self) -> Callable[[int, torch.Tensor], torch.Tensor] | None:
        """The decoder layer's hook for the FFN output ``[1, T, H]`` (None: no part edits it)."""
        if not self.edits:
            return None

        def edit(layer: int, ffn: torch.Tensor) -> torch.Tensor:
            for e in self.edits:
                ffn = e.ffn(layer, ffn)
            return ffn

        return edit

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qt = q[0].transpose(0, 1)
        kl = k[0].transpose(0, 1)  # strided views: the kernel takes row strides, no copy
        vl = v[0].transpose(0, 1)
        s = qt.shape[0] if self.prefill is None else self.prefill.start
        if self.prefill is not None:
            self.prefill.stage(layer, kl[s:], vl[s:])
        qd, kd, vd = qt[:s], kl[:s], vl[:s]  # the round's own rows; a carried piece's follow
        if self.writes is not None:
            rows, pages, slots = self.writes
            self.kv[layer, 0][pages, :, slots] = kd.index_select(0, rows)
            self.kv[layer, 1][pages, :, slots] = vd.index_select(0, rows)
        for base, store in self.stores:
            store(layer, base, q, kd, vd, self)
        for e in self.edits:
            e.before(layer, kd, vd, self)
        kv_lens = self.kv_lens if self.drop is None else self.kv_lens - self.drop[layer]
        decode = DecodeRows(0, s, self.page_table, kv_lens, self.q_offsets, self.max_q_len, self.max_kv_len)
        groups: tuple[Group, ...] = (decode,) if self.prefill is None else (decode, self.prefill.piece)
        wants = any(e.wants_lse for e in self.edits)
        lse = qt.new_empty(qt.shape[:2], dtype=torch.float32) if wants else None
        out = ragged_attention(
            qt, kl, vl, RaggedBatch(groups), self.kv[layer, 0], self.kv[layer, 1], self.kernel, lse_out=lse
        )
        self.lse = None if lse is None else lse[:s]
        if self.edits:
            mine = out[:s]
            for e in self.edits:
                mine = e.after(layer, qd, kd, mine, self)
            if self.prefill is None:
                out = mine
            else:  # the piece's rows stay as attended
                out[:s] = mine
        return out.transpose(0, 1)[None]

    def paged(
        self,
        layer: int,
        q: torch.Tensor,
        page_table: torch.Tensor,
        kv_lens: torch.Tensor,
        q_offsets: torch.Tensor,
        max_q_len: int,
        max_kv_len: int,
        k_local: torch.Tensor | None = None,
        v_local: torch.Tensor | None = None,
        lse_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Split-S attention ``[T, Hq, D]`` of packed queries ``q`` ``[T, Hq, D]`` over layer ``layer``'s
        pool pages (and local K/V, if given), in this round's kernel; each row's natural-log log-sum-exp
        written into ``lse_out`` ``[T, Hq]`` float32 when given."""
        rows = DecodeRows(
            0, q.shape[0], page_table, kv_lens, q_offsets, max_q_len, max_kv_len, k_local is not None
        )
        return ragged_attention(
            q, k_local, v_local, RaggedBatch((rows,)), self.kv[layer, 0], self.kv[layer, 1], self.kernel,
            lse_out=lse_out,
        )  # fmt: skip
