"""CUDA-graph replay of batched decode rounds: one captured forward per padded shape bucket.

The graph covers the transformer body (embedding to final norm); the LM head over the round's masked rows
runs after the replay (two launches), so the number of masked rows, which shrinks every step, is not part
of the shape. A round's shape is (sessions, packed tokens, longest local sequence, widest page table,
K/V rows stored into the pool: a decode policy's refresh), each rounded up to a bucket
(:meth:`RoundShape.of`): sessions and the page table's width to powers of two, the longest session's rows
to a multiple of 4 or 8 (:func:`~.graph_buckets.query_bucket`), tokens to a multiple of 32
(:func:`~.graph_buckets.token_bucket`), the longest KV and anything larger to at most 1/16 above, stored
rows to at most 1/8 (padded stores repeat the first one): the kernels' work follows the bucket, so it stays
close to the real shape. Padding is inert: padded sessions have no query rows and no KV, padded tokens
belong to no session (the attention kernel never reads or writes for them, and every other op is
row-wise). So every round whose shape falls in a bucket replays that bucket's graph after
copying its packed inputs into the graph's buffers: no capture per request or per step, no copy of any
session's KV (the kernel reads the shared pool through the page table). A round carrying a chunk prefill
piece (``prefill_rows.py``) is a bucket of its own: the piece's rows padded to a multiple of 32 (one
padding sequence after its chunks), its K/V staged in a buffer the buckets share and copied into the chunk
bank after the replay.

All graphs share one memory pool. A capture runs on the scheduler thread, which must be the only thread of
the process using the device (captures concurrent with another thread's prefill work failed requests of
both workers under load on an H100, even in thread-local capture mode): ``serve --role all`` therefore runs
the prefill worker's device work on the scheduler thread too, between rounds. Off CUDA the same padded
buffers run eagerly (tests).

This module holds the whole-round graphs (:class:`RoundShape`, :class:`CapturedRound`,
:class:`GraphedRoundForward`); the bucket sizes and the capture step are ``graph_buckets.py``, the graphs
around an eager round's attention ``layer_graphs.py``.
"""

from __future__ import annotations

import gc
from collections import OrderedDict
from dataclasses import dataclass

import torch

from pdllm.decode_service.graph_buckets import capture_graph, eighths, fine, pow2, query_bucket, token_bucket
from pdllm.decode_service.kv_pool import DecodeKVPool
from pdllm.decode_service.layer_graphs import LayerGraphs
from pdllm.decode_service.prefill_rows import CarriedPiece, PrefillRows
from pdllm.decode_service.round_attention import PagedBatchAttention
from pdllm.decode_service.round_packing import PackedRound
from pdllm.decode_service.rounds import EagerRoundForward
from pdllm.shared.generation.device_sampler import to_device
from pdllm.shared.model.transformer import DiffusionLM


@dataclass(frozen=True)
class RoundShape:
    batch: int
    tokens: int
    q_len: int
    pages: int
    kv_len: int  # the longest static / cached KV a session reads (the kernel's split plan follows it)
    writes: int = 0  # rows whose K/V the round stores in the pool (a decode policy's refresh)
    drops: bool = False  # some session reads fewer cached slots at some layers (Sparse-dLLM)
    # a carried chunk forward (``prefill_rows.py``): its rows (with at least one of padding), its chunks
    piece_rows: int = 0
    piece_chunks: int = 0
    piece_causal: bool = False

    @classmethod
    def of(cls, packed: PackedRound) -> RoundShape:
        piece = packed.piece if packed.carries_piece else None
        return cls(
            batch=pow2(len(packed.kv_lens)),
            tokens=token_bucket(len(packed.ids)),
            q_len=query_bucket(packed.max_q_len),
            pages=pow2(packed.table_width),
            kv_len=fine(max(packed.kv_lens), floor=64),
            writes=eighths(len(packed.writes)) if packed.writes else 0,
            drops=any(d is not None for d in packed.drops),
            piece_rows=token_bucket(piece.tokens + 1) if piece else 0,
            piece_chunks=len(piece.group) if piece else 0,
            piece_causal=piece.causal if piece else False,
        )


class CapturedRound:
    """One bucket's input buffers and forward, captured as a CUDA graph when ``capture``."""

    def __init__(
        self,
        model: DiffusionLM,
        pool: DecodeKVPool,
        kernel: str,
        shape: RoundShape,
        mempool: tuple | None,
        capture: bool,
        staging: torch.Tensor | None = None,
    ) -> None:
        """``staging``: a carried piece's K/V buffer (``shape.piece_rows`` rows; shared by the buckets)."""
        device = pool.kv.device
        self.model, self.shape = model, shape
        rows = shape.tokens + shape.piece_rows
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.q_offsets = torch.zeros(shape.batch + 1, dtype=torch.int32, device=device)
        self.kv_lens = torch.zeros(shape.batch, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(shape.batch, shape.pages, dtype=torch.int32, device=device)
        self.writes = torch.zeros(3, shape.writes, dtype=torch.long, device=device)
        layers = model.config.num_layers
        self.drop = (
            torch.zeros(layers, shape.batch, dtype=torch.int32, device=device) if shape.drops else None
        )
        self.attention = PagedBatchAttention(
            pool.kv,
            self.page_table,
            self.kv_lens,
            self.q_offsets,
            shape.q_len,
            shape.kv_len,
            kernel,
            (self.writes[0], self.writes[1], self.writes[2]) if shape.writes else None,
            drop=self.drop,
        )
        self.staging = staging
        if shape.piece_rows:
            assert staging is not None and staging.shape[2] == shape.piece_rows
            # until the first call: every sequence non-empty, the last one the padding
            cu = [*range(shape.piece_chunks + 1), shape.piece_rows]
            self.cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=device)
            self.attention.prefill = PrefillRows(
                shape.tokens, self.cu_seqlens, shape.piece_rows, shape.piece_causal, staging, uniform=False
            )
        self.graph: torch.cuda.CUDAGraph | None = None
        if not capture:
            return
        gc.collect()  # graphs the collector would destroy go before the capture
        self.graph, self.hidden = capture_graph(self._forward, device, mempool, warm=self._warm)

    def _forward(self) -> torch.Tensor:
        return self.model.hidden_states(self.ids[None], self.positions[None], self.attention)

    def _warm(self) -> None:
        # The warm-up runs on the zeroed buffers, so it must not store K/V: its stores would land in page 0,
        # another session's KV.
        writes, self.attention.writes = self.attention.writes, None
        try:
            self._forward()
        finally:
            self.attention.writes = writes

    def __call__(self, packed: PackedRound) -> torch.Tensor:
        s = self.shape
        t, b = len(packed.ids), len(packed.kv_lens)
        device = self.ids.device
        offsets = packed.q_offsets + [t] * (s.batch - b)  # padded sessions: no query rows
        ints = torch.cat(
            [
                torch.tensor(offsets + packed.kv_lens + [0] * (s.batch - b), dtype=torch.int32),
                packed.table(s.batch, s.pages).flatten(),
            ]
        )
        ints = to_device(ints, torch.int32, device)
        self.q_offsets.copy_(ints[: s.batch + 1])
        self.kv_lens.copy_(ints[s.batch + 1 : 2 * s.batch + 1])
        self.page_table.copy_(ints[2 * s.batch + 1 :].view(s.batch, s.pages))
        if s.writes:
            # Padding repeats the first write: the same value stored twice in the same slot.
            pad = [packed.writes[0]] * (s.writes - len(packed.writes))
            rows, pages, slots = zip(*(packed.writes + pad), strict=True)
            self.writes.copy_(to_device([*rows, *pages, *slots], torch.long, device).view(3, -1))
        if self.drop is not None:
            table = packed.drop_table(self.drop.shape[0], s.batch, device)
            assert table is not None  # the shape has drops only when a session has one
            self.drop.copy_(table)
        longs = to_device(packed.positions + packed.ids + packed.rows, torch.long, device)
        self.positions[:t].copy_(longs[:t])
        self.ids[:t].copy_(longs[t : 2 * t] if packed.device_ids is None else packed.device_ids)
        carried = None
        if s.piece_rows:
            assert packed.piece is not None and self.staging is not None
            carried = CarriedPiece.of(packed.piece, device, rows=s.piece_rows)
            self.ids[s.tokens :].copy_(carried.ids)
            self.positions[s.tokens :].copy_(carried.positions)
            self.cu_seqlens.copy_(carried.cu_seqlens)
        if self.graph is None:
            hidden = self._forward()
        else:
            self.graph.replay()
            hidden = self.hidden
        if carried is not None:
            assert self.staging is not None
            carried.commit(self.staging)
        rows = longs[2 * t :] if packed.device_rows is None else packed.device_rows
        return self.model.logits_from_hidden(hidden, rows[None])[0]


CAPTURE_NEEDS_TRITON = (
    "CUDA-graph rounds need the triton decode attention: the torch one reads each request's row offsets "
    "on the host, which a captured graph cannot replay (run it without CUDA graphs)"
)


class GraphedRoundForward:
    """A round's forward through :class:`CapturedRound` buckets (least recently used evicted beyond
    ``capacity``). ``capture`` False: the same padded buffers, run eagerly."""

    def __init__(
        self,
        model: DiffusionLM,
        pool: DecodeKVPool,
        kernel: str,
        capture: bool,
        capacity: int = 128,
        layer_graphs: bool = True,
    ) -> None:
        """``layer_graphs``: rounds that run eagerly (a policy decides inside the forward) replay each
        layer's work around the attention (:class:`LayerGraphs`)."""
        if capture and kernel != "triton":
            raise ValueError(CAPTURE_NEEDS_TRITON)
        if capture and pool.kv.device.type != "cuda":
            raise ValueError("CUDA-graph rounds need the model and KV pool on a CUDA device")
        self.model, self.pool, self.kernel, self.capture, self.capacity = (
            model,
            pool,
            kernel,
            capture,
            capacity,
        )
        self.mempool = torch.cuda.graph_pool_handle() if capture else None
        layers = LayerGraphs(model, self.mempool, capture) if layer_graphs else None
        self.eager = EagerRoundForward(model, pool, kernel, layers)
        self._graphs: OrderedDict[RoundShape, CapturedRound] = OrderedDict()
        self._staging: dict[int, torch.Tensor] = {}  # carried pieces' K/V buffers by rows, shared
        self.captures = 0
        self.replays = 0

    def __call__(self, packed: PackedRound) -> torch.Tensor:
        if packed.stores or packed.splits or packed.edits:  # choices made inside the forward
            # (Sparse-dLLM, Polestar-Cache, FOCUS, DyLLM): not capturable (a piece runs alone, eagerly)
            return self.eager(packed)
        shape = RoundShape.of(packed)
        graph = self._graphs.get(shape)
        if graph is None:
            staging = self._piece_staging(shape.piece_rows) if shape.piece_rows else None
            graph = CapturedRound(
                self.model, self.pool, self.kernel, shape, self.mempool, self.capture, staging
            )
            self._graphs[shape] = graph
            self.captures += 1
            while len(self._graphs) > self.capacity:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(shape)
            self.replays += 1
        return graph(packed)

    def _piece_staging(self, rows: int) -> torch.Tensor:
        if rows not in self._staging:
            c, kv = self.model.config, self.pool.kv
            shape = (c.num_layers, 2, rows, c.num_kv_heads, c.head_dim)
            self._staging[rows] = torch.zeros(shape, dtype=kv.dtype, device=kv.device)
        return self._staging[rows]
