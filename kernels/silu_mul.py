"""SwiGLU activation ``silu(gate) * up`` in one pass (Triton + reference).

Two entry points with one kernel: ``silu_mul(gate, up)`` for separate ``[..., I]`` tensors, and
``silu_mul_fused(gate_up)`` for one ``[..., 2 * I]`` projection output (gate = first half, up = second
half), read in place through two pointers into the same rows. Results are contiguous ``[..., I]`` in the
promoted dtype of gate and up; ``silu(gate)`` is rounded to gate's dtype before the multiply, like eager
``F.silu(gate) * up``. Grid: (rows, column blocks); rows first because axis 0 has no 65535 limit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdllm.kernels.resources import guarded
from pdllm.kernels.rms_norm import as_rows

try:
    import triton
    import triton.language as tl

    from pdllm.kernels.rms_norm import round_to
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None

BLOCK = 1024


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape or gate.dim() < 1:
        raise ValueError(f"need gate, up of one shape [..., I], got {tuple(gate.shape)}, {tuple(up.shape)}")


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    _check(gate, up)
    return F.silu(gate) * up


def _halves(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up needs an even last dim [..., 2 * I], got {tuple(gate_up.shape)}")
    gate, up = gate_up.chunk(2, dim=-1)
    return gate, up


def silu_mul_fused_reference(gate_up: torch.Tensor) -> torch.Tensor:
    return silu_mul_reference(*_halves(gate_up))


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(G, U, OUT, n, s_g, s_u, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        g = tl.load(G + row * s_g + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(U + row * s_u + offs, mask=ok, other=0.0).to(tl.float32)
        # torch's silu: x / (1 + exp(-x)) in fp32, rounded to gate's dtype before the multiply.
        act = round_to(g / (1.0 + tl.exp(-g)), G.dtype.element_ty)
        out = round_to(act * u, OUT.dtype.element_ty)
        tl.store(OUT + row * n + offs, out.to(OUT.dtype.element_ty), mask=ok)


def _launch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gate``/``up``: ``[rows, I]`` with unit last stride (row strides may differ). If Triton refuses the
    launch for lack of resources, the reference's result (logged once)."""
    out = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    rows, n = gate.shape
    if not (rows and n):
        return out
    block = min(BLOCK, triton.next_power_of_2(n))

    def launch() -> torch.Tensor:
        grid = (rows, triton.cdiv(n, block))
        _silu_mul_kernel[grid](gate, up, out, n, gate.stride(0), up.stride(0), BLOCK=block, num_warps=4)
        return out

    return guarded(
        ("silu_mul", gate.dtype, up.dtype, block), launch, lambda: silu_mul_reference(gate, up).contiguous()
    )


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton launcher for ``silu(gate) * up``; same signature and values as :func:`silu_mul_reference`."""
    if triton is None:
        raise RuntimeError("silu_mul needs triton; use silu_mul_reference on this machine")
    _check(gate, up)
    return _launch(as_rows(gate), as_rows(up)).view(gate.shape)


def silu_mul_fused(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton launcher for ``[..., 2I] -> [..., I]``; same values as :func:`silu_mul_fused_reference`."""
    if triton is None:
        raise RuntimeError("silu_mul_fused needs triton; use silu_mul_fused_reference on this machine")
    gate, up = _halves(gate_up)
    rows = as_rows(gate_up)  # one copy at most; the halves are column slices of the same rows
    half = gate.shape[-1]
    return _launch(rows[:, :half], rows[:, half:]).view(gate.shape)
