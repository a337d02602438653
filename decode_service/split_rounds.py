"""Rounds whose rows change between layers: the forward keeps fewer rows of some parts past a layer.

A part of a round may carry a :class:`RowSplit` (SDAR's FOCUS: ``sdar_focus_rounds.py``). Such a round
(:func:`split_forward`) runs layers ``[0, layers)`` over every packed row, as any round; then each kind of
split chooses, for all its parts at once (:meth:`SplitGroup.choose`), the rows each keeps, its ``kv_len``
and the K/V it stores from there on (:class:`SplitRows`). The forward compacts the hidden states and RoPE
tables to the kept rows, rebuilds the attention metadata (every other part keeps all its rows, its stores
and writes moved to its new packed rows) and runs the remaining layers and the LM head over the rows whose
logits are needed (a split part's others get zero logits, which its sampler never picks). Rounds without a
split never come here; a round with one runs eagerly (its choice is made inside the forward).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from pdllm.decode_service.round_attention import PagedBatchAttention
from pdllm.decode_service.round_packing import PackedRound, part_writes
from pdllm.shared.generation.device_sampler import to_device

if TYPE_CHECKING:
    from pdllm.decode_service.rounds import EagerRoundForward


@dataclass(frozen=True)
class SplitRows:
    """What a split part forwards past the split: local ``rows`` (ascending, among its own), the pool
    slots ``kv_len`` its queries read, ``writes`` (local row, page, slot) stored at every later layer, and
    ``logits``: per masked row of its session (the round's rows, in order), whether its logits are needed
    (None: all)."""

    rows: tuple[int, ...]
    kv_len: int
    writes: tuple[tuple[int, int, int], ...] = ()
    logits: tuple[bool, ...] | None = None
    pages: tuple[int, ...] | None = None  # the entry's page table from here on (None: unchanged)


class SplitGroup(Protocol):
    """The parts of one kind of split in a round. Called at every layer as a round's
    :data:`~.round_attention.LayerStore` (with base 0: it knows its parts' packed rows), before the attention."""

    def __call__(
        self,
        layer: int,
        base: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention: PagedBatchAttention,
    ) -> None: ...

    def choose(self) -> list[SplitRows]:
        """After layer ``layers - 1``: each part's rows from here on, in the order of its members."""
        ...


class RowSplit(Protocol):
    """A part's split: ``layers`` run over its packed rows, :meth:`group` gathers a round's splits of one
    kind, as (first packed row of the part, split), packed order."""

    layers: int

    @classmethod
    def group(cls, members: list[tuple[int, RowSplit]]) -> SplitGroup: ...


@dataclass
class AfterSplit:
    """The packed rows kept (``keep``, ascending), each packed row's index among them (``index``, -1:
    dropped), the metadata of the rest of the round (``packed``: attention entries only) and the
    positions in the round's ``rows`` whose logits are computed (None: all)."""

    keep: list[int]
    index: list[int]
    packed: PackedRound
    needed: list[int] | None


def after_split(packed: PackedRound, chosen: dict[int, SplitRows]) -> AfterSplit:
    """The round past the split: ``chosen`` (attention entry -> rows) for the split parts (an entry may
    have no rows, so entries, not first packed rows, name them)."""
    new = PackedRound([], [], [], list(packed.counts), [0], [], [])
    index, keep = [-1] * len(packed.ids), []
    logits: dict[int, tuple[bool, ...]] = {}  # session -> rows whose logits are needed
    moved: dict[int, int] = {}  # id(a part's store) -> the part's first packed row after the split
    for e, (first, session, part) in enumerate(packed.entries):
        got = chosen.get(e) if part.split is not None else None
        table = packed.page_table[e]
        if got is None:
            kept = list(range(first, packed.q_offsets[e + 1]))
            kv_len, writes, rows = part.kv_len, part.writes, part.rows
        else:
            local = range(part.lo, part.hi) if part.rows is None else part.rows
            where = {r: j for j, r in enumerate(local)}
            kept = [first + where[r] for r in got.rows]
            kv_len, writes, rows = got.kv_len, got.writes, got.rows
            table = table if got.pages is None else list(got.pages)
            if got.logits is not None:
                logits[session] = got.logits
        at = len(keep)
        for j, p in enumerate(kept):
            index[p] = at + j
        keep += kept
        new.q_offsets.append(len(keep))
        new.page_table.append(table)
        new.kv_lens.append(kv_len)
        new.writes += part_writes(at, part, writes, rows)
        if part.store is not None:
            moved[id(part.store)] = at - part.lo
        new.drops.append(packed.drops[e])
        new.entries.append((at, session, part))
    # The round's own stores, at their rows' new places: a grouped store (one for several parts, made by
    # PackedRound.pack) stays the same object, since the forward feeds it, and learns its members' bases.
    for _, store in packed.stores:
        members = getattr(store, "members", None)
        if members is None:
            new.stores.append((moved[id(store)], store))
        else:
            store.rebase([moved[id(m)] for m in members])
            new.stores.append((moved[id(members[0])], store))
    needed = None
    if logits:
        needed, start = [], 0
        for session, n in enumerate(packed.counts):
            wanted = logits.get(session)
            needed += [start + j for j in range(n) if wanted is None or wanted[j]]
            start += n
    return AfterSplit(keep, index, new, needed)


def split_forward(forward: EagerRoundForward, packed: PackedRound) -> torch.Tensor:
    """A round with splits, op by op: logits of the packed ``rows`` (zeros where not needed)."""
    model, device = forward.model, forward.pool.kv.device
    kinds: dict[type, list[tuple[int, RowSplit]]] = {}
    entries: dict[type, list[int]] = {}
    for e, (first, _, part) in enumerate(packed.entries):
        if part.split is not None:
            kinds.setdefault(type(part.split), []).append((first, part.split))
            entries.setdefault(type(part.split), []).append(e)
    depth = {split.layers for members in kinds.values() for _, split in members}
    if len(depth) != 1:
        raise ValueError(f"the splits of a round must keep rows after one layer, got {sorted(depth)}")
    at = depth.pop()
    groups = [kind.group(members) for kind, members in kinds.items()]
    hooks: list = [(0, g) for g in groups]
    ids, positions, rows = forward.inputs(packed)
    attention = forward.attention(packed)
    attention.stores = [*attention.stores, *hooks]
    if packed.edits:  # splits are SDAR's FOCUS, layer edits Dream's DyLLM: one model, never both
        raise ValueError("a round with a row split carries no layer edits")
    layers = model.model.layers
    with ExitStack() as stack:
        for _, store in packed.stores:
            attach = getattr(store, "attach", None)
            if attach is not None:
                stack.enter_context(attach(model))
        x, cos, sin = model.embed(ids[None], positions[None])
        x = forward.run_layers(packed, layers[:at], x, cos, sin, attention)
        chosen: dict[int, SplitRows] = {}
        for group, kind in zip(groups, kinds, strict=True):
            choices = group.choose()
            chosen.update(zip(entries[kind], choices, strict=True))
        after = after_split(packed, chosen)
        keep = to_device(after.keep, torch.long, device)
        x, cos, sin = x[:, keep], cos[:, keep], sin[:, keep]
        rest = forward.attention(after.packed)
        rest.stores = [*rest.stores, *hooks]
        x = forward.run_layers(packed, layers[at:], x, cos, sin, rest)
        hidden = model.model.norm(x)
    rows = to_device(after.index, torch.long, device).index_select(0, rows)
    if after.needed is None:
        return model.logits_from_hidden(hidden, rows[None])[0]
    return _some_logits(model, hidden, rows, after.needed)


def _some_logits(model, hidden: torch.Tensor, rows: torch.Tensor, needed: Sequence[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Logits of ``rows`` at positions ``needed``, zeros elsewhere."""
    at = to_device(list(needed), torch.long, rows.device)
    part = model.logits_from_hidden(hidden, rows.index_select(0, at)[None])[0]
    return part.new_zeros(rows.numel(), part.shape[-1]).index_copy_(0, at, part)
