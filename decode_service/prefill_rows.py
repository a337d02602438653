"""A chunk-prefill forward carried in a decode round: the all-in-one's prefill and decode in one forward.

The prefill worker hands its chunk forwards over (:class:`~pdllm.shared.chunk_prefill.ChunkForward`); the
scheduler packs the next one after a round's rows, so one forward (eager, or a captured round bucket of
``round_graphs.py``) runs both. The chunk rows sit at positions 0..T-1 of their chunk and attend within it,
causal or not, as a piece group of the round's one ``kernels/ragged_attention`` call; every layer puts
their K/V into a staging buffer, which :meth:`CarriedPiece.commit` copies into the chunk bank after the
forward, as the piece's own forward would have written it. The LM head never sees these rows. A captured
bucket pads the piece with one padding sequence after its chunks (attending only to itself, never
committed).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from pdllm.kernels.ragged_attention import PieceRows
from pdllm.shared.chunk_prefill import ChunkForward
from pdllm.shared.generation.device_sampler import to_device


@dataclass
class PrefillRows:
    """The packed rows ``[start, start + staging rows)`` of a piece: sequences ``cu_seqlens`` among them
    (at most ``max_len`` rows each); each layer's K/V of them into ``staging`` ``[layers, 2, rows, Hkv, D]``.
    ``uniform=False``: a captured forward, replayed with other sequence lengths."""

    start: int
    cu_seqlens: torch.Tensor
    max_len: int
    causal: bool
    staging: torch.Tensor
    uniform: bool = True

    def stage(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """``k``/``v`` ``[P, Hkv, D]``, this layer's K/V of the rows, into the staging buffer."""
        self.staging[layer, 0].copy_(k)
        self.staging[layer, 1].copy_(v)

    @property
    def piece(self) -> PieceRows:
        """The rows as a ragged batch's piece group (the round's attention attends them in its one call)."""
        rows = self.staging.shape[2]
        return PieceRows(self.start, rows, self.cu_seqlens, self.max_len, self.causal, self.uniform)


@dataclass
class CarriedPiece:
    """A chunk forward's inputs on the device: ``ids``/``positions`` of its rows (``rows`` of them: its
    chunks' tokens, then padding), ``cu_seqlens`` (its chunks, then one padding sequence if padded) and the
    bank row and slot of each real row."""

    work: ChunkForward
    ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    bank_rows: torch.Tensor
    bank_slots: torch.Tensor

    @classmethod
    def of(cls, work: ChunkForward, device: torch.device, rows: int | None = None) -> CarriedPiece:
        """``rows``: pad to this many rows (more than the chunks' tokens); None: no padding."""
        lens = [work.bank.lens[i] for i in work.group]
        real = sum(lens)
        pad = 0 if rows is None else rows - real
        if pad < 0 or (rows is not None and pad == 0):
            raise ValueError(f"a padded piece needs more than its {real} rows, got {rows}")
        ids = [t for i in work.group for t in work.chunks[i]] + [0] * pad
        positions = [p for n in lens for p in range(n)] + list(range(pad))
        bank_rows = [i for i, n in zip(work.group, lens, strict=True) for _ in range(n)]
        bank_slots = [p for n in lens for p in range(n)]
        cu = [0, *accumulate(lens)] + ([real + pad] if pad else [])
        t = len(ids)
        longs = to_device([*ids, *positions, *bank_rows, *bank_slots], torch.long, device)
        return cls(
            work,
            longs[:t],
            longs[t : 2 * t],
            to_device(cu, torch.int32, device),
            longs[2 * t : 2 * t + real],
            longs[2 * t + real :],
        )

    @property
    def real_rows(self) -> int:
        return self.bank_rows.shape[0]

    def rows(self, start: int, staging: torch.Tensor | None = None) -> PrefillRows:
        """Its attention at packed rows from ``start`` (eager: a fresh staging buffer of its own rows)."""
        if staging is None:
            bank = self.work.bank.kv
            layers, _, _, heads, _, dim = bank.shape
            staging = bank.new_empty(layers, 2, self.ids.shape[0], heads, dim)
        lens = [self.work.bank.lens[i] for i in self.work.group]
        return PrefillRows(start, self.cu_seqlens, max(lens), self.work.causal, staging)

    def commit(self, staging: torch.Tensor) -> None:
        """The staged K/V of its real rows into the chunk bank (every layer in one copy)."""
        real = self.real_rows
        self.work.bank.kv[:, :, self.bank_rows, :, self.bank_slots] = staging[:, :, :real].permute(
            2, 0, 1, 3, 4
        )
