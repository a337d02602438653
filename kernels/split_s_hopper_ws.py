"""The all-TMA key loop of the Hopper split-S variant (mode ``auto``): every K/V and Q load a descriptor load.

Triton 3.6's Hopper warp-specialization pass (``nvgpu-warp-specialization``) builds a warp-specialized loop
only when each load feeding the loop's dots is a TMA load: a pointer load of Q, of a masked tail tile or of
local K/V makes it assert or decline. So this kernel has no masked pointer load of K/V/Q at all:

- Q: a 3-D descriptor over ``q`` ``[total_q, Hq, D]`` with box ``[BLOCK_M // GP, GP, D]``, ``GP`` the
  query-head group ``G`` padded to a power of two. Row ``r`` of a block is token ``r // GP``, head
  ``h * G + r % GP``; rows with ``r % GP >= G`` (the next KV head's heads, or zeros past ``Hq``) and tokens
  past the request are computed and never stored (softmax rows are independent). No copy of Q.
- Paged K/V: one layer viewed as ``[pages * Hkv * PAGE / BLOCK_N, BLOCK_N, D]``, box ``[1, BLOCK_N, D]``:
  one tile of one page of one head. A tile holding ``r < BLOCK_N`` tokens (a split's ragged tail, or a
  page cut short by ``page_fill``) is loaded at slot coordinate ``r - BLOCK_N``: TMA zero-fills the
  negative rows, so the tile's first ``BLOCK_N - r`` rows are zeros (masked out of the scores by index)
  and its last ``r`` rows are the tile's ``r`` tokens; no slot past a request's end is ever read. Every
  tile takes the same masked path, so one loop covers whole tiles, tails and holes.
- Local K/V (the request's own rows): a second loop after the paged one, through 3-D descriptors over
  ``[total_q, Hkv, D]`` (box ``[BLOCK_N, 1, D]``); rows past the request (the next request's tokens) are
  masked in the scores and zeroed in V. A pointer-load loop here makes the pass fail; with descriptors it
  puts both loops in one warp-specialized region.

At 64-row blocks the pass gives each of its two consumer warp groups the whole block (the same rows,
stored twice, identical values); at 128 rows its data partitioning has no rule for the reshape of Q. The
layout that lets it split the rows (a 2-D in-kernel Q descriptor, the local loop in its own launch), the
tile configs it takes and their shared memory are recorded in benchmarks/results/attention_notes.md; the
launcher caps the stage count to the device's shared memory (:func:`fit_stages`).

Page ids (and fills) of a split are loaded once before the loop into a ``SPAN`` vector; the loop picks its
tile's id out of registers, since a pointer load in the loop body is another thing the pass refuses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

try:
    import triton
    import triton.language as tl

    from pdllm.kernels.split_s_blocks import _attend, _store_rows
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - Triton before host tensor descriptors
    TensorDescriptor = None

__all__ = ["fit_stages", "group_pad", "ws_descriptors", "ws_unsupported"]


def group_pad(g: int) -> int:
    """The query-head group padded to a power of two: the Q descriptor box's head extent."""
    return 1 << (g - 1).bit_length()


def fit_stages(requested: int, shared_of: Callable[[int], int], limit: int) -> int | None:
    """The largest stage count <= ``requested`` whose kernel needs at most ``limit`` bytes of shared memory
    (``shared_of(stages)``: Triton's ``metadata.shared`` of that compile), None if not even 1 stage fits.

    The specialized kernel keeps a K and a V buffer per stage for each of its two loops, so a stage costs
    ``4 * BLOCK_N * D`` elements: 64x64 tiles, D 128, bf16 need 208 KiB at 2 stages and 272 KiB at 3, over
    an H100's 227 KiB; Triton would compile that and refuse the launch, so the launcher asks first."""
    for stages in range(requested, 0, -1):
        if shared_of(stages) <= limit:
            return stages
    return None


def ws_unsupported(
    block_m: int, block_n: int, page: int, g: int, *tensors: torch.Tensor | None
) -> str | None:
    """Why the all-TMA kernel cannot serve this call (None: it can); ``tensors``: Q and local K/V."""
    if block_m % group_pad(g):
        return f"block_m {block_m} is not a multiple of the padded query-head group {group_pad(g)}"
    if page % block_n:
        return f"page {page} is not a multiple of block_n {block_n}"
    for t in tensors:
        if t is not None and (t.stride(2) != 1 or t.data_ptr() % 16 or any(s * t.element_size() % 16
                                                                          for s in t.stride()[:2])):  # fmt: skip
            return f"strides {t.stride()} are not 16-byte aligned for a descriptor"
    return None


def ws_descriptors(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    k_local: torch.Tensor | None,
    v_local: torch.Tensor | None,
    block_m: int,
    block_n: int,
    g: int,
) -> tuple[object, ...]:
    """Host descriptors: Q (group padded), the K/V pool layer as tiles of ``block_n`` slots, local K/V
    (the pool's descriptors stand in, unused, without local K/V)."""
    d = q.shape[2]
    gp = group_pad(g)
    qd = TensorDescriptor.from_tensor(q, [block_m // gp, gp, d])
    kd = TensorDescriptor.from_tensor(k_pages.view(-1, block_n, d), [1, block_n, d])
    vd = TensorDescriptor.from_tensor(v_pages.view(-1, block_n, d), [1, block_n, d])
    if k_local is None:
        return qd, kd, vd, kd, vd
    kld = TensorDescriptor.from_tensor(k_local, [block_n, 1, d])
    vld = TensorDescriptor.from_tensor(v_local, [block_n, 1, d])
    return qd, kd, vd, kld, vld


if triton is not None:

    @triton.jit
    def _pick(vec, idx, SPAN: tl.constexpr):
        # Element idx of a register vector, without a load (see the module docstring).
        return tl.sum(tl.where(tl.arange(0, SPAN) == idx, vec, 0))

    @triton.jit
    def _split_s_ws_kernel(
        QD, KD, VD, KLD, VLD, PT, PF, KVL, QO, OP, LSE, OUT, RLSE,
        qk_scale, split_size,
        s_pt, s_ops, s_opt, s_oph, s_lss, s_lst, s_ot, s_oh,
        G: tl.constexpr, GP: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_LOCAL: tl.constexpr, HAS_FILL: tl.constexpr, SINGLE: tl.constexpr,
        PRECISION: tl.constexpr, ROW_LSE: tl.constexpr, WS: tl.constexpr, SPAN: tl.constexpr,
    ):  # fmt: skip
        BT: tl.constexpr = BLOCK_M // GP
        pid_m = tl.program_id(0)
        pid_s = tl.program_id(1)
        pid_bh = tl.program_id(2)
        b = pid_bh // HKV
        h = pid_bh % HKV
        q_start = tl.load(QO + b)
        lq = tl.load(QO + b + 1) - q_start
        kv_len = tl.load(KVL + b)
        total = kv_len
        if HAS_LOCAL:
            total = kv_len + lq
        n_begin = pid_s * split_size
        # An empty row block gets an empty key range: zero-trip loops and masked stores, no branch.
        n_end = tl.where(pid_m * BT < lq, tl.minimum(n_begin + split_size, total), n_begin)
        paged_end = tl.minimum(n_end, kv_len)

        q = QD.load([q_start + pid_m * BT, h * G, 0]).reshape(BLOCK_M, D)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        arange_n = tl.arange(0, BLOCK_N)

        first = n_begin // PAGE
        slots = first + tl.arange(0, SPAN)
        in_split = slots * PAGE < paged_end
        pages = tl.load(PT + b * s_pt + slots, mask=in_split, other=0)
        if HAS_FILL:
            fills = tl.load(PF + b * s_pt + slots, mask=in_split, other=0)
        for n0 in tl.range(n_begin, paged_end, BLOCK_N, warp_specialize=WS):
            page = _pick(pages, n0 // PAGE - first, SPAN)
            off = n0 % PAGE
            r = tl.minimum(paged_end - n0, BLOCK_N)
            if HAS_FILL:
                r = tl.maximum(tl.minimum(r, _pick(fills, n0 // PAGE - first, SPAN) - off), 0)
            tile = ((page * HKV + h) * PAGE + off) // BLOCK_N
            # r tokens: shift the box so its first BLOCK_N - r rows fall before the tile (zero-filled).
            k = KD.load([tile, r - BLOCK_N, 0]).reshape(BLOCK_N, D)
            v = VD.load([tile, r - BLOCK_N, 0]).reshape(BLOCK_N, D)
            m_i, l_i, acc = _attend(
                q, k, v, arange_n >= BLOCK_N - r, m_i, l_i, acc, qk_scale, True, PRECISION
            )

        offs_m = tl.arange(0, BLOCK_M)
        t = pid_m * BT + offs_m // GP
        row_ok = (t < lq) & (offs_m % GP < G)
        tok = (q_start + t).to(tl.int64)
        head = h * G + offs_m % GP
        offs_d = tl.arange(0, D)
        if HAS_LOCAL:
            for n0 in range(tl.maximum(n_begin, kv_len), n_end, BLOCK_N):
                valid = n0 + arange_n < n_end
                row = q_start + n0 - kv_len
                k = KLD.load([row, h, 0]).reshape(BLOCK_N, D)
                # Rows past the request are the next request's tokens: zero them so only exact zeros
                # are multiplied in, whatever those hold.
                v = tl.where(valid[:, None], VLD.load([row, h, 0]).reshape(BLOCK_N, D), 0.0)
                m_i, l_i, acc = _attend(q, k, v, valid, m_i, l_i, acc, qk_scale, True, PRECISION)

        _store_rows(acc, m_i, l_i, OUT, OP, LSE, RLSE, tok, head, offs_d, row_ok, pid_s,
                    s_ot, s_oh, s_ops, s_opt, s_oph, s_lss, s_lst, G, HKV, SINGLE, ROW_LSE)  # fmt: skip
