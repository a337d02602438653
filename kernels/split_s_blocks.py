"""Device functions every split-S kernel shares (``split_s_attention``, ``split_s_hopper_tma``,
``split_s_hopper_ws``): one key block's online-softmax step, the K/V row offsets of a block of paged slots,
the store of a program's rows (final or partial), and the log-sum-exp merge of a row's split partials.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None

if triton is not None:

    @triton.jit
    def _attend(q, k, v, valid, m_i, l_i, acc, qk_scale, MASKED: tl.constexpr, PRECISION: tl.constexpr):
        # m_i is the running row max in scaled base-2 units; acc and l_i are relative to it. The scale is
        # folded into the exponent's FMA, and P @ V accumulates into acc inside the dot.
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if MASKED:
            s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        # Masked: rows that have seen no valid key yet keep m = -inf; shift by 0 there to avoid inf - inf.
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new) if MASKED else m_new
        alpha = tl.exp2(m_i - m_new_safe)
        p = tl.exp2(s * qk_scale - m_new_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _merge_step(m, w_sum, acc, ls, po):
        # One split folded into a row's running merge: its base-2 log-sum-exp ``ls`` and fp32 partial ``po``.
        m_new = tl.maximum(m, ls)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(ls - m_safe)
        return m_new, w_sum * alpha + w, acc * alpha[:, None] + po * w[:, None]

    @triton.jit
    def _merge_result(m, w_sum, acc):
        # The merged output and the row's total base-2 log-sum-exp (-inf where no split saw a key).
        out = acc / tl.where(w_sum == 0.0, 1.0, w_sum)[:, None]
        return out, tl.where(w_sum == 0.0, float("-inf"), m + tl.log2(w_sum))

    @triton.jit
    def _merge_splits(OP, LSE, o_off, l_off, ok, n_split, s_ops, s_lss,
                      BLOCK: tl.constexpr, D: tl.constexpr, CACHE: tl.constexpr):  # fmt: skip
        # Each split's partial output weighted by exp2 of its base-2 log-sum-exp, split by split.
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        w_sum = tl.zeros([BLOCK], tl.float32)
        acc = tl.zeros([BLOCK, D], tl.float32)
        for s in range(0, n_split):
            ls = tl.load(LSE + s * s_lss + l_off, mask=ok, other=float("-inf"), cache_modifier=CACHE)
            po = tl.load(OP + s * s_ops + o_off, mask=ok[:, None], other=0.0, cache_modifier=CACHE).to(
                tl.float32
            )
            m, w_sum, acc = _merge_step(m, w_sum, acc, ls, po)
        return _merge_result(m, w_sum, acc)

    @triton.jit
    def _merge_splits_unrolled(OP, LSE, o_off, l_off, ok, n_split, s_ops, s_lss,
                               BLOCK: tl.constexpr, D: tl.constexpr, NSP: tl.constexpr):  # fmt: skip
        # _merge_splits over NSP >= n_split splits, unrolled: no load's address waits on an earlier
        # split's result, so the compiler may issue them ahead of the running max and sums.
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        w_sum = tl.zeros([BLOCK], tl.float32)
        acc = tl.zeros([BLOCK, D], tl.float32)
        for s in tl.static_range(NSP):
            live = ok & ((tl.zeros([BLOCK], tl.int32) + s) < n_split)
            ls = tl.load(LSE + s * s_lss + l_off, mask=live, other=float("-inf"))
            po = tl.load(OP + s * s_ops + o_off, mask=live[:, None], other=0.0).to(tl.float32)
            m, w_sum, acc = _merge_step(m, w_sum, acc, ls, po)
        return _merge_result(m, w_sum, acc)

    @triton.jit
    def _page_rows(PT, PF, b, h, n0, arange_n, end, s_pt, s_kp, s_kh,
                   D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_FILL: tl.constexpr):  # fmt: skip
        """Element offsets of the K/V rows of logical slots ``n0 + arange_n`` and which are tokens."""
        offs_n = n0 + arange_n
        valid = offs_n < end
        if BLOCK_N <= PAGE:
            # Splits and blocks start at multiples of BLOCK_N, so a block never crosses a page: one page
            # id per block and a contiguous tile.
            slot = n0 // PAGE
            page = tl.load(PT + b * s_pt + slot).to(tl.int64)
            in_page = n0 % PAGE + arange_n
            if HAS_FILL:
                valid = valid & (in_page < tl.load(PF + b * s_pt + slot))
        else:
            slot = offs_n // PAGE
            page = tl.load(PT + b * s_pt + slot, mask=valid, other=0).to(tl.int64)
            in_page = offs_n % PAGE
            if HAS_FILL:
                valid = valid & (in_page < tl.load(PF + b * s_pt + slot, mask=valid, other=0))
        return page * s_kp + h * s_kh + in_page * D, valid

    @triton.jit
    def _store_rows(o_acc, m_i, l_i, OUT, OP, LSE, RLSE, tok, head, offs_d, row_ok, pid_s,
                    s_ot, s_oh, s_ops, s_opt, s_oph, s_lss, s_lst, G: tl.constexpr, HKV: tl.constexpr,
                    SINGLE: tl.constexpr, ROW_LSE: tl.constexpr):  # fmt: skip
        """A program's rows once its keys are done: normalized output (one split: the final rows, and
        with ``ROW_LSE`` their natural-log log-sum-exp) or the split's partial (in ``OP``'s dtype) and base-2 LSE."""
        o = o_acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_i))
        if SINGLE:
            ptr = OUT + tok[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :]
            tl.store(ptr, o.to(OUT.dtype.element_ty), mask=row_ok[:, None])
            if ROW_LSE:  # natural log (x ln 2): the unit of torch.logsumexp and the salient update
                tl.store(RLSE + tok * (G * HKV) + head, lse * 0.6931471805599453, mask=row_ok)
        else:
            ptr = OP + pid_s * s_ops + tok[:, None] * s_opt + head[:, None] * s_oph + offs_d[None, :]
            tl.store(ptr, o.to(OP.dtype.element_ty), mask=row_ok[:, None])  # fp32, or 16-bit partials
            tl.store(LSE + pid_s * s_lss + tok * s_lst + head, lse, mask=row_ok)
