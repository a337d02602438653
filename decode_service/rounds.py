"""Batched decode rounds: one denoising step of every active session in one model forward.

Each session keeps its own static KV (in the worker's :class:`~pdllm.decode_service.kv_pool.DecodeKVPool`
pages), its own query + response tokens at its own positions, its own block, step, schedule and seed.
A round packs all sessions' local tokens into one ragged row: the GEMMs see every session's rows at once
(a decode step is weight-bound, so many sessions cost little more than one), attention is one varlen
split-S call per layer over all sessions' page tables (``round_attention.PagedBatchAttention``), the LM
head runs only on the rows still masked in each session's current block. A round may keep fewer rows of
some sessions past a layer (FOCUS: ``split_rounds.py``).

Greedy sessions keep their response on the device (:class:`~pdllm.decode_service.device_state.
DeviceDenoiseState`): one :class:`~pdllm.decode_service.device_state.DeviceBatch` per round finds their
masked rows, places their tokens into the forward's input and unmasks from the logits, all on the device;
their schedule, hence every shape of the round, is known on the host, so a round of them reads nothing
back (except threshold sessions and EOS checks at block ends) and the host can pack the next round while
the device runs this one. Sampled sessions (and any, with ``device_sampler=False``) keep the host-side
:class:`~pdllm.shared.generation.sampler.DenoiseState`: :func:`predict_many` turns their logits into
predictions with one copy to the host per round, and each applies its own top-k / threshold on the CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pdllm.decode_service.device_state import DeviceBatch, DeviceDenoiseState
from pdllm.decode_service.kv_pool import DecodeKVPool
from pdllm.decode_service.round_attention import LayerStore, PagedBatchAttention, group_stores
from pdllm.shared.generation.device_sampler import to_device
from pdllm.shared.generation.sampler import DenoiseState, GenerationConfig, GenerationResult, predict_many
from pdllm.shared.model.transformer import DiffusionLM

if TYPE_CHECKING:
    from pdllm.decode_service.layer_edits import PartEdit
    from pdllm.decode_service.round_graphs import LayerGraphs
    from pdllm.decode_service.split_rounds import RowSplit
    from pdllm.shared.chunk_prefill import ChunkForward


@dataclass
class BatchSession:
    """One request in the rounds. ``query_start``: position of its first query token (static positions
    keep top-B holes, so it can exceed ``kv_tokens``); ``pages``: its pool pages, in order."""

    query: list[int]
    query_start: int
    kv_tokens: int
    pages: list[int]
    state: DenoiseState | DeviceDenoiseState
    # host wall time of the rounds it took part in (device sessions: up to when the round was queued)
    seconds: float = 0.0

    @classmethod
    def start(
        cls,
        model: DiffusionLM,
        query: list[int],
        query_start: int,
        kv_tokens: int,
        pages: list[int],
        gen: GenerationConfig,
        device_sampler: bool = True,
    ) -> BatchSession:
        """``device_sampler``: a greedy session keeps its response and unmasking on the model's device."""
        mask_id, eos_id = model.config.mask_token_id, model.config.eos_token_id
        state: DenoiseState | DeviceDenoiseState
        if device_sampler and gen.temperature == 0:
            state = DeviceDenoiseState(gen, mask_id, eos_id, next(model.parameters()).device)
        else:
            state = DenoiseState(gen, mask_id, eos_id, "cpu")
        return cls(list(query), query_start, kv_tokens, list(pages), state)

    @property
    def done(self) -> bool:
        return self.state.done

    def _tokens(self) -> list[int]:
        state = self.state
        return state.host_tokens() if isinstance(state, DeviceDenoiseState) else state.tokens.tolist()

    def partial(self) -> list[int]:
        """Response slots so far, -1 where still masked (a device session waits for its last round)."""
        return [-1 if t == self.state.mask_id else t for t in self._tokens()]

    def result(self) -> GenerationResult:
        return GenerationResult(
            token_ids=self.state.result(),
            raw_tokens=self._tokens(),
            steps=self.state.steps_taken,
            decode_seconds=self.seconds,
            unmasked=[list(b) for b in self.state.unmasked],
        )

    @property
    def local_rows(self) -> int:
        """Its local rows: the query (vanilla: the whole prompt), then the response."""
        return len(self.query) + self.state.config.gen_length

    def round_rows(self) -> RoundRows:
        """What this session puts into the next round: every local row, over its static KV."""
        return RoundRows(0, self.local_rows, self.kv_tokens)

    def round_parts(self) -> list[RoundRows]:
        """The next round's attention entries of this session, called once as the round is packed: parts
        contiguous in local rows, in order, each reading its own ``kv_len`` pool slots besides its own rows
        (one part: :meth:`round_rows`; block diffusion splits its rows at model-block boundaries)."""
        return [self.round_rows()]

    def apply(self, tokens: torch.Tensor, confidence: torch.Tensor) -> None:
        """A host session's predictions for its masked rows (``predict_many``'s), applied after the round."""
        assert isinstance(self.state, DenoiseState)
        self.state.apply(tokens, confidence)


@dataclass
class CachingSession(BatchSession):
    """A session whose pages hold, after its static KV, local rows' K/V (``page_size`` slots per page)."""

    page_size: int = 64

    def slot(self, j: int) -> tuple[int, int]:
        """(page, slot in page) of pool slot ``j`` after the static KV."""
        at = self.kv_tokens + j
        return self.pages[at // self.page_size], at % self.page_size


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
    :meth:`BatchSession.round_parts`).

    Device sessions' response tokens and rows are known only on the device: ``ids`` hold [MASK] and
    ``rows`` -1 in their place, and ``device_ids`` / ``device_rows`` (set by :func:`decode_round`) are
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


class EagerRoundForward:
    """A round's forward run op by op: packed tokens in, logits of the packed ``rows`` out (a round whose
    rows change between layers: ``split_rounds.split_forward``). ``layer_graphs``: the layers' work around
    the attention replayed as CUDA graphs (``round_graphs.LayerGraphs``), the attention and the policy's
    per-layer work eager."""

    def __init__(
        self, model: DiffusionLM, pool: DecodeKVPool, kernel: str, layer_graphs: LayerGraphs | None = None
    ) -> None:
        self.model, self.pool, self.kernel, self.layer_graphs = model, pool, kernel, layer_graphs

    def run_layers(
        self,
        packed: PackedRound,
        layers: Sequence[torch.nn.Module],
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: PagedBatchAttention,
    ) -> torch.Tensor:
        """``layers`` over ``x``: through :attr:`layer_graphs`, else each layer's forward. A store with a
        ``layer_inputs`` dict gets each layer's input there (``round_attention.LayerStore``)."""
        wants = [store.layer_inputs for _, store in packed.stores if hasattr(store, "layer_inputs")]
        graphs = self.layer_graphs
        if graphs is not None and x.shape[1] <= graphs.max_rows:
            return graphs.run(layers, x, cos, sin, attention, wants)
        for layer in layers:
            for inputs in wants:
                inputs[layer.self_attn.layer] = x
            x = layer(x, cos, sin, attention)
        return x

    def __call__(self, packed: PackedRound) -> torch.Tensor:
        if packed.piece is not None and not packed.carries_piece:
            packed.piece.run()  # alone, before the round
        if packed.splits:
            from pdllm.decode_service.split_rounds import split_forward  # it builds on this module

            return split_forward(self, packed)
        ids, positions, rows = self.inputs(packed)
        attention = self.attention(packed)
        carried = None
        if packed.carries_piece:
            assert packed.piece is not None
            from pdllm.decode_service.prefill_rows import CarriedPiece  # it builds on this module

            carried = CarriedPiece.of(packed.piece, ids.device)
            attention.prefill = carried.rows(ids.shape[0])
            ids = torch.cat([ids, carried.ids])
            positions = torch.cat([positions, carried.positions])
        if packed.edits:
            from pdllm.decode_service.layer_edits import group_edits  # it builds on this module

            attention.edits = group_edits(packed)
        with ExitStack() as stack:
            for _, store in packed.stores:
                attach = getattr(store, "attach", None)
                if attach is not None:
                    stack.enter_context(attach(self.model))
            x, cos, sin = self.model.embed(ids[None], positions[None])
            x = self.run_layers(packed, self.model.model.layers, x, cos, sin, attention)
            hidden = self.model.model.norm(x)
        if carried is not None:
            assert attention.prefill is not None
            carried.commit(attention.prefill.staging)
        return self.model.logits_from_hidden(hidden, rows[None])[0]

    def inputs(self, packed: PackedRound) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The round's ``ids``, ``positions`` and ``rows`` on the device."""
        t = len(packed.ids)
        longs = to_device([*packed.ids, *packed.positions, *packed.rows], torch.long, self.pool.kv.device)
        ids, positions, rows = longs[:t], longs[t : 2 * t], longs[2 * t :]
        ids = ids if packed.device_ids is None else packed.device_ids
        rows = rows if packed.device_rows is None else packed.device_rows
        return ids, positions, rows

    def attention(self, packed: PackedRound) -> PagedBatchAttention:
        """The round's attention over the pool (its metadata copied to the device)."""
        device = self.pool.kv.device
        b = len(packed.kv_lens)
        width = packed.table_width
        table = packed.table(b, width).flatten()
        ints = torch.cat([torch.tensor(packed.q_offsets + packed.kv_lens, dtype=torch.int32), table])
        ints = to_device(ints, torch.int32, device)
        q_offsets, kv_lens, page_table = (
            ints[: b + 1],
            ints[b + 1 : 2 * b + 1],
            ints[2 * b + 1 :].view(b, width),
        )
        writes = None
        if packed.writes:
            w_rows, w_pages, w_slots = zip(*packed.writes, strict=True)
            w = to_device([*w_rows, *w_pages, *w_slots], torch.long, device).view(3, -1)
            writes = (w[0], w[1], w[2])
        return PagedBatchAttention(
            self.pool.kv,
            page_table,
            kv_lens,
            q_offsets,
            packed.max_q_len,
            max(packed.kv_lens),
            self.kernel,
            writes,
            packed.stores,
            packed.drop_table(self.model.config.num_layers, b, device),
        )


RoundForward = Callable[[PackedRound], torch.Tensor]


@torch.inference_mode()
def decode_round(
    forward: RoundForward, sessions: list[BatchSession], piece: ChunkForward | None = None
) -> None:
    """One denoising step of every session in one ``forward``. Finished sessions must not be passed.
    ``piece``: a chunk-prefill forward the round runs too, in the same forward where it can
    (:attr:`PackedRound.carries_piece`), else alone before it.

    Device sessions are stepped without reading the device back where their schedule tells the host
    everything (:meth:`~pdllm.decode_service.device_state.DeviceDenoiseState.needs_readback`); host
    sessions cost one copy of their predictions to the host."""
    if not sessions:
        return
    start = time.perf_counter()
    packed = PackedRound.pack(sessions)
    packed.piece = piece
    on_device = [i for i, s in enumerate(sessions) if isinstance(s.state, DeviceDenoiseState)]
    on_host = [i for i, s in enumerate(sessions) if isinstance(s.state, DenoiseState)]
    spans = [0]
    for n in packed.counts:
        spans.append(spans[-1] + n)
    batch = None
    if on_device:
        states = [s.state for s in sessions if isinstance(s.state, DeviceDenoiseState)]
        batch = DeviceBatch(states, [packed.starts[i] for i in on_device])
        packed.device_ids, packed.device_rows = _device_inputs(packed, sessions, on_device, batch, spans)
    logits = forward(packed)
    if batch is not None:
        batch.apply(logits if not on_host else logits.index_select(0, _rows_of(on_device, spans, logits)))
    if on_host:
        own = logits if not on_device else logits.index_select(0, _rows_of(on_host, spans, logits))
        host_states = [s.state for s in sessions if isinstance(s.state, DenoiseState)]
        predictions = predict_many(own, host_states, [packed.counts[i] for i in on_host])
        for i, p in zip(on_host, predictions, strict=True):
            sessions[i].apply(*p)
    elapsed = time.perf_counter() - start
    for s in sessions:
        s.seconds += elapsed


def _rows_of(which: list[int], spans: list[int], like: torch.Tensor) -> torch.Tensor:
    """Indices, into a round's ``rows``, of the sessions ``which``."""
    return to_device([r for i in which for r in range(spans[i], spans[i + 1])], torch.long, like.device)


def _device_inputs(
    packed: PackedRound,
    sessions: list[BatchSession],
    on_device: list[int],
    batch: DeviceBatch,
    spans: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The round's ``ids`` and ``rows`` on the device, device sessions' tokens and masked rows in place."""
    device = batch.tokens.device
    ids = to_device(packed.ids, torch.long, device)
    slots, source, offset = [], [], 0
    for i in on_device:
        r0, r1 = packed.responses[i]
        slots += range(packed.starts[i] + r0, packed.starts[i] + r1)
        source += range(offset + r0, offset + r1)
        offset += sessions[i].state.config.gen_length
    tokens = batch.tokens
    if len(source) < offset:  # some sessions forward only part of their response
        tokens = tokens.index_select(0, to_device(source, torch.long, device))
    ids.index_copy_(0, to_device(slots, torch.long, device), tokens)
    if len(on_device) == len(sessions):
        return ids, batch.rows
    rows = to_device(packed.rows, torch.long, device)
    rows.index_copy_(0, _rows_of(on_device, spans, rows), batch.rows)
    return ids, rows
