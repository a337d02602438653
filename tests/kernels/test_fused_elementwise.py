"""RMSNorm (+ residual), RoPE and SiLU-mul references against naive formulas; kernels on CUDA if present.

The Triton kernels run under the interpreter in ``interpreter_cases.py`` (cases rms_norm, rope, silu_mul),
which reuses the input builders and :func:`max_ulp` from here.
"""

from __future__ import annotations

import pytest
import torch

from pdllm.kernels.rms_norm import rms_norm, rms_norm_reference
from pdllm.kernels.rope import apply_rope, apply_rope_reference
from pdllm.kernels.silu_mul import silu_mul, silu_mul_fused, silu_mul_fused_reference, silu_mul_reference

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # vs float64 naive, relative to the row/tensor scale
EPS = 1e-6


def max_ulp(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between same-dtype 16-bit float tensors."""
    assert a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16), (a.dtype, b.dtype)
    ia, ib = (t.contiguous().view(torch.int16).int() for t in (a, b))
    ia, ib = (torch.where(i < 0, -32768 - i, i) for i in (ia, ib))  # sign-magnitude -> ordered ints
    return int((ia - ib).abs().max()) if a.numel() else 0


def rope_inputs(gen: torch.Generator, b: int, hq: int, hk: int, t: int, d: int, dtype: torch.dtype):
    """q/k as the model makes them (``[B, T, H, D]`` memory viewed as ``[B, H, T, D]``), real cos/sin."""
    q = torch.randn(b, t, hq, d, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(b, t, hk, d, generator=gen).to(dtype).transpose(1, 2)
    pos = torch.randint(0, 32768, (b, t), generator=gen).float()
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d))
    freqs = pos[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


def _close(got: torch.Tensor, want64: torch.Tensor, dtype: torch.dtype) -> None:
    err = (got.double() - want64).abs().max() / want64.abs().max()
    assert err < TOL[dtype], float(err)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 96), (2, 5, 3584), (1, 1, 4096), (3, 2, 100)])
def test_rms_norm_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=gen).to(dtype)
    x64 = x.double()
    naive = x64 / (x64.pow(2).mean(-1, keepdim=True) + EPS).sqrt() * w.double()
    out = rms_norm_reference(x, w, EPS)
    assert out.dtype == dtype and out.shape == x.shape
    _close(out, naive, dtype)
    # The rounding points the kernel mimics: fp32 statistics, normalised value rounded to x.dtype.
    h = x.float() * (x.float().pow(2).mean(-1, keepdim=True) + EPS).rsqrt()
    assert torch.equal(out, (w.float() * h.to(dtype).float()).to(dtype))
    # An fp32 weight promotes the output to fp32 (the model's weight may stay fp32).
    assert rms_norm_reference(x, w.float(), EPS).dtype == torch.float32
    # Residual: the bf16 sum is rounded once, then normalised.
    r = torch.randn(*shape, generator=gen).to(dtype)
    out2, s = rms_norm_reference(x, w, EPS, residual=r)
    assert torch.equal(s, (r.float() + x.float()).to(dtype))
    assert torch.equal(out2, rms_norm_reference(s, w, EPS))
    # Non-contiguous leading dims: rows are independent.
    if x.dim() == 3:
        xt = x.transpose(0, 1)
        assert torch.equal(rms_norm_reference(xt, w, EPS), out.transpose(0, 1))


def test_rms_norm_checks_shapes() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(ValueError):
        rms_norm_reference(x, torch.ones(7), EPS)
    with pytest.raises(ValueError):
        rms_norm_reference(x, torch.ones(8), EPS, residual=torch.randn(2, 8).bfloat16())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,hq,hk,t,d", [(1, 4, 4, 1, 64), (2, 28, 4, 7, 128), (3, 6, 2, 5, 96)])
def test_rope_reference(dtype: torch.dtype, b: int, hq: int, hk: int, t: int, d: int) -> None:
    gen = torch.Generator().manual_seed(hq * d + t)
    q, k, cos, sin = rope_inputs(gen, b, hq, hk, t, d, dtype)
    oq, ok = apply_rope_reference(q, k, cos, sin)
    half = d // 2
    c, s = cos[:, None, :, :half].double(), sin[:, None, :, :half].double()
    for x, out in ((q, oq), (k, ok)):
        assert out.shape == x.shape and out.dtype == dtype
        x1, x2 = x[..., :half].double(), x[..., half:].double()
        _close(out, torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1), dtype)  # rotation of (x1, x2) pairs
        # Rounding points the kernel mimics: each product rounded to the dtype, then the sum.
        xf, cf, sf = x.float(), cos[:, None].float(), sin[:, None].float()
        rot = torch.cat([-xf[..., half:], xf[..., :half]], -1)
        chain = ((xf * cf).to(dtype).float() + (rot * sf).to(dtype).float()).to(dtype)
        assert torch.equal(out, chain)
    # The transposed views and contiguous copies give the same values.
    cq, ck = apply_rope_reference(q.contiguous(), k.contiguous(), cos, sin)
    assert torch.equal(cq, oq) and torch.equal(ck, ok)


def test_rope_checks_shapes() -> None:
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8)
    with pytest.raises(ValueError):
        apply_rope_reference(q, k, torch.randn(1, 3, 7), torch.randn(1, 3, 7))
    with pytest.raises(ValueError):
        apply_rope_reference(q, torch.randn(1, 1, 4, 8), torch.randn(1, 3, 8), torch.randn(1, 3, 8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 96), (2, 3, 18944), (1, 100)])
def test_silu_mul_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(shape[-1])
    gate = (torch.randn(*shape, generator=gen) * 4).to(dtype)
    up = torch.randn(*shape, generator=gen).to(dtype)
    g64 = gate.double()
    out = silu_mul_reference(gate, up)
    _close(out, g64 * torch.sigmoid(g64) * up.double(), dtype)
    # silu rounded to the dtype before the multiply (the kernel's rounding points). torch's vectorised
    # fp32 silu may differ from this formula by an fp32 ulp, which can move a bf16 rounding: allow 1 ulp.
    silu = (gate.float() / (1 + torch.exp(-gate.float()))).to(dtype)
    chain = (silu.float() * up.float()).to(dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(out, chain, rtol=1e-6, atol=1e-7)
    else:
        assert max_ulp(out, chain) <= 1
    fused = torch.cat([gate, up], -1)
    assert torch.equal(silu_mul_fused_reference(fused), out)
    with pytest.raises(ValueError):
        silu_mul_fused_reference(fused[..., :-1])


cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the Triton kernels need CUDA (else interpreter)"
)


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_on_cuda(dtype: torch.dtype) -> None:
    """Production shapes (7B: hidden 3584, 28/4 heads of 128, intermediate 18944): bf16 within 1 ulp."""
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(0)
    dev = "cuda"

    def check(got: torch.Tensor, want: torch.Tensor) -> None:
        assert got.dtype == want.dtype and got.shape == want.shape
        if dtype == torch.float32:
            assert float((got - want).norm() / want.norm()) < 1e-5
        else:
            assert max_ulp(got, want) <= 1

    x = torch.randn(3, 37, 3584, generator=gen).to(dtype).to(dev)
    r = torch.randn(3, 37, 3584, generator=gen).to(dtype).to(dev)
    w = torch.randn(3584, generator=gen).to(dtype).to(dev)
    check(rms_norm(x, w, EPS), rms_norm_reference(x, w, EPS))
    for got, want in zip(rms_norm(x, w, EPS, r), rms_norm_reference(x, w, EPS, r)):
        check(got, want)
    q, k, cos, sin = (t.to(dev) for t in rope_inputs(gen, 2, 28, 4, 33, 128, dtype))
    for got, want in zip(apply_rope(q, k, cos, sin), apply_rope_reference(q, k, cos, sin)):
        check(got, want)
    gu = torch.randn(2, 19, 2 * 18944, generator=gen).to(dtype).to(dev)
    check(silu_mul_fused(gu), silu_mul_fused_reference(gu))
    check(silu_mul(gu[..., :18944], gu[..., 18944:]), silu_mul_reference(gu[..., :18944], gu[..., 18944:]))
