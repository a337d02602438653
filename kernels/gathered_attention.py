"""Split-S decode attention off the GPU: each request's pages gathered, its local K/V appended, one SDPA call.

Same inputs as :func:`~pdllm.kernels.split_s_attention.split_s_attention` (no ``page_fill``: every slot
below ``kv_len`` is a token). Memory-efficient, unlike the kernel's torch reference, whose ``[T, S]`` scores
a vanilla request's thousands of rows would make gigabytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdllm.kernels.split_s_reference import gather_request


def gathered_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    q_offsets: torch.Tensor,
    k_local: torch.Tensor | None = None,
    v_local: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per request one SDPA call over its gathered pages then its local K/V; ``lse_out`` (SDPA does not
    return its normalizer) is formed from the same keys by :func:`row_lse`."""
    out = torch.empty_like(q)
    offs, lens = q_offsets.tolist(), kv_lens.tolist()
    for b, kv_len in enumerate(lens):
        q0, q1 = offs[b], offs[b + 1]
        if q1 == q0:
            continue
        k, v, _ = gather_request(b, k_pages, v_pages, page_table, kv_len, None)  # every slot valid
        if k_local is not None and v_local is not None:
            k = torch.cat([k, k_local[q0:q1].transpose(0, 1)], 1)
            v = torch.cat([v, v_local[q0:q1].transpose(0, 1)], 1)
        qb = q[q0:q1].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qb, k[None], v[None], enable_gqa=qb.shape[1] != k.shape[0])
        out[q0:q1] = o[0].transpose(0, 1)
        if lse_out is not None:
            lse_out[q0:q1] = row_lse(q[q0:q1], k)
    return out


def row_lse(q: torch.Tensor, k: torch.Tensor, max_scores: int = 1 << 24) -> torch.Tensor:
    """``log Σ_j exp(q·k_j / sqrt(D))`` ``[rows, Hq]`` float32 of queries ``[rows, Hq, D]`` over keys
    ``[Hkv, L, D]`` (query head ``h`` reads KV head ``h // G``), in slices of rows of at most
    ``max_scores`` scores, so a long request's ``[Hq, rows, L]`` scores never exist at once."""
    rows, hq, d = q.shape
    hkv, length = k.shape[0], k.shape[1]
    g = hq // hkv
    kt = k.float().transpose(1, 2)  # [Hkv, D, L]
    step = max(1, max_scores // max(1, hq * length))
    out = torch.empty(rows, hq, dtype=torch.float32, device=q.device)
    for i in range(0, rows, step):
        part = q[i : i + step].float()
        n = part.shape[0]
        grouped = part.reshape(n, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, n * g, d)
        lse = torch.logsumexp(grouped @ kt * d**-0.5, -1)  # [Hkv, n * G]
        out[i : i + n] = lse.view(hkv, n, g).permute(1, 0, 2).reshape(n, hq)
    return out
