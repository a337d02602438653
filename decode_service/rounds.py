"""Batched decode rounds: one denoising step of every active session in one model forward.

Each session keeps its own static KV (in the worker's :class:`~pdllm.decode_service.kv_pool.DecodeKVPool`
pages), its own query + response tokens at its own positions, its own block, step, schedule and seed.
A round packs all sessions' local tokens into one ragged row: the GEMMs see every session's rows at once
(a decode step is weight-bound, so many sessions cost little more than one), attention is one varlen
split-S call per layer over all sessions' page tables (``round_attention.PagedBatchAttention``), the LM
head runs only on the rows still masked in each session's current block. A round may keep fewer rows of
some sessions past a layer (SDAR's FOCUS: ``split_rounds.py``).

Greedy sessions keep their response on the device (:class:`~pdllm.decode_service.device_state.
DeviceDenoiseState`): one :class:`~pdllm.decode_service.device_state.DeviceBatch` per round finds their
masked rows, places their tokens into the forward's input and unmasks from the logits, all on the device;
their schedule, hence every shape of the round, is known on the host, so a round of them reads nothing
back (except threshold sessions and EOS checks at block ends) and the host can pack the next round while
the device runs this one. Sampled sessions (and any, with ``device_sampler=False``) keep the host-side
:class:`~pdllm.shared.generation.sampler.DenoiseState`: :func:`predict_many` turns their logits into
predictions with one copy to the host per round, and each applies its own top-k / threshold on the CPU.

This module holds the sessions, the eager round forward and :func:`decode_round`; how a round's rows and
attention entries are laid out (``RoundRows``, ``PackedRound``) is ``round_packing.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdllm.decode_service.device_state import DeviceBatch, DeviceDenoiseState
from pdllm.decode_service.kv_pool import DecodeKVPool
from pdllm.decode_service.round_attention import PagedBatchAttention
from pdllm.decode_service.round_packing import PackedRound, RoundRows
from pdllm.shared.generation.device_sampler import to_device
from pdllm.shared.generation.sampler import DenoiseState, GenerationConfig, GenerationResult, predict_many
from pdllm.shared.model.transformer import DiffusionLM

if TYPE_CHECKING:
    from pdllm.decode_service.layer_graphs import LayerGraphs
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


class EagerRoundForward:
    """A round's forward run op by op: packed tokens in, logits of the packed ``rows`` out (a round whose
    rows change between layers: ``split_rounds.split_forward``). ``layer_graphs``: the layers' work around
    the attention replayed as CUDA graphs (``layer_graphs.LayerGraphs``), the attention and the policy's
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
