"""Top-B token-retention scores: bidirectional query<->chunk attention mass per chunk token (paper eq. 5).

Inputs are one layer of a chunked prefill, packed like :mod:`pdllm.kernels.chunk_prefill_attention`:
``q [total, Hq, D]``, ``k [total, Hkv, D]`` (RoPE applied), ``cu_seqlens`` int32 ``[N+1]``. Each sequence is a
chunk followed by the query tokens (the last ``query_lens[i]`` rows of sequence ``i``). With ``P`` the
attention probabilities of that sequence (softmax over all of its keys, per query head), chunk token ``j``
scores

    e(j) = sum_heads sum_{t in query} P[t -> j] + P[j -> t]

(the second term is zero under causal attention, where chunk tokens cannot see the later query). Query
positions get 0. Returns fp32 ``[total]``.

The kernel never forms ``P``: it takes the per-row log-sum-exp the prefill attention already computed
(``chunk_prefill_attention(..., return_lse=True)``) and recomputes only the query x chunk and chunk x query
score tiles, normalising them with that LSE; about ``4 * Lq * C * Hq * D`` flops per chunk against the
``4 * (C + Lq)^2 * Hq * D`` of the attention pass itself.

Tiles and stages are fitted to the device's shared memory per dtype (:func:`fit_config`); where nothing fits,
or Triton refuses the launch for lack of resources, the reference runs (logged once).
"""

from __future__ import annotations

import torch

from pdllm.kernels.chunk_prefill_attention import _sequence_scores, chunk_prefill_attention
from pdllm.kernels.resources import guarded, itemsize, smem_limit, warn_once

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

LOG2E = 1.4426950408889634
NUM_STAGES = 3  # Triton's default on CUDA
SCRATCH_BYTES = 4096


def smem_estimate(block_n: int, block_m: int, num_stages: int, dtype: torch.dtype, head_dim: int) -> int:
    """Upper estimate of one program's shared memory in bytes: the two chunk-side tiles (K rows and Q rows),
    ``num_stages`` buffers of the query-side tile, the fp32 score tile, and a scratch allowance."""
    tiles = (2 * block_n + num_stages * block_m) * head_dim * itemsize(dtype)
    return tiles + block_m * block_n * 4 + SCRATCH_BYTES


def fit_config(
    block_n: int, block_m: int, dtype: torch.dtype, head_dim: int, limit: int, num_stages: int = NUM_STAGES
) -> tuple[int, int, int] | None:
    """``(block_n, block_m, num_stages)`` as asked if :func:`smem_estimate` fits ``limit`` bytes, else the
    first that does of: fewer stages (down to 2), then BLOCK_M halved, then BLOCK_N halved (each down to
    16, at <= 2 stages), then each of those at 1 stage; None if none does. Pure."""
    cands = [(block_n, block_m, s) for s in range(num_stages, 1, -1)] or [(block_n, block_m, num_stages)]
    stages = min(num_stages, 2)
    tiles, bn, bm = [], block_n, block_m
    while bm > 16:
        bm //= 2
        tiles.append((bn, bm))
    while bn > 16:
        bn //= 2
        tiles.append((bn, bm))
    cands += [(n, m, stages) for n, m in tiles]
    if stages > 1:
        cands += [(n, m, 1) for n, m in [(block_n, block_m), *tiles]]
    return next((c for c in cands if smem_estimate(*c, dtype, head_dim) <= limit), None)


def _check(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, query_lens: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"need q [total, Hq, D] and k [total, Hkv, D], got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be int32 [N+1]")
    if query_lens.dtype != torch.int32 or query_lens.shape != (cu_seqlens.numel() - 1,):
        raise ValueError(f"query_lens must be int32 [N={cu_seqlens.numel() - 1}]")


def retention_scores_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor,
    query_lens: torch.Tensor,
    lse: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Materialises ``P`` per sequence with a softmax; ``lse`` is accepted for signature parity, unused."""
    _check(q, k, cu_seqlens, query_lens)
    scale = q.shape[2] ** -0.5 if scale is None else scale
    out = torch.zeros(q.shape[0], dtype=torch.float32, device=q.device)
    cu = cu_seqlens.tolist()
    for i, lq in enumerate(query_lens.tolist()):
        a, b = cu[i], cu[i + 1]
        c = b - a - lq
        if c < 0:
            raise ValueError(f"sequence {i} has {b - a} tokens but {lq} query tokens")
        if c == 0 or lq == 0:
            continue
        p = torch.softmax(_sequence_scores(q[a:b], k[a:b], scale, causal), -1)  # [Hq, T, T]
        out[a : a + c] = p[:, c:, :c].sum((0, 1)) + p[:, :c, c:].sum((0, 2))
    return out


if triton is not None:

    @triton.jit
    def _retention_kernel(
        Q, K, LSE2, CU, QL, OUT, qk_scale,
        s_qt, s_qh, s_kt, s_kh, s_lt, s_oh,
        G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        h = tl.program_id(1)
        seq = tl.program_id(2)
        start = tl.load(CU + seq)
        lq = tl.load(QL + seq)
        q_begin = tl.load(CU + seq + 1) - lq
        offs_j = start + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        j_ok = offs_j < q_begin
        if start + pid_n * BLOCK_N < q_begin:
            offs_d = tl.arange(0, D)
            j64 = offs_j.to(tl.int64)
            kc = tl.load(K + j64[:, None] * s_kt + h * s_kh + offs_d[None, :], mask=j_ok[:, None], other=0.0)
            score = tl.zeros([BLOCK_N], tl.float32)
            # Query rows (token, head in group) -> chunk tokens, column sums.
            for r0 in range(0, lq * G, BLOCK_M):
                rows = r0 + tl.arange(0, BLOCK_M)
                r_ok = rows < lq * G
                tok = (q_begin + rows // G).to(tl.int64)
                head = h * G + rows % G
                qq = tl.load(
                    Q + tok[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :],
                    mask=r_ok[:, None],
                    other=0.0,
                )
                lse = tl.load(LSE2 + tok * s_lt + head, mask=r_ok, other=float("inf"))
                s = tl.dot(qq, tl.trans(kc), input_precision=PRECISION) * qk_scale
                p = tl.exp2(s - lse[:, None])
                p = tl.where(r_ok[:, None] & j_ok[None, :], p, 0.0)
                score += tl.sum(p, 0)
            if not CAUSAL:
                # Chunk rows -> query tokens, row sums, one query head of the group at a time.
                for g in range(G):
                    qc = tl.load(
                        Q + j64[:, None] * s_qt + (h * G + g) * s_qh + offs_d[None, :],
                        mask=j_ok[:, None],
                        other=0.0,
                    )
                    lse_c = tl.load(LSE2 + j64 * s_lt + h * G + g, mask=j_ok, other=float("inf"))
                    for t0 in range(0, lq, BLOCK_M):
                        toks = t0 + tl.arange(0, BLOCK_M)
                        t_ok = toks < lq
                        t64 = (q_begin + toks).to(tl.int64)
                        kq = tl.load(
                            K + t64[:, None] * s_kt + h * s_kh + offs_d[None, :],
                            mask=t_ok[:, None],
                            other=0.0,
                        )
                        s = tl.dot(qc, tl.trans(kq), input_precision=PRECISION) * qk_scale
                        p = tl.exp2(s - lse_c[:, None])
                        p = tl.where(j_ok[:, None] & t_ok[None, :], p, 0.0)
                        score += tl.sum(p, 1)
            tl.store(OUT + h * s_oh + offs_j, score, mask=j_ok)


def retention_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor,
    query_lens: torch.Tensor,
    lse: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = False,
    max_chunk_len: int | None = None,
    block_n: int = 64,
    block_m: int = 64,
) -> torch.Tensor:
    """Triton launcher. ``lse`` is the prefill attention's natural-log LSE ``[total, Hq]`` (fp32); when
    omitted it is recomputed with :func:`chunk_prefill_attention` (an extra attention pass). ``block_n`` /
    ``block_m`` are the largest tiles wanted; :func:`fit_config` may shrink them for the device."""
    if triton is None:
        raise RuntimeError("retention_scores needs triton; use retention_scores_reference on this machine")
    _check(q, k, cu_seqlens, query_lens)
    total, hq, d = q.shape
    hkv = k.shape[1]
    scale = d**-0.5 if scale is None else scale
    if lse is None:
        lse = chunk_prefill_attention(q, k, k, cu_seqlens, causal=causal, scale=scale, return_lse=True)[1]
    if lse.shape != (total, hq):
        raise ValueError(f"lse must be [total={total}, Hq={hq}], got {tuple(lse.shape)}")
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("q and k need a contiguous last dim")
    lse2 = (lse.float() * LOG2E).contiguous()
    n_seq = cu_seqlens.numel() - 1
    if max_chunk_len is None:
        max_chunk_len = int((cu_seqlens[1:] - cu_seqlens[:-1] - query_lens).max())
    part = torch.zeros(hkv, total, dtype=torch.float32, device=q.device)
    if max_chunk_len <= 0 or total == 0:
        return part.sum(0)

    def reference() -> torch.Tensor:
        return retention_scores_reference(q, k, cu_seqlens, query_lens, scale=scale, causal=causal)

    limit = smem_limit(q.device)
    fitted = fit_config(block_n, block_m, q.dtype, d, limit)
    if fitted is None:
        warn_once(
            ("retention_scores", q.dtype, d, block_n, block_m),
            f"retention_scores: no tile config fits {limit} bytes of shared memory for {q.dtype} at head_dim "
            f"{d}; using the torch reference",
        )
        return reference()
    bn, bm, stages = fitted

    def launch() -> torch.Tensor:
        grid = (triton.cdiv(max_chunk_len, bn), hkv, n_seq)
        _retention_kernel[grid](
            q, k, lse2, cu_seqlens, query_lens, part, scale * LOG2E,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse2.stride(0), part.stride(0),
            G=hq // hkv, D=d, BLOCK_N=bn, BLOCK_M=bm, CAUSAL=causal,
            # fp32 inputs get exact fp32 dots (tf32 would cost them ~1e-3 relative), as split-S does
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=4, num_stages=stages,
        )  # fmt: skip
        return part.sum(0)

    return guarded(("retention_scores", q.dtype, d, causal, *fitted), launch, reference)
