"""One attention call over a ragged batch of packed rows: decode entries over their pages, prefill pieces.

The packed rows ``q`` ``[T, Hq, D]`` (``k``, ``v`` ``[T, Hkv, D]`` their fresh K/V) are cut into groups that
tile ``[0, T)`` in order (:class:`RaggedBatch`):

- :class:`DecodeRows`: entries, each its own row range; an entry's rows attend bidirectionally to its first
  ``kv_len`` pool slots through its page list (static chunk KV, rows a policy cached) and, with ``local``,
  to its own rows' fresh K/V. One split-S call for the group (Triton: the kernel ``$PDLLM_SPLIT_S`` picks,
  its splits merged by log-sum-exp where an entry's KV is long; torch: :func:`.gathered_attention`).
- :class:`PieceRows`: a chunk-prefill piece, chunks back to back, each attending only within itself
  (causal or not): :func:`~pdllm.kernels.chunk_prefill_attention.chunk_prefill_attention`.

:func:`ragged_attention` runs every group with the kernel it would run alone and returns one packed output.
:meth:`RaggedBatch.of` builds a batch from per-entry host descriptions (:class:`DecodeEntry`,
:class:`PieceEntry`).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from pdllm.kernels.chunk_prefill_attention import chunk_prefill_attention
from pdllm.kernels.gathered_attention import gathered_attention

KERNELS = ("torch", "triton")


@dataclass(frozen=True)
class DecodeRows:
    """Packed rows ``[start, start + rows)``: entry ``b`` is rows ``start + q_offsets[b]`` to
    ``start + q_offsets[b + 1]`` (int32 ``[B + 1]``, from 0 to ``rows``); its keys are its first
    ``kv_lens[b]`` (int32 ``[B]``) pool slots, slot ``j`` at slot ``j % page_size`` of page
    ``page_table[b, j // page_size]`` (int32 ``[B, max_pages]``), then its rows' fresh K/V if ``local``.
    ``max_q_len``/``max_kv_len`` bound the entries' rows and slots on the host (no device read)."""

    start: int
    rows: int
    page_table: torch.Tensor
    kv_lens: torch.Tensor
    q_offsets: torch.Tensor
    max_q_len: int
    max_kv_len: int
    local: bool = True


@dataclass(frozen=True)
class PieceRows:
    """Packed rows ``[start, start + rows)``: chunks ``cu_seqlens`` (int32 ``[N + 1]``, from 0 to ``rows``)
    of at most ``max_len`` rows, each attending within itself, causally if ``causal``. ``uniform=False``:
    never take the equal-lengths shortcut (a captured call replays with other chunk lengths)."""

    start: int
    rows: int
    cu_seqlens: torch.Tensor
    max_len: int
    causal: bool
    uniform: bool = True


Group = DecodeRows | PieceRows


@dataclass(frozen=True)
class DecodeEntry:
    """One decode request: ``rows`` query rows, its first ``kv_len`` slots through ``pages`` (pool page ids
    in logical order)."""

    rows: int
    pages: tuple[int, ...]
    kv_len: int


@dataclass(frozen=True)
class PieceEntry:
    """One prefill piece: its chunks' lengths, back to back, each attending within itself."""

    chunks: tuple[int, ...]
    causal: bool


@dataclass(frozen=True)
class RaggedBatch:
    """Groups tiling the packed rows ``[0, rows)`` in order."""

    groups: tuple[Group, ...]

    def __post_init__(self) -> None:
        at = 0
        for g in self.groups:
            if g.start != at or g.rows < 0:
                raise ValueError(f"groups must tile the rows in order: {g.start}+{g.rows} after row {at}")
            at += g.rows

    @property
    def rows(self) -> int:
        return sum(g.rows for g in self.groups)

    @classmethod
    def of(cls, entries: list[DecodeEntry | PieceEntry], page_size: int, device: torch.device) -> RaggedBatch:
        """Entries packed in order; consecutive decode entries form one group (one split-S call)."""
        groups: list[Group] = []
        start, run = 0, []
        for e in [*entries, None]:
            if isinstance(e, DecodeEntry):
                run.append(e)
                continue
            if run:
                groups.append(_decode_group(run, start, page_size, device))
                start, run = start + groups[-1].rows, []
            if isinstance(e, PieceEntry):
                rows = sum(e.chunks)
                cu = torch.tensor([0, *accumulate(e.chunks)], dtype=torch.int32, device=device)
                groups.append(PieceRows(start, rows, cu, max(e.chunks, default=0), e.causal))
                start += rows
        return cls(tuple(groups))


def _decode_group(run: list[DecodeEntry], start: int, page_size: int, device: torch.device) -> DecodeRows:
    for e in run:
        if len(e.pages) * page_size < e.kv_len:
            raise ValueError(f"{len(e.pages)} pages of {page_size} slots cannot hold {e.kv_len} slots")
    table = torch.zeros(len(run), max([len(e.pages) for e in run] + [1]), dtype=torch.int32)
    for b, e in enumerate(run):
        table[b, : len(e.pages)] = torch.tensor(e.pages, dtype=torch.int32)
    offsets = [0, *accumulate(e.rows for e in run)]
    return DecodeRows(
        start,
        offsets[-1],
        table.to(device),
        torch.tensor([e.kv_len for e in run], dtype=torch.int32, device=device),
        torch.tensor(offsets, dtype=torch.int32, device=device),
        max(e.rows for e in run),
        max(e.kv_len for e in run),
    )


def ragged_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    batch: RaggedBatch,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    kernel: str = "triton",
    lse_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention ``[T, Hq, D]`` of packed rows ``q`` ``[T, Hq, D]`` (``k``/``v`` ``[T, Hkv, D]`` their
    fresh K/V, or None where no group reads them) over one layer's pool ``k_pages``/``v_pages``
    ``[pages, Hkv, page_size, D]``, grouped as ``batch`` says. ``kernel``: "triton" or "torch" for the
    decode groups (pieces run the same kernel either way).

    ``lse_out`` (contiguous float32 ``[T, Hq]``): the decode rows' natural-log log-sum-exp of the scores
    each was normalized over; piece rows are left as they were (the pieces' fast paths do not form it).
    """
    if kernel not in KERNELS:
        raise ValueError(f"ragged attention kernel must be one of {KERNELS}, got {kernel!r}")
    if batch.rows != q.shape[0]:
        raise ValueError(f"the batch covers {batch.rows} rows, q has {q.shape[0]}")
    parts = [_attend(g, q, k, v, k_pages, v_pages, kernel, lse_out) for g in batch.groups]
    if len(parts) == 1:
        return parts[0]  # the common case: the group's output is the packed output, no copy
    out = q.new_empty(q.shape)
    for g, part in zip(batch.groups, parts, strict=True):
        out[g.start : g.start + g.rows] = part
    return out


def _attend(
    g: Group,
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    kernel: str,
    lse_out: torch.Tensor | None,
) -> torch.Tensor:
    rows = slice(g.start, g.start + g.rows)
    if isinstance(g, PieceRows):
        if k is None or v is None:
            raise ValueError("a prefill piece needs its rows' K/V")
        # The varlen kernels want contiguous rows; the round passes strided views of its projections.
        qp, kp, vp = q[rows].contiguous(), k[rows].contiguous(), v[rows].contiguous()
        out = chunk_prefill_attention(
            qp, kp, vp, g.cu_seqlens, causal=g.causal, max_seqlen=g.max_len, uniform=g.uniform
        )
        assert isinstance(out, torch.Tensor)
        return out
    if g.local and (k is None or v is None):
        raise ValueError("decode rows with local K/V need k and v")
    kl = k[rows] if g.local and k is not None else None
    vl = v[rows] if g.local and v is not None else None
    lse = None if lse_out is None else lse_out[rows]  # a row slice of a contiguous [T, Hq]: contiguous
    args = (q[rows], k_pages, v_pages, g.page_table, g.kv_lens, g.q_offsets)
    if kernel == "triton":
        # today's kernel unless $PDLLM_SPLIT_S=hopper picks the experimental TMA variant
        from pdllm.kernels.split_s_hopper import paged_kernel

        return paged_kernel()(
            *args, k_local=kl, v_local=vl, max_q_len=g.max_q_len, max_kv_len=g.max_kv_len, lse_out=lse
        )
    return gathered_attention(*args, k_local=kl, v_local=vl, lse_out=lse)
