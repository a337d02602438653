"""FOCUS (Dream / LLaDA) in the batched rounds: each request's step rides in the round's one forward.

A :class:`FocusBatchSession` is a :class:`~.rounds.BatchSession` whose steps follow FOCUS (``policies/
focus.py``; its reference loop, ``tests/reference/focus.py``'s ``FocusLogits``, is the specification; the
selection is ``focus_select``'s vectorized one). Its local rows are the plain session's (query or prompt, then
the response); its pool pages hold its static KV, then ``B`` *region* slots, then ``B`` *store* slots (``B``:
the block length, :func:`focus_slots`). The store keeps, per layer, the K/V of the block's rows from the last
step that forwarded them (slot ``B + r`` for block row ``r``), written by the round for every block row it
forwards. Per step, in a round that may hold any other sessions:

- **layers 0-1** (the part's rows): every local row but the block's frozen ones; the frozen rows' K/V are
  copied from the store into the region at each of those layers, and the entry reads ``static + frozen``
  pool slots besides its own rows, so its keys are the context and every block row, each once;
- after layer 1, :class:`FocusRound` computes the importance delta of every FOCUS session of the round
  from the block rows' queries and stored keys of layers 0 and 1 and selects their rows
  (``focus_select.importance_batched`` / ``select_batched``, one host read for all); the forward keeps the
  context and the selected rows (``split_rounds.py``);
- **layers >= 2**: the block rows ``[0, reach)`` that are not selected are copied into the region at each
  layer (the entry reads ``static + that many`` slots), the selected ones are forwarded and stored;
- the LM head runs on the eligible rows only (the others' logits are zeros, as the reference's); the
  sampler unmasks among the eligible rows (:meth:`FocusBatchSession.apply`) and FOCUS observes it.

Keys are a set (attention is order-free), so each query sees exactly the reference's keys. Such rounds run
eagerly. SDAR's FOCUS requests ride in the rounds too (``sdar_focus_rounds.py``: the window's model blocks
as entries, each with a key region of its own), their selection this module's :class:`FocusRound`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from pdllm.decode_service.policies.focus import FocusConfig, FocusMemory, FocusStats, check_model
from pdllm.decode_service.policies.focus_select import importance_batched, select_batched
from pdllm.decode_service.request import StaticDecode
from pdllm.decode_service.round_attention import PagedBatchAttention
from pdllm.decode_service.round_packing import RoundRows
from pdllm.decode_service.rounds import CachingSession
from pdllm.decode_service.split_rounds import SplitRows
from pdllm.shared.generation.device_sampler import to_device
from pdllm.shared.generation.sampler import DenoiseState, GenerationConfig, GenerationResult
from pdllm.shared.model.transformer import DiffusionLM


def focus_slots(gen: GenerationConfig) -> int:
    """Pool slots a FOCUS session holds beyond its static KV: the region and the store, a block each."""
    return 2 * gen.block


@dataclass
class FocusBatchSession(CachingSession):
    """A Dream/LLaDA request under FOCUS in the rounds (host sampler). Made by :meth:`begin`."""

    focus: FocusConfig = field(default_factory=FocusConfig)
    lead: int = 0  # 1: a row's logits come from the row before it (Dream)
    deep: int = 0  # layers past the split
    device: torch.device = torch.device("cpu")
    memory: FocusMemory = field(default_factory=FocusMemory)
    stats: FocusStats = field(default_factory=FocusStats)
    reach: int = 0  # the last step's visible prefix of the block at layers >= 2
    eligible: torch.Tensor | None = None  # the last step's eligible masked rows (bool, host)

    @classmethod
    def begin(
        cls, model: DiffusionLM, built: StaticDecode, pages: list[int], page_size: int
    ) -> FocusBatchSession:
        check_model(model, block_diffusion=False)
        focus, gen = built.cache_policy, built.gen
        assert isinstance(focus, FocusConfig)
        need = -(-(built.kv_tokens + focus_slots(gen)) // page_size)
        if len(pages) < need:
            raise ValueError(f"a FOCUS session needs {need} pages (static KV + block K/V), got {len(pages)}")
        c = model.config
        state = DenoiseState(gen, c.mask_token_id, c.eos_token_id, "cpu")
        return cls(
            list(built.query), built.query_start, built.kv_tokens, list(pages), state, focus=focus,
            page_size=page_size, lead=1 if c.shift_logits else 0, deep=c.num_layers - 2,
            device=next(model.parameters()).device,
        )  # fmt: skip

    def stored(self, r: int) -> tuple[int, int]:
        """(page, slot in page) of block row ``r``'s stored K/V."""
        return self.slot(self.state.config.block + r)

    def round_parts(self) -> list[RoundRows]:
        """Layers 0-1 of the next step: every local row but the block's frozen ones."""
        state, q = self.state, len(self.query)
        a, b = state.spans[state.block]
        if state.block != self.memory.block:
            masked = (state.tokens[a:b] == state.mask_id).tolist()
            self.memory.start_block(state.block, masked, self.focus.delayed_cache)
        lo, hi, n = q + a, q + b, self.local_rows
        frozen = self.memory.frozen
        active = [r for r in range(b - a) if not frozen[r]]
        rows = (*range(lo), *(lo + r for r in active), *range(hi, n))
        writes = tuple((lo + r, *self.stored(r)) for r in active)
        split = FocusSplit(self, lo, hi, active, state.quota())
        return [RoundRows(0, n, self.kv_tokens + b - a - len(active), writes, rows=rows, split=split)]

    def apply(self, tokens: torch.Tensor, confidence: torch.Tensor) -> None:
        """The sampler unmasks among the eligible rows; FOCUS observes what it unmasked."""
        state = self.state
        assert isinstance(state, DenoiseState) and self.eligible is not None
        a = state.spans[state.block][0]
        picked = state.apply(tokens, confidence, self.eligible)
        self.eligible = None
        self.memory.observe((picked - a).tolist(), self.reach, self.focus.delayed_cache)
        self.stats.decoded += len(picked)

    def result(self) -> GenerationResult:
        result = super().result()
        result.cache = {"policy": self.focus.name, **self.stats.as_dict()}
        return result


@dataclass
class FocusSplit:
    """One FOCUS session's step in a round: block rows ``[lo, hi)`` (local), the unfrozen block rows
    ``active`` forwarded through layers 0-1, the fixed schedule's ``quota``."""

    layers: ClassVar[int] = 2
    session: FocusBatchSession
    lo: int
    hi: int
    active: list[int]
    quota: int | None

    @classmethod
    def group(cls, members: list[tuple[int, FocusSplit]]) -> FocusRound:  # type: ignore[override]
        return FocusRound(members)


def _copies(
    pairs: list[tuple[tuple[int, int], tuple[int, int]]], device: torch.device
) -> torch.Tensor | None:
    """``[4, n]`` long (source page, source slot, target page, target slot) of pool copies, or None."""
    if not pairs:
        return None
    flat = [x for (src, dst) in pairs for x in (*src, *dst)]
    return to_device(flat, torch.long, device).view(-1, 4).T


class FocusRound:
    """The FOCUS sessions of one round (:class:`~.split_rounds.SplitGroup`): the region copies at every
    layer, layers 0-1's queries and block keys, and the selection of all of them after layer 1. Sessions
    of one block length and knobs form one padded batch of the vectorized selection."""

    def __init__(self, members: list[tuple[int, FocusSplit]]) -> None:
        self.members = members
        self.device = members[0][1].session.device
        batches: dict[tuple[FocusConfig, int, int], list[int]] = {}
        for i, (_, split) in enumerate(members):
            key = (split.session.focus, split.hi - split.lo, split.session.state.config.block)
            batches.setdefault(key, []).append(i)
        self.batches = list(batches.items())
        self.captured: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in self.batches]
        self.indices = [self._indices(rows, w) for (_, w, _), rows in self.batches]
        self.copy = self._frozen_copies()  # layers 0-1

    def _frozen_copies(self) -> torch.Tensor | None:
        """Layers 0-1: every session's frozen block rows into its region."""
        members = self.members
        frozen = []
        for _, split in members:
            s, active = split.session, set(split.active)
            hidden = [r for r in range(split.hi - split.lo) if r not in active]
            frozen += [(s.stored(r), s.slot(j)) for j, r in enumerate(hidden)]
        return _copies(frozen, self.device)

    def _indices(self, which: list[int], width: int) -> tuple[torch.Tensor, ...]:
        """Packed rows of the forwarded block rows, their padded places, and the block's stored slots."""
        packed, places, pages, slots = [], [], [], []
        for i, m in enumerate(which):
            first, split = self.members[m]
            packed += [first + split.lo + j for j in range(len(split.active))]
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
        if layer >= FocusSplit.layers:
            return
        for b, ((_, width, _), which) in enumerate(self.batches):
            packed, places, pages, slots = self.indices[b]
            r = len(which)
            qpad = q.new_zeros(r * width, q.shape[1], q.shape[3])
            qpad.index_copy_(0, places, q[0][:, packed].transpose(0, 1))
            keys = kv[0][pages, :, slots]  # [r * width, Hkv, D], the block's fresh rows written in
            self.captured[b][layer] = (
                qpad.view(r, width, *qpad.shape[1:]).transpose(1, 2),
                keys.view(r, width, *keys.shape[1:]).transpose(1, 2),
            )

    def selections(self) -> list[list[int]]:
        """Every member's selected block rows (ascending; one host read for all)."""
        chosen = []
        for b, ((focus, _, limit), which) in enumerate(self.batches):
            memories = [self.members[m][1].session.memory for m in which]
            splits = [self.members[m][1] for m in which]

            def table(values: list[list[bool]]) -> torch.Tensor:
                return torch.tensor(values, dtype=torch.bool).to(self.device)

            masked, frozen = table([m.masked for m in memories]), table([m.frozen for m in memories])
            valid = torch.ones_like(masked)
            per = [
                [m.reach, m.k_hist(focus.alpha), s.quota or 0] for m, s in zip(memories, splits, strict=True)
            ]
            reach, k_hist, quota = torch.tensor(per).to(self.device).unbind(1)
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
        """Every session's selection (one host read), its rows past layer 1 and its counters."""
        out, visible = [], []
        for (_, split), sel in zip(self.members, self.selections(), strict=True):
            rows, hidden = self._rows(split, sel)
            out.append(rows)
            s = split.session
            visible += [(s.stored(r), s.slot(j)) for j, r in enumerate(hidden)]
        self.copy = _copies(visible, self.device)  # layers >= 2: the visible rows not forwarded
        return out

    @staticmethod
    def _rows(split: FocusSplit, sel: list[int]) -> tuple[SplitRows, list[int]]:
        """A session's rows past layer 1 from its selection ``sel`` (block rows), with the visible block
        rows it does not forward; its counters, as the fast path's."""
        s, lo, hi = split.session, split.lo, split.hi
        mem, n = s.memory, s.local_rows
        kept = set(sel)
        s.reach = max(mem.reach, sel[-1] + 1)
        hidden = [r for r in range(s.reach) if r not in kept]
        rows = (*range(lo), *(lo + r for r in sel), *range(hi, n))
        eligible = {j for j in sel if mem.masked[j] and (s.lead == 0 or j == 0 or j - 1 in kept)}
        logits = tuple(j in eligible for j, m in enumerate(mem.masked) if m)
        s.eligible = torch.tensor(logits, dtype=torch.bool)
        n_kept = sum(1 for r in sel if mem.masked[r])
        st = s.stats
        st.forwards += 1
        st.rows_forwarded += len(rows) * s.deep
        st.rows_plain += n * s.deep
        st.rows_prefix += (n - (hi - lo) + len(split.active)) * 2
        st.focused += n_kept
        st.evicted += len(logits) - n_kept
        st.frozen += sum(mem.frozen)
        writes = tuple((lo + r, *s.stored(r)) for r in sel)
        return SplitRows(rows, s.kv_tokens + len(hidden), writes, logits), hidden
