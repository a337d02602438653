"""How a decode round is packed: each session's parts (:class:`RoundRows`: the local rows it forwards, the
pool slots they read, the K/V they store and a policy's per-layer hooks) laid out as one ragged row of
tokens with per-entry attention metadata (:class:`PackedRound`), which a round forward consumes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pdllm.decode_service.device_state import DeviceDenoiseState
from pdllm.decode_service.round_attention import LayerStore, group_stores

if TYPE_CHECKING:
    from pdllm.decode_service.layer_edits import PartEdit
    from pdllm.decode_service.rounds import BatchSession
    from pdllm.decode_service.split_rounds import RowSplit
    from pdllm.shared.chunk_prefill import ChunkForward


@dataclass(frozen=True)
class RoundRows:
    """One session's part of a round: local rows ``[lo, hi)`` (query + response coordinates) forwarded,
    ``kv_len`` pool slots (of its page table) its queries read besides their own K/V, and ``writes``:
    ``(local row, page, slot in page)`` whose fresh K/V the forward also stores in the pool (a decode
    policy's cache, ``policy_rounds.py``)."""

    lo: int
    hi: int
    kv_len: int
    writes: tuple[tuple[int, int, int], ...] = ()
    # Stores chosen on the device during the forward (Sparse-dLLM's per-layer selection): called at every
    # layer with the session's first packed row; such a round runs eagerly (its choices are not capturable).
    store: LayerStore | None = None
    # ``[layers]`` int32 on the device: per layer, cached slots this session's queries do not read (the
    # last ones; Sparse-dLLM's kept row that the step forwards fresh). None: none.
    drop: torch.Tensor | None = None
    # Only these local rows of ``[lo, hi)`` (ascending) are forwarded; None: all. A part with ``rows``
    # has no ``store`` and no device state.
    rows: tuple[int, ...] | None = None
    # The part's rows change between layers (``split_rounds.py``: FOCUS); such a round runs eagerly.
    split: RowSplit | None = None
    # The page table this entry reads its ``kv_len`` slots through (None: the session's pages), e.g. SDAR
    # FOCUS's: the session's first pages, then a key region of its own (``sdar_focus_rounds.py``).
    pages: tuple[int, ...] | None = None
    # The policy edits this part's layers inside the forward (DyLLM: cached K/V, contexts and FFN outputs
    # of some rows, ``layer_edits.py``); such a round runs eagerly. A part with ``edit`` forwards all rows.
    edit: PartEdit | None = None


@dataclass
class PackedRound:
    """Host-side packing of one round: ``ids``/``positions`` ``[T]``, ``rows`` (masked rows into the packed
    tokens, shifted logits applied later by the model), per-session row ``counts`` and attention metadata
    per entry (``q_offsets``, ``page_table``, ``kv_lens``, ``drops``: one entry per session part,
    :meth:`~.rounds.BatchSession.round_parts`).

    Device sessions' response tokens and rows are known only on the device: ``ids`` hold [MASK] and
    ``rows`` -1 in their place, and ``device_ids`` / ``device_rows`` (set by :func:`~.rounds.decode_round`) are
    the complete ``ids`` / ``rows`` on the device, which a forward then uses instead."""

    ids: list[int]
    positions: list[int]
    rows: list[int]
    counts: list[int]
    q_offsets: list[int]
    page_table: list[list[int]]
    kv_lens: list[int]
    # each session's response position 0 in ``ids`` (before the first packed row when its rows start
    # inside the response) and the response positions ``[r0, r1)`` among its packed rows
    starts: list[int] = field(default_factory=list)
    responses: list[tuple[int, int]] = field(default_factory=list)
    writes: list[tuple[int, int, int]] = field(default_factory=list)  # (packed row, page, slot)
    stores: list[tuple[int, LayerStore]] = field(default_factory=list)  # (first packed row, store)
    drops: list[torch.Tensor | None] = field(default_factory=list)  # per session
    # (first packed row, session index, part) of every attention entry, in order
    entries: list[tuple[int, int, RoundRows]] = field(default_factory=list)
    splits: bool = False  # some part's rows change between layers
    edits: list[tuple[int, int, PartEdit]] = field(default_factory=list)  # (entry, first packed row, edit)
    device_ids: torch.Tensor | None = None
    device_rows: torch.Tensor | None = None
    # A chunk-prefill forward carried after the round's rows (``prefill_rows.py``), or None.
    piece: ChunkForward | None = None

    @property
    def carries_piece(self) -> bool:
        """The forward carries ``piece`` in its own rows: not where a policy changes rows or K/V inside the
        forward (its per-layer choices read packed rows that the piece's would shift or join)."""
        return self.piece is not None and not (self.splits or self.edits or self.stores)

    @classmethod
    def pack(cls, sessions: list[BatchSession]) -> PackedRound:
        out = cls([], [], [], [], [0], [], [])
        for i, s in enumerate(sessions):
            parts = s.round_parts()
            lo, hi = parts[0].lo, parts[-1].hi
            base = out.q_offsets[-1]
            q = len(s.query)
            start = base + q - lo
            state = s.state
            picked: list[int] | None = None
            if any(part.rows is not None for part in parts):  # the rows forwarded, over all parts
                picked = [
                    r for part in parts for r in (range(part.lo, part.hi) if part.rows is None else part.rows)
                ]
            if isinstance(state, DeviceDenoiseState):
                assert picked is None, "a part with chosen rows steps on the host"
                response = [state.mask_id] * state.config.gen_length
                rows = [-1] * state.masked
            else:
                masked = state.positions()
                response = state.tokens.tolist()
                if picked is None:
                    rows = (masked + start).tolist()
                else:  # every masked row is among the chosen ones
                    where = {r: j for j, r in enumerate(picked)}
                    rows = [base + where[q + p] for p in masked.tolist()]
            # Slices, not query + response: a vanilla session's query is its whole prompt.
            r0, r1 = max(0, lo - q), max(0, hi - q)
            if picked is None:
                out.ids += s.query[lo:hi] + response[r0:r1]
                out.positions += range(s.query_start + lo, s.query_start + hi)
            else:
                assert all(part.store is None for part in parts)
                out.ids += [s.query[r] if r < q else response[r - q] for r in picked]
                out.positions += [s.query_start + r for r in picked]
            out.rows += rows
            out.counts.append(len(rows))
            out.starts.append(start)
            out.responses.append((r0, r1))
            for part in parts:  # one attention entry each, over the same page table
                first = out.q_offsets[-1]
                local = part.hi - part.lo if part.rows is None else len(part.rows)
                out.q_offsets.append(first + local)
                out.page_table.append(s.pages if part.pages is None else list(part.pages))
                out.kv_lens.append(part.kv_len)
                out.writes += part_writes(first, part, part.writes, part.rows)
                if part.store is not None:
                    out.stores.append((first - part.lo, part.store))
                out.drops.append(part.drop)
                out.entries.append((first, i, part))
                out.splits |= part.split is not None
                if part.edit is not None:
                    assert part.rows is None, "an edited part forwards all its rows"
                    out.edits.append((len(out.entries) - 1, first, part.edit))
        out.stores = group_stores(out.stores)  # Polestar-Cache: one store per phase for all its sessions
        return out

    def table(self, sessions: int, width: int) -> torch.Tensor:
        """The page tables as one int32 ``[sessions, width]`` CPU tensor, zero-padded (padded rows and
        slots are never read: their sessions have no query rows, slots beyond ``kv_lens`` are masked)."""
        out = torch.zeros(sessions, width, dtype=torch.int32)
        for i, pages in enumerate(self.page_table):
            out[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        return out

    def drop_table(self, layers: int, sessions: int, device: torch.device) -> torch.Tensor | None:
        """The sessions' ``drop`` as one ``[layers, sessions]`` int32 tensor (zeros where a session has
        none, and for padded sessions), or None when no session has one."""
        if all(d is None for d in self.drops):
            return None
        zero = torch.zeros(layers, dtype=torch.int32, device=device)
        columns = [zero if d is None else d for d in self.drops]
        columns += [zero] * (sessions - len(columns))
        return torch.stack(columns, dim=1)

    @property
    def table_width(self) -> int:
        """Widest page table (at least 1: a round of vanilla sessions, which hold no pages, still passes one
        zero column that no slot reads)."""
        return max([1, *(len(p) for p in self.page_table)])

    @property
    def max_q_len(self) -> int:
        return max(hi - lo for lo, hi in zip(self.q_offsets, self.q_offsets[1:]))


def part_writes(
    first: int, part: RoundRows, writes: tuple[tuple[int, int, int], ...], rows: tuple[int, ...] | None
) -> list[tuple[int, int, int]]:
    """``writes`` (local row, page, slot) of an entry whose packed rows start at ``first``, over the
    part's local rows ``rows`` (None: all of ``[lo, hi)``), as (packed row, page, slot)."""
    if rows is None:
        return [(first + row - part.lo, page, slot) for row, page, slot in writes]
    where = {r: j for j, r in enumerate(rows)}
    return [(first + where[row], page, slot) for row, page, slot in writes]
