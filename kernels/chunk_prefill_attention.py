"""Block-diagonal (per-chunk) varlen attention for chunked prefill and chunk scoring.

``q [total, Hq, D]``, ``k, v [total, Hkv, D]`` hold N sequences packed back to back; sequence ``i`` is rows
``cu_seqlens[i]:cu_seqlens[i+1]`` and attends only within itself, bidirectionally (prefill) or causally
(scoring). Returns ``[total, Hq, D]`` and, with ``return_lse``, the natural-log log-sum-exp of each
(row, head) as fp32 ``[total, Hq]`` (what :mod:`pdllm.kernels.retention_scores` needs).

No Triton kernel here on purpose: on CUDA with fp16/bf16 the FlashAttention-2 varlen kernel that ships
inside PyTorch (``aten._flash_attention_forward``) already does exactly this, GQA included without
repeating KV, and returns the LSE. When every sequence has ``max_seqlen`` tokens and no LSE is asked for,
one batched SDPA call is used instead (1.5x faster than the varlen kernel on an H100, see
``benchmarks/results/attention.md``). Elsewhere (CPU, fp32) each sequence goes through SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(
            f"need q [total, Hq, D], k/v [total, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on tokens or head dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype != torch.int32:
        raise ValueError("cu_seqlens must be int32 [N+1] starting at 0 and ending at total")


def _sequence_scores(
    q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool
) -> torch.Tensor:  # [Hq, T, T] fp32, masked entries -inf
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float().repeat_interleave(g, 1)) * scale
    if causal:
        t = q.shape[0]
        s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return s


def chunk_prefill_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Explicit fp32 softmax per sequence (materialises ``[Hq, T, T]``; for tests and small inputs)."""
    _check(q, k, v, cu_seqlens)
    scale = q.shape[2] ** -0.5 if scale is None else scale
    g = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    cu = cu_seqlens.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        if a == b:
            continue
        s = _sequence_scores(q[a:b], k[a:b], scale, causal)
        lse[a:b] = torch.logsumexp(s, -1).transpose(0, 1)
        p = torch.softmax(s, -1)
        out[a:b] = torch.einsum("hqk,khd->qhd", p, v[a:b].float().repeat_interleave(g, 1)).to(q.dtype)
    return (out, lse) if return_lse else out


def _flash_ok(q: torch.Tensor) -> bool:
    return (
        q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[2] % 8 == 0 and q.shape[2] <= 256
    )


def chunk_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    max_seqlen: int | None = None,
    uniform: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Varlen block-diagonal attention; ``max_seqlen`` avoids a device sync when given. ``uniform=False``:
    never take the equal-lengths shortcut (a captured call replays with other lengths in ``cu_seqlens``)."""
    _check(q, k, v, cu_seqlens)
    scale = q.shape[2] ** -0.5 if scale is None else scale
    n = cu_seqlens.numel() - 1
    if uniform and not return_lse and max_seqlen is not None and max_seqlen * n == q.shape[0]:
        # All sequences have max_seqlen tokens (known without a device sync): one batched SDPA call.
        # On the H100 that beat the flash varlen kernel by ~1.5x (benchmarks/results/attention.md).
        q4, k4, v4 = (x.view(n, max_seqlen, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(
            q4, k4, v4, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        return o.transpose(1, 2).reshape(q.shape)
    if _flash_ok(q):
        if max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        out, lse = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, causal, False, scale=scale
        )[:2]
        if not return_lse:
            return out
        # The varlen kernel returns the LSE as [Hq, total] (natural log).
        if lse.shape != (q.shape[1], q.shape[0]):
            raise RuntimeError(f"unexpected LSE shape {tuple(lse.shape)} from the flash varlen kernel")
        return out, lse.float().transpose(0, 1).contiguous()
    if return_lse:
        return chunk_prefill_attention_reference(q, k, v, cu_seqlens, causal, scale, return_lse=True)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    cu = cu_seqlens.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        if a == b:
            continue
        o = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
            is_causal=causal, scale=scale, enable_gqa=gqa,
        )  # fmt: skip
        out[a:b] = o.transpose(0, 1)
    return out
