"""Rotary position embedding of q and k in one launch (Triton + reference).

``q [B, Hq, T, D]``, ``k [B, Hk, T, D]`` with any strides (the model passes ``linear(x).view(b, t, h, d)
.transpose(1, 2)`` views; they are read in place, never copied), ``cos``/``sin`` ``[B, T, D]`` in the
duplicated-halves form ``[freqs, freqs]``; ``D`` even. Result: ``x * cos + rotate_half(x) * sin`` with
``rotate_half(x) = cat(-x2, x1)``, in the promoted dtype of ``q`` and ``cos``, each product rounded to that
dtype and then the sum, as eager torch does; the inputs are not modified.

Output layout: new tensors whose memory is token-major ``[B, T, H, D]`` (contiguous), returned as the
``[B, H, T, D]`` view ``.transpose(1, 2)``. That is the layout eager torch gives for the model's views, SDPA
takes it as is (unit last stride), and ``out.transpose(1, 2).reshape(B * T, H, D)`` (the packed
``[total, H, D]`` layout of the split-S / chunk-prefill kernels) is a free view.

Grid: (B * T tokens, head blocks of q then of k). A program loads its token's cos/sin once and rotates
``BLOCK_H`` heads, so GQA (``Hq != Hk``) needs nothing special.
"""

from __future__ import annotations

import torch

from pdllm.kernels.resources import guarded

try:
    import triton
    import triton.language as tl

    from pdllm.kernels.rms_norm import round_to
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"need q [B, Hq, T, D], k [B, Hk, T, D], got {tuple(q.shape)}, {tuple(k.shape)}")
    b, _, t, d = q.shape
    if d % 2 or cos.shape != (b, t, d) or sin.shape != cos.shape:
        raise ValueError(f"need even D and cos/sin [B={b}, T={t}, D={d}], got {tuple(cos.shape)}")
    if k.dtype != q.dtype or sin.dtype != cos.dtype:
        raise ValueError("q/k and cos/sin must share dtypes")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's eager ``apply_rope`` on q and k."""
    _check(q, k, cos, sin)
    c, s = cos[:, None], sin[:, None]
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


if triton is not None:

    @triton.jit
    def _rope_heads(
        X, OUT, b, t, h0, n_heads, half, c1, c2, s1, s2,
        sxb, sxh, sxt, sxd, sob, soh, sot, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        heads = h0 + tl.arange(0, BLOCK_H)
        offs = tl.arange(0, BLOCK_D)
        ok = (heads < n_heads)[:, None] & (offs < half)[None, :]
        src = X + b * sxb + t * sxt + heads[:, None] * sxh + offs[None, :] * sxd
        x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + half * sxd, mask=ok, other=0.0).to(tl.float32)
        dt = OUT.dtype.element_ty
        # out = x*cos + rotate_half(x)*sin, each product then the sum rounded; (-x2)*s1 == -(x2*s1) exactly.
        o1 = round_to(round_to(x1 * c1, dt) - round_to(x2 * s1, dt), dt)
        o2 = round_to(round_to(x2 * c2, dt) + round_to(x1 * s2, dt), dt)
        dst = OUT + b * sob + t * sot + heads[:, None] * soh + offs[None, :]
        tl.store(dst, o1.to(dt), mask=ok)
        tl.store(dst + half, o2.to(dt), mask=ok)

    @triton.jit
    def _rope_kernel(
        Q, K, C, S, OQ, OK, T, hq, hk, half,
        sqb, sqh, sqt, sqd, skb, skh, skt, skd, scb, sct, scd, ssb, sst, ssd,
        soqb, soqh, soqt, sokb, sokh, sokt,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        tok = tl.program_id(0)
        blk = tl.program_id(1)
        b = (tok // T).to(tl.int64)
        t = (tok % T).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        ok = offs < half
        cs = C + b * scb + t * sct + offs * scd
        ss = S + b * ssb + t * sst + offs * ssd
        # Both halves are read (not assumed equal) so any cos/sin gives the reference's answer.
        c1 = tl.load(cs, mask=ok, other=0.0).to(tl.float32)[None, :]
        c2 = tl.load(cs + half * scd, mask=ok, other=0.0).to(tl.float32)[None, :]
        s1 = tl.load(ss, mask=ok, other=0.0).to(tl.float32)[None, :]
        s2 = tl.load(ss + half * ssd, mask=ok, other=0.0).to(tl.float32)[None, :]
        q_blocks = tl.cdiv(hq, BLOCK_H)
        if blk < q_blocks:
            _rope_heads(
                Q, OQ, b, t, blk * BLOCK_H, hq, half, c1, c2, s1, s2,
                sqb, sqh, sqt, sqd, soqb, soqh, soqt, BLOCK_H, BLOCK_D,
            )  # fmt: skip
        else:
            _rope_heads(
                K, OK, b, t, (blk - q_blocks) * BLOCK_H, hk, half, c1, c2, s1, s2,
                skb, skh, skt, skd, sokb, sokh, sokt, BLOCK_H, BLOCK_D,
            )  # fmt: skip


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher, same signature and values as :func:`apply_rope_reference` (layout: module doc). If
    Triton refuses the launch for lack of resources, the reference's result (logged once)."""
    if triton is None:
        raise RuntimeError("apply_rope needs triton; use apply_rope_reference on this machine")
    _check(q, k, cos, sin)
    b, hq, t, d = q.shape
    hk = k.shape[1]
    dtype = torch.promote_types(q.dtype, cos.dtype)
    oq = torch.empty(b, t, hq, d, dtype=dtype, device=q.device).transpose(1, 2)
    ok = torch.empty(b, t, hk, d, dtype=dtype, device=q.device).transpose(1, 2)
    if b * t == 0 or d == 0:
        return oq, ok
    half = d // 2
    block_d = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(max(hq, hk)), max(1, 1024 // block_d))  # ~2K elements a program
    grid = (b * t, triton.cdiv(hq, block_h) + triton.cdiv(hk, block_h))

    def launch() -> tuple[torch.Tensor, torch.Tensor]:
        _rope_kernel[grid](
            q, k, cos, sin, oq, ok, t, hq, hk, half,
            *q.stride(), *k.stride(), *cos.stride(), *sin.stride(), *oq.stride()[:3], *ok.stride()[:3],
            BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
            enable_fp_fusion=False,  # no FMA contraction: fp32 results equal eager torch's separate mul/add
        )  # fmt: skip
        return oq, ok

    key = ("rope", q.dtype, cos.dtype, block_h, block_d)
    return guarded(key, launch, lambda: apply_rope_reference(q, k, cos, sin))
