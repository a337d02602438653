"""The ``tma`` and ``plain`` modes of the Hopper split-S variant: Q, the ragged tail and local K/V through
masked pointer loads, whole tiles of tokens through TMA (``tma``) or pointer loads (``plain``).

TMA: one layer of the pool, ``[num_pages, Hkv, page_size, D]`` dense, is one 2-D descriptor over its
``[num_pages * Hkv * page_size, D]`` rows; the tile of logical slots ``n0 .. n0 + BLOCK_N`` (``BLOCK_N <=
page_size``) is the box at row ``(page * Hkv + head) * page_size + n0 % page_size``. ``WS`` asks Triton to
warp-specialize the whole-tile loop; Triton 3.6's Hopper pass refuses that while other loads are pointer
loads (see :mod:`.split_s_hopper_ws`, which ``auto`` runs instead), so the launcher passes ``WS=False``;
the flag stays for offline compiles that show the refusal.
"""

from __future__ import annotations

import torch

from pdllm.kernels.split_s_attention import LOG2E
from pdllm.kernels.split_s_reference import SplitSConfig

try:
    import triton
    import triton.language as tl

    from pdllm.kernels.split_s_blocks import _attend, _page_rows, _store_rows
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - Triton before host tensor descriptors
    TensorDescriptor = None

__all__ = ["launch_pointer_q"]

if triton is not None:

    @triton.jit
    def _tma_tile(KD, VD, pages, first, n0, h, HKV: tl.constexpr, PAGE: tl.constexpr, SPAN: tl.constexpr):
        # The box of slots n0 .. n0 + BLOCK_N of one request, head h: one page, so one descriptor load each.
        # Its page id comes out of the split's ids already in registers, not a load: a pointer load in the
        # loop is what Triton's Hopper warp specialization cannot hand from producer to consumers.
        page = tl.sum(tl.where(tl.arange(0, SPAN) == n0 // PAGE - first, pages, 0))
        row = (page * HKV + h) * PAGE + n0 % PAGE
        return KD.load([row, 0]), VD.load([row, 0])

    @triton.jit
    def _split_s_hopper_kernel(
        Q, KP, VP, KD, VD, PT, PF, KVL, QO, KL, VL, OP, LSE, OUT, RLSE,
        qk_scale, split_size,
        s_qt, s_qh, s_kp, s_kh, s_pt, s_lt, s_lh, s_vt, s_vh, s_ops, s_opt, s_oph, s_lss, s_lst, s_ot, s_oh,
        G: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_LOCAL: tl.constexpr, HAS_FILL: tl.constexpr, SINGLE: tl.constexpr,
        PRECISION: tl.constexpr, ROW_LSE: tl.constexpr, USE_TMA: tl.constexpr, WS: tl.constexpr,
        SPAN: tl.constexpr,
    ):  # fmt: skip
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
        n_end = tl.where(pid_m * BLOCK_M < lq * G, tl.minimum(n_begin + split_size, total), n_begin)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < lq * G
        tok = (q_start + offs_m // G).to(tl.int64)
        head = h * G + offs_m % G
        offs_d = tl.arange(0, D)
        q = tl.load(
            Q + tok[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :], mask=row_ok[:, None], other=0.0
        )

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        arange_n = tl.arange(0, BLOCK_N)
        paged_end = tl.minimum(n_end, kv_len)
        full_end = n_begin
        if not HAS_FILL:
            # Whole tiles of tokens first, unmasked (most of the work), then the ragged rest.
            full_end = n_begin + tl.maximum(paged_end - n_begin, 0) // BLOCK_N * BLOCK_N
            if USE_TMA:
                # The page ids of this split's whole tiles, loaded once (SPAN >= pages a split touches).
                first = n_begin // PAGE
                slots = first + tl.arange(0, SPAN)
                pages = tl.load(PT + b * s_pt + slots, mask=slots * PAGE < full_end, other=0)
                if WS:
                    for n0 in tl.range(n_begin, full_end, BLOCK_N, warp_specialize=True):
                        k, v = _tma_tile(KD, VD, pages, first, n0, h, HKV, PAGE, SPAN)
                        m_i, l_i, acc = _attend(q, k, v, arange_n, m_i, l_i, acc, qk_scale, False, PRECISION)
                else:
                    for n0 in tl.range(n_begin, full_end, BLOCK_N):
                        k, v = _tma_tile(KD, VD, pages, first, n0, h, HKV, PAGE, SPAN)
                        m_i, l_i, acc = _attend(q, k, v, arange_n, m_i, l_i, acc, qk_scale, False, PRECISION)
            else:
                for n0 in tl.range(n_begin, full_end, BLOCK_N):
                    row, valid = _page_rows(PT, PF, b, h, n0, arange_n, paged_end, s_pt, s_kp, s_kh,
                                            D, PAGE, BLOCK_N, HAS_FILL)  # fmt: skip
                    k = tl.load(KP + row[:, None] + offs_d[None, :])
                    v = tl.load(VP + row[:, None] + offs_d[None, :])
                    m_i, l_i, acc = _attend(q, k, v, valid, m_i, l_i, acc, qk_scale, False, PRECISION)
        for n0 in range(full_end, paged_end, BLOCK_N):
            row, valid = _page_rows(PT, PF, b, h, n0, arange_n, paged_end, s_pt, s_kp, s_kh,
                                    D, PAGE, BLOCK_N, HAS_FILL)  # fmt: skip
            k = tl.load(KP + row[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(VP + row[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
            m_i, l_i, acc = _attend(q, k, v, valid, m_i, l_i, acc, qk_scale, True, PRECISION)
        if HAS_LOCAL:
            for n0 in range(tl.maximum(n_begin, kv_len), n_end, BLOCK_N):
                offs_n = n0 + arange_n
                valid = offs_n < n_end
                tok_n = (q_start + offs_n - kv_len).to(tl.int64)
                k = tl.load(
                    KL + (tok_n * s_lt + h * s_lh)[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0
                )
                v = tl.load(
                    VL + (tok_n * s_vt + h * s_vh)[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0
                )
                m_i, l_i, acc = _attend(q, k, v, valid, m_i, l_i, acc, qk_scale, True, PRECISION)

        _store_rows(acc, m_i, l_i, OUT, OP, LSE, RLSE, tok, head, offs_d, row_ok, pid_s,
                    s_ot, s_oh, s_ops, s_opt, s_oph, s_lss, s_lst, G, HKV, SINGLE, ROW_LSE)  # fmt: skip


def launch_pointer_q(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    fill: torch.Tensor,
    kv_lens: torch.Tensor,
    q_offsets: torch.Tensor,
    k_local: torch.Tensor | None,
    v_local: torch.Tensor | None,
    o_part: torch.Tensor,
    lse: torch.Tensor,
    out: torch.Tensor,
    row_lse: torch.Tensor,
    scale: float,
    split_size: int,
    grid: tuple[int, int, int],
    config: SplitSConfig,
    mode: str,
    span: int,
    part_strides: tuple[int, ...],
    single: bool,
    has_lse: bool,
) -> object:
    """Launch the ``tma``/``plain`` kernel: Q, tails and local K/V through pointer loads; whole tiles
    through TMA when ``mode`` is ``tma``. Returns Triton's compiled kernel."""
    _, hkv, page, d = k_pages.shape
    has_local = k_local is not None
    use_tma = mode != "plain"
    if use_tma:
        kd = TensorDescriptor.from_tensor(k_pages.view(-1, d), [config.block_n, d])
        vd = TensorDescriptor.from_tensor(v_pages.view(-1, d), [config.block_n, d])
    else:
        kd, vd = k_pages, v_pages  # unused by the kernel without USE_TMA
    kl = k_local if has_local else q
    vl = v_local if has_local else q
    return _split_s_hopper_kernel[grid](
        q, k_pages, v_pages, kd, vd, page_table, fill, kv_lens, q_offsets, kl, vl, o_part, lse, out, row_lse,
        scale * LOG2E, split_size,
        q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), page_table.stride(0),
        kl.stride(0), kl.stride(1), vl.stride(0), vl.stride(1), *part_strides, out.stride(0), out.stride(1),
        G=q.shape[1] // hkv, HKV=hkv, D=d, PAGE=page, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        HAS_LOCAL=has_local, HAS_FILL=fill is not page_table, SINGLE=single,
        # fp32 inputs get exact fp32 dots, as in split_s_attention
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", ROW_LSE=has_lse,
        USE_TMA=use_tma, WS=False, SPAN=span, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
