"""RMSNorm, optionally fused with the residual add before it (Triton + reference).

``rms_norm(x, weight, eps)`` is the model's ``RMSNorm``: fp32 statistics, the normalised value rounded to
``x.dtype``, then multiplied by ``weight`` (result dtype = torch's promotion of ``weight`` and ``x``).
With ``residual`` it is a decoder layer's ``s = residual + x; out = norm(s)`` and returns ``(out, s)``, the
sum rounded to ``x.dtype`` first exactly like torch's add. One program per row (all leading dims flattened),
the whole row in one tile, so the hidden size is capped at :data:`MAX_HIDDEN`.

The kernel rounds where the eager chain rounds, so bf16/fp16 outputs match the reference bit for bit
except where the fp32 sum of squares (reduction order differs) moves a value across a rounding boundary.
"""

from __future__ import annotations

import torch

from pdllm.kernels.resources import guarded

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None

MAX_HIDDEN = 8192  # one row per program in registers; larger rows would need a looped kernel


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if weight.dim() != 1 or x.dim() < 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"need x [..., N] and weight [N], got {tuple(x.shape)}, {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError("residual must have x's shape and dtype")


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The model's RMSNorm in eager torch; with ``residual``: ``(norm(residual + x), residual + x)``."""
    _check(x, weight, residual)
    if residual is not None:
        s = residual + x
        return rms_norm_reference(s, weight, eps), s
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


if triton is not None:

    @triton.jit
    def round_to(x, dtype: tl.constexpr):
        """fp32 ``x`` rounded to nearest-even in ``dtype``, kept as fp32 (an eager op's output rounding).

        bf16 is rounded on the bits: the interpreter's fp32->bf16 cast truncates, and on the GPU this is
        the same RNE as ``cvt.rn.bf16.f32``. NaN is passed through (the bit trick would turn it into 0).
        """
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
        else:
            return x.to(dtype).to(tl.float32)

    @triton.jit
    def _rms_norm_kernel(
        X, R, W, OUT, SUM, n, eps, s_x, s_r, BLOCK: tl.constexpr, HAS_RES: tl.constexpr
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        ok = offs < n
        x = tl.load(X + row * s_x + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(R + row * s_r + offs, mask=ok, other=0.0).to(tl.float32)
            x = round_to(x + r, X.dtype.element_ty)  # torch's add rounds the sum to x.dtype
            tl.store(SUM + row * n + offs, x.to(SUM.dtype.element_ty), mask=ok)
        inv = tl.rsqrt(tl.sum(x * x, 0) / n + eps)
        h = round_to(x * inv, X.dtype.element_ty)  # the reference's h.to(x.dtype)
        w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
        out = round_to(w * h, OUT.dtype.element_ty)
        tl.store(OUT + row * n + offs, out.to(OUT.dtype.element_ty), mask=ok)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``[..., N]`` as ``[rows, N]`` with a unit last stride (a view when the leading dims allow)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher, same signature and results as :func:`rms_norm_reference`; outputs are contiguous.
    If Triton refuses the launch for lack of resources, the reference's result (logged once)."""
    if triton is None:
        raise RuntimeError("rms_norm needs triton; use rms_norm_reference on this machine")
    _check(x, weight, residual)
    n = x.shape[-1]
    if n > MAX_HIDDEN:
        raise ValueError(f"hidden size {n} > {MAX_HIDDEN}: the single-tile kernel keeps a row in registers")
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    x2 = as_rows(x)
    r2 = as_rows(residual) if residual is not None else x2
    if not (x2.shape[0] and n):
        return out if s is None else (out, s)
    block = triton.next_power_of_2(n)
    warps = 4 if block <= 1024 else 8 if block <= 4096 else 16

    def launch() -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight.contiguous(), out, s if s is not None else out, n, eps, x2.stride(0), r2.stride(0),
            BLOCK=block, HAS_RES=residual is not None, num_warps=warps,
        )  # fmt: skip
        return out if s is None else (out, s)

    key = ("rms_norm", x.dtype, weight.dtype, block, residual is not None)
    return guarded(key, launch, lambda: rms_norm_reference(x, weight, eps, residual))
