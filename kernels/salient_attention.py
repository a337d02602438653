"""Salient-column attention update: ``A_t ΔV`` read through the salient columns only (Triton + reference).

DyLLM's approximate path updates a stable row's attention context as ``C_t = C_{t-1} + A_t (V_t - V_{t-1})``
with ``A_t = softmax(q K_t^T)``, this step's attention row over every key. ``V_t - V_{t-1}`` (``ΔV``) is
zero outside the salient columns S (the rows whose K/V were recomputed), so

    ``A_t ΔV = Σ_{j in S} exp(scale q·k_j - lse) ΔV_j``,  ``lse = log Σ_{all keys j} exp(scale q·k_j)``.

This is exactly the difference of two full attentions ``attn(q, K_t, V_t) - attn(q, K_t, V_{t-1})``, without
the second one: only the salient columns' K and ΔV rows are read for the weighted sum. The softmax
normalizer still needs every key; given ``lse`` (the row's log-sum-exp of the attention that produced
``attn(q, K_t, V_t)``) nothing but the salient columns is read, otherwise one K-only pass computes it.

Layout (``B`` requests, ragged query lengths; the same as :mod:`.split_s_attention`):

- ``q``: ``[T, Hq, D]``, request ``b``'s rows ``q_offsets[b]:q_offsets[b+1]``; RoPE applied.
- ``k_pages``: ``[num_pages, Hkv, page_size, D]``, request ``b``'s paged slot ``j < kv_lens[b]`` is slot
  ``j % page_size`` of page ``page_table[b, j // page_size]`` (every slot below ``kv_lens[b]`` a token).
- ``k_local``: ``[T, Hkv, D]`` packed like ``q``: the keys of the request's own rows (after the update).
  Every row attends to its request's paged keys, then to all of its request's local keys.
- ``dv``: ``[T, Hkv, D]`` packed like ``q``: the value change of each local row (read at salient rows only).
- ``salient``: ``[T]`` packed row indices; request ``b``'s salient columns are
  ``salient[q_offsets[b] : q_offsets[b] + counts[b]]`` (rows of its own range).
- ``lse``: optional ``[T, Hq]`` float32, natural log (what the split-S kernel writes into ``lse_out``).
- returns ``[T, Hq, D]`` float32.

GQA: a program owns one (row block, request, KV head) and stacks the ``G = Hq / Hkv`` query heads of that KV
head as rows, as the split-S kernel does, so each K and ΔV tile is loaded once for the whole group. The key
range is not split: a request's rows loop over all of its keys for the normalizer.
"""

from __future__ import annotations

import torch

from pdllm.kernels.resources import guarded

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None

__all__ = ["salient_attention", "salient_attention_reference", "salient_columns"]

LOG2E = 1.4426950408889634

if triton is not None:

    @triton.jit
    def _running_lse(q, k, ok, m_i, l_i, qk_scale, PRECISION: tl.constexpr):
        # Online log-sum-exp in base 2: m_i the running row max, l_i the sum relative to it.
        s = tl.where(ok[None, :], tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows that have seen no key yet keep m = -inf; shift by 0 there to avoid inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        return m_new, l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)

    @triton.jit
    def _salient_kernel(
        Q, KP, PT, KVL, QO, KL, DV, SIDX, CNT, LSE, OUT,
        qk_scale,
        s_qt, s_qh, s_kp, s_kh, s_pt, s_lt, s_lh, s_dt, s_dh, s_et, s_eh, s_ot, s_oh,
        G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LSE: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        # A program owns (row block, request, KV head); the G query heads of that KV head are stacked as
        # rows (row r: token r // G, head hk * G + r % G), so each K/ΔV tile is loaded once for the group.
        pid_m, b, hk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        q0 = tl.load(QO + b)
        q1 = tl.load(QO + b + 1)
        arange_n = tl.arange(0, BLOCK_N)
        arange_d = tl.arange(0, D)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < (q1 - q0) * G
        tok = (q0 + offs_m // G).to(tl.int64)
        head = hk * G + offs_m % G
        if pid_m * BLOCK_M < (q1 - q0) * G:
            q_rows = tok[:, None] * s_qt + head[:, None] * s_qh
            q = tl.load(Q + q_rows + arange_d[None, :], mask=row_ok[:, None], other=0.0)
            if HAS_LSE:
                lse2 = (
                    tl.load(LSE + tok * s_et + head * s_eh, mask=row_ok, other=0.0) * 1.4426950408889634
                )  # log2 e
            else:
                # The normalizer over every key: paged slots, then the request's local keys (K only).
                m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
                l_i = tl.zeros([BLOCK_M], tl.float32)
                kv_len = tl.load(KVL + b)
                for n0 in range(0, kv_len, BLOCK_N):
                    offs = n0 + arange_n
                    ok = offs < kv_len
                    page = tl.load(PT + b * s_pt + offs // PAGE, mask=ok, other=0).to(tl.int64)
                    k = tl.load(
                        KP + page[:, None] * s_kp + hk * s_kh + (offs % PAGE)[:, None] * D + arange_d[None, :],
                        mask=ok[:, None], other=0.0,
                    )  # fmt: skip
                    m_i, l_i = _running_lse(q, k, ok, m_i, l_i, qk_scale, PRECISION)
                for n0 in range(0, q1 - q0, BLOCK_N):
                    offs = n0 + arange_n
                    ok = offs < q1 - q0
                    k = tl.load(
                        KL + (q0 + offs)[:, None] * s_lt + hk * s_lh + arange_d[None, :],
                        mask=ok[:, None],
                        other=0.0,
                    )
                    m_i, l_i = _running_lse(q, k, ok, m_i, l_i, qk_scale, PRECISION)
                # Every real row sees at least its own key; padded rows get a finite dummy.
                lse2 = tl.where(l_i > 0.0, m_i + tl.log2(l_i), 0.0)
            # The weighted sum over the salient columns only: their keys and value changes are gathered.
            acc = tl.zeros([BLOCK_M, D], tl.float32)
            count = tl.load(CNT + b)
            for n0 in range(0, count, BLOCK_N):
                ok = n0 + arange_n < count
                col = tl.load(SIDX + q0 + n0 + arange_n, mask=ok, other=0).to(tl.int64)
                k = tl.load(
                    KL + col[:, None] * s_lt + hk * s_lh + arange_d[None, :], mask=ok[:, None], other=0.0
                )
                dv = tl.load(
                    DV + col[:, None] * s_dt + hk * s_dh + arange_d[None, :], mask=ok[:, None], other=0.0
                )
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
                p = tl.where(ok[None, :], tl.exp2(s - lse2[:, None]), 0.0)
                acc = tl.dot(p, dv.to(tl.float32), acc, input_precision=PRECISION)
            out_rows = tok[:, None] * s_ot + head[:, None] * s_oh
            tl.store(OUT + out_rows + arange_d[None, :], acc, mask=row_ok[:, None])


def salient_columns(
    salient: torch.Tensor, member: torch.Tensor, batch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``salient`` and ``counts`` arguments from a per-row mask ``[T]`` and each row's request ``[T]``
    (non-decreasing, below ``batch``): a stable sort puts each request's salient rows first within its own
    range, on the device and without a host read (the counts stay device values the kernel loops to)."""
    order = torch.sort(member * 2 + (~salient).long(), stable=True).indices
    counts = torch.zeros(batch, dtype=torch.long, device=member.device)
    counts.index_add_(0, member, salient.long())
    return order, counts


def salient_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    q_offsets: torch.Tensor,
    k_local: torch.Tensor,
    dv: torch.Tensor,
    salient: torch.Tensor,
    counts: torch.Tensor,
    lse: torch.Tensor | None = None,
    scale: float | None = None,
    max_q_len: int | None = None,
) -> torch.Tensor:
    """Launch the Triton kernel (layouts in the module docstring); ``max_q_len`` (the largest request's
    rows) sizes the grid, read from ``q_offsets`` when omitted. Falls back to the reference where Triton
    refuses the launch for lack of resources."""
    if triton is None:
        raise RuntimeError("salient_attention needs triton; use salient_attention_reference on this machine")
    total_q, hq, d = q.shape
    _, hkv, page, _ = k_pages.shape
    if d & (d - 1) or d < 16:
        raise ValueError(f"head dim must be a power of two >= 16, got {d}")
    if k_pages.stride()[2:] != (d, 1) or any(t.stride(-1) != 1 for t in (q, k_local, dv)):
        raise ValueError(
            "k_pages needs contiguous [page_size, D] tiles; q, k_local, dv a contiguous last dim"
        )
    batch = page_table.shape[0]
    out = torch.empty(total_q, hq, d, dtype=torch.float32, device=q.device)
    if max_q_len is None:
        max_q_len = int((q_offsets[1:] - q_offsets[:-1]).max()) if batch else 0
    if total_q == 0 or max_q_len == 0:
        return out.zero_()
    args = (q, k_pages, page_table, kv_lens, q_offsets, k_local, dv, salient, counts, lse, scale)
    block_m, block_n = 64, 32  # block_m rows of stacked (token, head) pairs

    def launch() -> torch.Tensor:
        e = lse if lse is not None else out  # unused by the kernel without HAS_LSE
        pt = page_table.contiguous()
        grid = (triton.cdiv(max_q_len * (hq // hkv), block_m), batch, hkv)
        _salient_kernel[grid](
            q, k_pages, pt, kv_lens, q_offsets, k_local, dv, salient, counts, e, out,
            (d**-0.5 if scale is None else scale) * LOG2E,
            q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), pt.stride(0),
            k_local.stride(0), k_local.stride(1), dv.stride(0), dv.stride(1), e.stride(0), e.stride(1),
            out.stride(0), out.stride(1),
            G=hq // hkv, D=d, PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n, HAS_LSE=lse is not None,
            # fp32 inputs get exact fp32 dots (tf32 would cost them ~1e-3 relative)
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=4,
        )  # fmt: skip
        return out

    return guarded(
        ("salient_attention", q.dtype, d, page), launch, lambda: salient_attention_reference(*args)
    )


@torch.no_grad()
def salient_attention_reference(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    q_offsets: torch.Tensor,
    k_local: torch.Tensor,
    dv: torch.Tensor,
    salient: torch.Tensor,
    counts: torch.Tensor,
    lse: torch.Tensor | None = None,
    scale: float | None = None,
    max_q_len: int | None = None,
) -> torch.Tensor:
    """The same in torch, per request (float32; any device; reads lengths on the host). Without ``lse``
    the scores over every key are formed in slices of query rows, so a long request stays within memory."""
    del max_q_len  # the signature matches the kernel's launcher
    total_q, hq, d = q.shape
    hkv, page = k_pages.shape[1], k_pages.shape[2]
    group, scale = hq // hkv, d**-0.5 if scale is None else scale
    out = torch.zeros(total_q, hq, d, dtype=torch.float32, device=q.device)
    offs, lens, cnts = q_offsets.tolist(), kv_lens.tolist(), counts.tolist()
    for b in range(len(offs) - 1):
        q0, q1, count = offs[b], offs[b + 1], cnts[b]
        if q1 == q0 or count == 0:
            continue
        qb = q[q0:q1].float().transpose(0, 1)  # [Hq, Tb, D]
        cols = salient[q0 : q0 + count].long()
        ks = k_local[cols].float().transpose(0, 1).repeat_interleave(group, 0)  # [Hq, S, D]
        dvs = dv[cols].float().transpose(0, 1).repeat_interleave(group, 0)
        if lse is None:
            n_pages = -(-lens[b] // page)
            pages = page_table[b, :n_pages].long()
            paged = k_pages[pages].permute(1, 0, 2, 3).reshape(hkv, n_pages * page, d)[:, : lens[b]]
            keys = torch.cat([paged, k_local[q0:q1].transpose(0, 1)], 1).float().repeat_interleave(group, 0)
            row_lse = torch.cat(
                [torch.logsumexp(qb[:, i : i + 256] @ keys.transpose(1, 2) * scale, -1) for i in range(0, q1 - q0, 256)],
                1,
            )  # fmt: skip
        else:
            row_lse = lse[q0:q1].float().transpose(0, 1)  # [Hq, Tb]
        weights = torch.exp(qb @ ks.transpose(1, 2) * scale - row_lse[..., None])  # [Hq, Tb, S]
        out[q0:q1] = (weights @ dvs).transpose(0, 1)
    return out
