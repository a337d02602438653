"""Skinny GEMMs for the single-request decode step (at most :data:`MAX_ROWS` rows), epilogues fused (Triton
+ reference).

- ``skinny_linear(x, w, bias, residual)``: ``x @ w.T (+ bias) (+ residual)``, the residual add of a decoder
  layer folded into the down projection's epilogue.
- ``skinny_silu_mul(x, w_gate_up)``: SwiGLU ``silu(x @ w_gate.T) * (x @ w_up.T)`` from the packed
  ``[2I, K]`` gate/up weight; each program accumulates the same ``BLOCK_N`` columns of gate and up, so the
  ``[M, 2I]`` projection never reaches memory and no separate activation kernel runs.

Why: a decode step forwards ~56 rows (question + response), so its GEMMs only stream weights. At those M,
cuBLAS read the gate/up and down weights at 0.86 / 0.79 of the HBM copy peak on an H100; a program here
owns ``BLOCK_N`` weight rows (swap-AB: the weight tile is the MMA's M side, the few activation rows its N
side, padded to 16..64) and streams them through ``num_stages`` buffers. Measured (``benchmarks/results/skinny_gemm.md``): gate/up +
SiLU 1.05x and down + residual 1.07x cuBLAS + the separate kernels; q/k/v and o stay on cuBLAS
(:func:`pick_config` returns None for shapes with no measured win, and for shapes the tiles do not divide).

Shared memory: :func:`smem_estimate` per config and dtype; :func:`pick_config` and every launch fit the config
to the limit (fewer stages, then smaller tiles), so fp32 gets shallower pipelines than bf16; where nothing
fits, or Triton refuses a launch for lack of resources, the torch reference runs (logged once).

Accumulation in fp32; the epilogue adds bias and residual in fp32 and rounds once (the eager chain rounds
after each op), so outputs agree with the reference to bf16 rounding, not bit for bit. With ``split > 1``
(long K, few columns) each split writes an fp32 partial and a second kernel sums them in a fixed order:
results do not depend on scheduling.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdllm.kernels.resources import H100_SMEM, guarded, itemsize, smem_limit, warn_once

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None

MAX_ROWS = 64  # one padded tile of activation rows per program


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int = 64
    block_k: int = 128
    split: int = 1  # K splits (fp32 partials + an ordered sum)
    num_warps: int = 4
    num_stages: int = 6


def skinny_linear_reference(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    y = F.linear(x, w, bias)
    return y if residual is None else residual + y


def skinny_silu_mul_reference(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
    return F.silu(gate) * up


def block_m_for(m: int) -> int:
    """The padded activation-row tile of ``m`` rows: the next power of two, at least 16."""
    return max(16, 1 << max(0, m - 1).bit_length())


def smem_estimate(config: SkinnyConfig, m: int, dtype: torch.dtype, glu: bool) -> int:
    """Upper estimate of one program's shared memory in bytes: ``num_stages`` buffers of the weight tile
    (gate and up for ``glu``) and the activation tile, plus the fp32 accumulator tile the epilogue
    transposes."""
    rows = config.block_n * (2 if glu else 1) + block_m_for(m)
    return config.num_stages * rows * config.block_k * itemsize(dtype) + config.block_n * block_m_for(m) * 4


def fit_config(
    config: SkinnyConfig, m: int, dtype: torch.dtype, glu: bool, limit: int
) -> SkinnyConfig | None:
    """``config`` if :func:`smem_estimate` fits ``limit`` bytes, else the first that does of: fewer stages
    (down to 2), then BLOCK_K halved, then BLOCK_N halved (each down to 16, at <= 2 stages; halving keeps
    them dividing N and K), then each of those at 1 stage; None if none does. Pure."""
    cands = [dataclasses.replace(config, num_stages=s) for s in range(config.num_stages, 1, -1)] or [config]
    stages = min(config.num_stages, 2)
    tiles, bk, bn = [], config.block_k, config.block_n
    while bk > 16:
        bk //= 2
        tiles.append((bn, bk))
    while bn > 16:
        bn //= 2
        tiles.append((bn, bk))
    cands += [dataclasses.replace(config, block_n=n, block_k=k, num_stages=stages) for n, k in tiles]
    if stages > 1:
        cands += [
            dataclasses.replace(config, block_n=n, block_k=k, num_stages=1)
            for n, k in [(config.block_n, config.block_k), *tiles]
        ]
    return next((c for c in cands if smem_estimate(c, m, dtype, glu) <= limit), None)


def pick_config(
    m: int, n: int, k: int, glu: bool, dtype: torch.dtype = torch.bfloat16, smem: int = H100_SMEM
) -> SkinnyConfig | None:
    """A config for ``[m, k] @ [n, k].T`` (``n``: output columns, half the packed rows for ``glu``) in
    ``dtype``, fitted to ``smem`` bytes of shared memory (:func:`fit_config`), or None where cuBLAS stays:
    too many rows, tiles that do not divide, a projection too small to gain (q/k/v and o at 7B shapes
    measured within ±3% of cuBLAS), or no config that fits (logged once)."""
    if m > MAX_ROWS or m == 0:
        return None
    block_n = next((b for b in (64, 32, 16) if n % b == 0), None)
    if block_n is None or (not glu and n * k < 32 * 1024 * 1024):
        return None
    split = 2 if not glu and k >= 4 * n else 1  # long K over few columns: fill the SMs
    block_k = next((b for b in (128, 64, 32, 16) if k % (b * split) == 0), None)
    if block_k is None:
        return None
    base = SkinnyConfig(block_n, block_k, split, num_stages=4 if glu else 6)
    fitted = fit_config(base, m, dtype, glu, smem)
    if fitted is None:
        warn_once(
            ("skinny_gemm", dtype, glu, block_m_for(m)),
            f"skinny_gemm: no config fits {smem} bytes of shared memory for {dtype} at {block_m_for(m)} rows "
            f"(glu={glu}); cuBLAS runs these GEMMs",
        )
    return fitted


if triton is not None:

    @triton.jit
    def _skinny_kernel(X, W, BIAS, RES, Y, PART, M, N, k_split, s_xm, s_wn, s_rm, s_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                       GLU: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
        # Swap-AB: acc is [BLOCK_N weight rows, BLOCK_M activation rows], i.e. Y's tile transposed.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        w_rows = W + offs_n[:, None].to(tl.int64) * s_wn
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        k0 = pid_k * k_split
        for k in range(k0, k0 + k_split, BLOCK_K):
            x = tl.load(X + offs_m[None, :] * s_xm + (k + offs_k)[:, None], mask=m_ok[None, :], other=0.0)
            acc = tl.dot(tl.load(w_rows + (k + offs_k)[None, :]), x, acc, input_precision=PRECISION)
            if GLU:  # the up rows sit N rows below the gate rows in the packed weight
                acc_up = tl.dot(
                    tl.load(w_rows + N * s_wn + (k + offs_k)[None, :]), x, acc_up, input_precision=PRECISION
                )
        if SPLIT == 1:
            if HAS_BIAS:
                acc += tl.load(BIAS + offs_n).to(tl.float32)[:, None]
            if GLU:
                acc = acc / (1.0 + tl.exp(-acc)) * acc_up
            if HAS_RES:
                acc += tl.load(RES + offs_m[None, :] * s_rm + offs_n[:, None], mask=m_ok[None, :]).to(
                    tl.float32
                )
            y = Y + offs_m[None, :] * s_ym + offs_n[:, None]
            tl.store(y, acc.to(Y.dtype.element_ty), mask=m_ok[None, :])
        else:
            part = PART + pid_k * M * N + offs_m[None, :] * N + offs_n[:, None]
            tl.store(part, acc, mask=m_ok[None, :])

    @triton.jit
    def _sum_splits_kernel(PART, BIAS, RES, Y, M, N, s_rm, s_ym, SPLIT: tl.constexpr,
                           HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < M * N
        row = offs // N
        col = offs % N
        acc = tl.zeros([BLOCK], tl.float32)
        for s in range(SPLIT):
            acc += tl.load(PART + s * M * N + offs, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(BIAS + col, mask=ok, other=0.0).to(tl.float32)
        if HAS_RES:
            acc += tl.load(RES + row * s_rm + col, mask=ok, other=0.0).to(tl.float32)
        tl.store(Y + row * s_ym + col, acc.to(Y.dtype.element_ty), mask=ok)


def _check(x: torch.Tensor, w: torch.Tensor, n: int, config: SkinnyConfig) -> None:
    if x.dim() != 2 or x.dtype != w.dtype:
        raise ValueError(f"need a 2-D x of w's dtype, got {tuple(x.shape)} {x.dtype}, w {w.dtype}")
    m, k = x.shape
    if w.dim() != 2 or w.shape[1] != k or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(
            f"need x [M, K], w [N, K] with unit column strides, got {tuple(x.shape)}, {tuple(w.shape)}"
        )
    if m > MAX_ROWS:
        raise ValueError(f"skinny GEMMs take at most {MAX_ROWS} rows, got {m}")
    if n % config.block_n or k % (config.block_k * config.split):
        raise ValueError(f"config {config} does not tile N={n}, K={k}")


def _launch(
    x: torch.Tensor,
    w: torch.Tensor,
    n: int,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    glu: bool,
    config: SkinnyConfig,
) -> torch.Tensor:
    """Fit ``config`` to the device for x's dtype and launch it; the reference where nothing fits or Triton
    refuses the launch for lack of resources (each logged once)."""
    if triton is None:
        raise RuntimeError("skinny GEMMs need triton; use the *_reference functions on this machine")
    _check(x, w, n, config)
    m, k = x.shape
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"residual must be [{m}, {n}] with unit column stride")

    def reference() -> torch.Tensor:
        return skinny_silu_mul_reference(x, w) if glu else skinny_linear_reference(x, w, bias, residual)

    limit = smem_limit(x.device)
    fitted = fit_config(config, m, x.dtype, glu, limit)
    if fitted is None:
        warn_once(
            ("skinny_gemm", x.dtype, glu, block_m_for(m), config),
            f"skinny_gemm: {config} has no variant that fits {limit} bytes of shared memory for {x.dtype} at "
            f"{block_m_for(m)} rows (glu={glu}); using the torch reference",
        )
        return reference()
    key = ("skinny_gemm", x.dtype, glu, block_m_for(m), fitted)
    return guarded(key, lambda: _launch_kernel(x, w, n, bias, residual, glu, fitted), reference)


def _launch_kernel(
    x: torch.Tensor,
    w: torch.Tensor,
    n: int,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    glu: bool,
    config: SkinnyConfig,
) -> torch.Tensor:
    m, k = x.shape
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    split = config.split
    part = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    res = residual if residual is not None else y
    b = bias if bias is not None else y
    grid = (n // config.block_n, split)
    _skinny_kernel[grid](
        x, w, b, res, y, part, m, n, k // split, x.stride(0), w.stride(0), res.stride(0), y.stride(0),
        BLOCK_M=block_m_for(m), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT=split, HAS_BIAS=bias is not None, HAS_RES=residual is not None, GLU=glu,
        # fp32 inputs (tests, small fp32 models) get exact fp32 dots; tf32 would cost them ~1e-3 relative
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            part, b, res, y, m, n, res.stride(0), y.stride(0), SPLIT=split,
            HAS_BIAS=bias is not None, HAS_RES=residual is not None, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return y


def skinny_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """``x [M, K] @ w [N, K].T (+ bias [N]) (+ residual [M, N])``, M <= :data:`MAX_ROWS`; values as
    :func:`skinny_linear_reference` up to one rounding. ``config`` None: :func:`pick_config`'s, or a
    ValueError where it has none (callers ask :func:`pick_config` first)."""
    config = config or pick_config(
        x.shape[0], w.shape[0], x.shape[1], glu=False, dtype=x.dtype, smem=smem_limit(x.device)
    )
    if config is None:
        raise ValueError(f"no skinny config for x {tuple(x.shape)}, w {tuple(w.shape)}")
    return _launch(x, w, w.shape[0], bias, residual, False, config)


def skinny_silu_mul(
    x: torch.Tensor, w_gate_up: torch.Tensor, config: SkinnyConfig | None = None
) -> torch.Tensor:
    """``silu(x @ gate.T) * (x @ up.T)`` with ``w_gate_up = cat([gate, up])`` ``[2I, K]``; ``[M, I]`` out."""
    if w_gate_up.dim() != 2 or w_gate_up.shape[0] % 2:
        raise ValueError(f"w_gate_up must be [2I, K], got {tuple(w_gate_up.shape)}")
    n = w_gate_up.shape[0] // 2
    config = config or pick_config(
        x.shape[0], n, x.shape[1], glu=True, dtype=x.dtype, smem=smem_limit(x.device)
    )
    if config is None:
        raise ValueError(f"no skinny config for x {tuple(x.shape)}, w_gate_up {tuple(w_gate_up.shape)}")
    if config.split != 1:
        raise ValueError("the SwiGLU epilogue needs whole sums: split must be 1")
    return _launch(x, w_gate_up, n, None, None, True, config)
