"""FOCUS on SDAR (block diffusion) in the batched rounds: each request's step rides in the round's one forward.

An :class:`SdarFocusSession` is a :class:`~.block_rounds.BlockBatchSession` whose denoising steps follow FOCUS
(its reference: ``tests/reference/focus.py``'s ``FocusBlockSession``; FOCUS's block is the window, one
generation block: the first one with the prompt's last partial block in it). Its pool pages hold slot =
position, as a plain block-diffusion session's, then a *key region* of ``R`` pages per model block of a window
(:func:`sdar_focus_slots`). The position slots are FOCUS's block store too: every row a round forwards writes
its K/V at its own slot at every layer it is forwarded through, so each window row's slot holds the K/V of the
last step that forwarded it (the reference's ``BlockKV``), and a finished block's record (forwarded ahead of
the next window, as the plain session's) overwrites them with the exact K/V.

Each model block ``m`` of the window (rows ``[s, e)``) is an attention entry of its own, block-causal as
the model: its queries are its forwarded rows, its keys the pool slots ``[0, s)`` (the cache, and the
window's earlier model blocks: forwarded rows written fresh before the attention, the others stored)
plus its own forwarded rows plus its own rows that are visible but not forwarded (phase 0: its frozen
rows; phase 1: its rows before the selection's reach that were not selected). Those last ones sit among
the forwarded rows' slots, so at every layer they are copied into the entry's region, after a copy of
the slots ``[P * page, s)`` (``P = s // page``, the page ``s`` falls in): the entry reads its first ``P``
session pages, then its region, ``s`` + the copied rows slots in all. An entry with no such rows reads
the session's pages. So each query sees exactly the reference's keys (a set: attention is order-free):
the cache, the rows of earlier model blocks (phase 1: all before the reach, as a selected row of block
``m`` is), its own block's visible rows, each once. The selection is :class:`SdarFocusRound`'s (the
window's queries and stored keys at layers 0 and 1, ``policies/focus_select.py``'s vectorized importance
and selection, one host read for all FOCUS sessions of the round). Such rounds run eagerly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from pdllm.decode_service.block_rounds import BlockBatchSession
from pdllm.decode_service.policies.focus import FocusConfig, FocusMemory, FocusStats, check_model
from pdllm.decode_service.policies.focus_select import importance_batched, select_batched
from pdllm.decode_service.request import BlockDecode
from pdllm.decode_service.round_attention import PagedBatchAttention
from pdllm.decode_service.round_packing import RoundRows
from pdllm.decode_service.split_rounds import SplitRows
from pdllm.shared.generation.device_sampler import to_device
from pdllm.shared.generation.sampler import DenoiseState, GenerationConfig, GenerationResult
from pdllm.shared.model.transformer import DiffusionLM


def region_pages(model_block: int, page_size: int) -> int:
    """Pages of one entry's key region: the tail of the page its model block starts in (at most
    ``page_size - gcd`` slots, the block starting at a multiple of ``model_block``) and a model block."""
    tail = page_size - math.gcd(page_size, model_block)
    return -(-(tail + model_block) // page_size)


def sdar_focus_slots(positions: int, gen: GenerationConfig, model_block: int, page_size: int) -> int:
    """Pool slots of an SDAR FOCUS session: its ``positions`` (prompt + answer) in whole pages, then the key
    regions of a window's model blocks."""
    pages = -(-positions // page_size)
    return (pages + gen.block // model_block * region_pages(model_block, page_size)) * page_size


@dataclass
class SdarFocusSession(BlockBatchSession):
    """An SDAR request under FOCUS in the rounds (host sampler). Made by :meth:`begin`."""

    focus: FocusConfig = field(default_factory=FocusConfig)
    device: torch.device = torch.device("cpu")
    deep: int = 0  # layers past the split
    memory: FocusMemory = field(default_factory=FocusMemory)
    stats: FocusStats = field(default_factory=FocusStats)
    reach: int = 0
    eligible: torch.Tensor | None = None
    window: int = 0  # the current window's first position

    @classmethod
    def begin(  # type: ignore[override]
        cls, model: DiffusionLM, made: BlockDecode, pages: list[int], page_size: int
    ) -> SdarFocusSession:
        check_model(model)
        assert made.focus is not None and not model.config.shift_logits
        base = BlockBatchSession.begin(model, made, pages, page_size)
        need = sdar_focus_slots(len(made.prompt) + made.gen.gen_length, made.gen, base.model_block, page_size)
        if len(pages) * page_size < need:
            raise ValueError(f"an SDAR FOCUS session needs {need // page_size} pages, got {len(pages)}")
        return cls(
            base.query, 0, base.kv_tokens, base.pages, base.state, model_block=base.model_block,
            page_size=page_size, prefill_s=base.prefill_s, focus=made.focus,
            device=next(model.parameters()).device, deep=model.config.num_layers - 2,
        )  # fmt: skip

    def slot(self, position: int) -> tuple[int, int]:
        """(page, slot in page) of ``position``."""
        return self.pages[position // self.page_size], position % self.page_size

    def stored(self, r: int) -> tuple[int, int]:
        """(page, slot in page) of window row ``r``'s K/V (its position's slot)."""
        return self.slot(self.window + r)

    def region(self, m: int) -> list[int]:
        """The key region's pages of the window's model block ``m``."""
        n = region_pages(self.model_block, self.page_size)
        first = -(-self.local_rows // self.page_size) + m * n
        return self.pages[first : first + n]

    def entry(self, m: int, a: int, hidden: list[int]) -> tuple[int, tuple[int, ...], list]:
        """The window's model block ``m`` (from window row ``a``) reading its visible but not forwarded
        window rows ``hidden``: (kv_len, page table, copies (source, target) into its region)."""
        s = self.window + a
        if not hidden:
            return s, tuple(self.pages), []
        ps, region = self.page_size, self.region(m)
        head = s // ps * ps
        targets = [(region[i // ps], i % ps) for i in range(s - head + len(hidden))]
        sources = [self.slot(j) for j in range(head, s)] + [self.stored(r) for r in hidden]
        pages = (*self.pages[: s // ps], *region)
        return s + len(hidden), pages, list(zip(sources, targets, strict=True))

    def blocks(self) -> list[tuple[int, int]]:
        """The window's model blocks as window rows ``[a, b)``."""
        p, state = len(self.query), self.state
        end = p + state.spans[state.block][1]
        out, a = [], self.window
        while a < end:
            b = min(end, (a // self.model_block + 1) * self.model_block)
            out.append((a - self.window, b - self.window))
            a = b
        return out

    def round_parts(self) -> list[RoundRows]:
        """The finished block's record (if one is owed), then the window's model blocks, each forwarding its
        unfrozen rows through layers 0-1."""
        state, p = self.state, len(self.query)
        lo, hi = state.spans[state.block]
        window = p + lo if state.block else self.kv_tokens
        parts = self._entries(self.kv_tokens, window, store_last=True)
        self.kv_tokens = self.window = window
        if state.block != self.memory.block:
            masked = [False] * (p + lo - window) + (state.tokens[lo:hi] == state.mask_id).tolist()
            self.memory.start_block(state.block, masked, self.focus.delayed_cache)
        frozen = self.memory.frozen
        splits = SdarFocusSplits(self, [r for r, f in enumerate(frozen) if not f], state.quota())
        for m, (a, b) in enumerate(self.blocks()):
            active = [r for r in range(a, b) if not frozen[r]]
            kv_len, pages, _ = self.entry(m, a, [r for r in range(a, b) if frozen[r]] if active else [])
            writes = tuple((window + r, *self.stored(r)) for r in active)
            rows = tuple(window + r for r in active)
            split = SdarFocusEntry(splits, m, a, b)
            parts.append(
                RoundRows(window + a, window + b, kv_len, writes, rows=rows, split=split, pages=pages)
            )
        return parts

    def apply(self, tokens: torch.Tensor, confidence: torch.Tensor) -> None:
        """The sampler unmasks among the eligible rows; FOCUS observes what it unmasked."""
        state = self.state
        assert isinstance(state, DenoiseState) and self.eligible is not None
        picked = state.apply(tokens, confidence, self.eligible)
        self.eligible = None
        offset = len(self.query) - self.window
        self.memory.observe((picked + offset).tolist(), self.reach, self.focus.delayed_cache)
        self.stats.decoded += len(picked)

    def result(self) -> GenerationResult:
        result = super().result()
        result.cache = {"policy": self.focus.name, **self.stats.as_dict()}
        return result


@dataclass
class SdarFocusSplits:
    """One SDAR FOCUS session's step: its unfrozen window rows ``active``, the schedule's ``quota``."""

    session: SdarFocusSession
    active: list[int]
    quota: int | None

    @property
    def hi(self) -> int:
        return len(self.session.memory.masked)


@dataclass
class SdarFocusEntry:
    """The split of one model block ``m`` (window rows ``[a, b)``) of an SDAR FOCUS session's step."""

    layers: ClassVar[int] = 2
    step: SdarFocusSplits
    m: int
    a: int
    b: int

    @classmethod
    def group(cls, members: list[tuple[int, SdarFocusEntry]]) -> SdarFocusRound:  # type: ignore[override]
        return SdarFocusRound(members)


def _copies(
    pairs: list[tuple[tuple[int, int], tuple[int, int]]], device: torch.device
) -> torch.Tensor | None:
    """``[4, n]`` long (source page, source slot, target page, target slot) of pool copies, or None."""
    if not pairs:
        return None
    flat = [x for (src, dst) in pairs for x in (*src, *dst)]
    return to_device(flat, torch.long, device).view(-1, 4).T


class SdarFocusRound:
    """The SDAR FOCUS sessions of one round (:class:`~.split_rounds.SplitGroup`): each model block's region
    copied at every layer, layers 0-1's window queries and stored keys (the active rows of a window are
    consecutive packed rows, from its first model block's), the selection of every session after layer 1
    (one host read for all; sessions of one window width and knobs form one padded batch of the vectorized
    selection), and one :class:`~.split_rounds.SplitRows` per model block."""

    def __init__(self, members: list[tuple[int, SdarFocusEntry]]) -> None:
        self.entries = members
        firsts: dict[int, tuple[int, SdarFocusSplits]] = {}
        for first, entry in members:
            firsts.setdefault(id(entry.step), (first, entry.step))
        self.members = list(firsts.values())
        self.device = self.members[0][1].session.device
        batches: dict[tuple[FocusConfig, int, int], list[int]] = {}
        for i, (_, split) in enumerate(self.members):
            key = (split.session.focus, split.hi, split.session.state.config.block)
            batches.setdefault(key, []).append(i)
        self.batches = list(batches.items())
        self.captured: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in self.batches]
        self.indices = [self._indices(rows, w) for (_, w, _), rows in self.batches]
        self.copy = self._frozen_copies()  # layers 0-1

    def _frozen_copies(self) -> torch.Tensor | None:
        """Layers 0-1: every model block's frozen rows into its region."""
        pairs = []
        for _, entry in self.entries:
            s, frozen = entry.step.session, entry.step.session.memory.frozen
            active = [r for r in range(entry.a, entry.b) if not frozen[r]]
            if active:
                pairs += s.entry(entry.m, entry.a, [r for r in range(entry.a, entry.b) if frozen[r]])[2]
        return _copies(pairs, self.device)

    def _indices(self, which: list[int], width: int) -> tuple[torch.Tensor, ...]:
        """Packed rows of the forwarded window rows, their padded places, and the window's stored slots."""
        packed, places, pages, slots = [], [], [], []
        for i, m in enumerate(which):
            first, split = self.members[m]
            packed += [first + j for j in range(len(split.active))]
            places += [i * width + r for r in split.active]
            stored = [split.session.stored(r) for r in range(width)]
            pages += [p for p, _ in stored]
            slots += [o for _, o in stored]
        flat = to_device([*packed, *places, *pages, *slots], torch.long, self.device)
        n, m = len(packed), len(pages)
        return flat[:n], flat[n : 2 * n], flat[2 * n : 2 * n + m], flat[2 * n + m :]

    def __call__(
        self,
        layer: int,
        base: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention: PagedBatchAttention,
    ) -> None:
        kv = attention.kv[layer]  # [2, pages, Hkv, page_size, D]
        if self.copy is not None:
            src_p, src_s, dst_p, dst_s = self.copy
            kv[:, dst_p, :, dst_s] = kv[:, src_p, :, src_s]
        if layer >= SdarFocusEntry.layers:
            return
        for b, ((_, width, _), which) in enumerate(self.batches):
            packed, places, pages, slots = self.indices[b]
            r = len(which)
            qpad = q.new_zeros(r * width, q.shape[1], q.shape[3])
            qpad.index_copy_(0, places, q[0][:, packed].transpose(0, 1))
            keys = kv[0][pages, :, slots]  # [r * width, Hkv, D], the window's fresh rows written in
            self.captured[b][layer] = (
                qpad.view(r, width, *qpad.shape[1:]).transpose(1, 2),
                keys.view(r, width, *keys.shape[1:]).transpose(1, 2),
            )

    def selections(self) -> list[list[int]]:
        """Every session's selected window rows (ascending; one host read for all)."""
        chosen = []
        for b, ((focus, _, limit), which) in enumerate(self.batches):
            memories = [self.members[m][1].session.memory for m in which]
            splits = [self.members[m][1] for m in which]

            masked = to_device([m.masked for m in memories], torch.bool, self.device)
            frozen = to_device([m.frozen for m in memories], torch.bool, self.device)
            valid = torch.ones_like(masked)
            per = [
                [m.reach, m.k_hist(focus.alpha), s.quota or 0] for m, s in zip(memories, splits, strict=True)
            ]
            reach, k_hist, quota = to_device(per, torch.long, self.device).unbind(1)
            cap, queries, kernel = self.captured[b], valid & ~frozen, focus.pool_kernel
            delta = importance_batched(*cap[1], queries, valid, kernel) - importance_batched(
                *cap[0], queries, valid, kernel
            )
            chosen.append(select_batched(delta, masked, frozen, valid, reach, k_hist, quota, focus, limit))
        host = torch.cat([c.flatten() for c in chosen]).cpu()  # the step's one read
        out: list[list[int]] = [[] for _ in self.members]
        at = 0
        for (_, width, _), which in self.batches:
            for m in which:
                out[m] = host[at : at + width].nonzero().flatten().tolist()
                at += width
        return out

    def choose(self) -> list[SplitRows]:
        """Every session's selection (one host read), then per model block its rows past layer 1."""
        chosen = {id(step): sel for (_, step), sel in zip(self.members, self.selections(), strict=True)}
        out, pairs, seen = [], [], set()
        for _, entry in self.entries:
            step = entry.step
            sel = chosen[id(step)]
            if id(step) not in seen:
                seen.add(id(step))
                logits = _counters(step, sel)
            else:
                logits = None
            s = step.session
            kept = [r for r in sel if entry.a <= r < entry.b]
            hidden = [r for r in range(entry.a, min(entry.b, s.reach)) if r not in kept] if kept else []
            kv_len, pages, copies = s.entry(entry.m, entry.a, hidden)
            pairs += copies
            writes = tuple((s.window + r, *s.stored(r)) for r in kept)
            rows = tuple(s.window + r for r in kept)
            out.append(SplitRows(rows, kv_len, writes, logits, pages))
        self.copy = _copies(pairs, self.device)  # layers >= 2
        return out


def _counters(step: SdarFocusSplits, sel: list[int]) -> tuple[bool, ...]:
    """The session's reach, eligible rows and counters after selecting window rows ``sel`` (as the
    reference's step); per masked row, whether its logits are needed."""
    s = step.session
    mem = s.memory
    s.reach = max(mem.reach, sel[-1] + 1)
    kept = set(sel)
    logits = tuple(j in kept for j, m in enumerate(mem.masked) if m)  # lead 0: every kept masked row
    s.eligible = torch.tensor(logits, dtype=torch.bool)
    width = len(mem.masked)
    n_kept = sum(1 for r in sel if mem.masked[r])
    st = s.stats
    st.forwards += 1
    st.rows_forwarded += len(sel) * s.deep
    st.rows_plain += width * s.deep
    st.rows_prefix += len(step.active) * 2
    st.focused += n_kept
    st.evicted += len(logits) - n_kept
    st.frozen += sum(mem.frozen)
    return logits
