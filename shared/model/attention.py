"""Pluggable attention backends.

The transformer computes q/k/v (RoPE applied) for the tokens it is given and hands them, per layer, to
an :class:`AttentionBackend`. The backend decides what those tokens may see: a dense mask, a causal
mask, static KV segments from a prefill (the Prefilling-dLLM decode), a Triton split-S kernel on CUDA.
Keeping this one call the only seam keeps every method's model forward identical.

Shapes: q ``[B, Hq, T, D]``; k, v ``[B, Hkv, T, D]``; output ``[B, Hq, T, D]``. ``Hq`` is a multiple of
``Hkv`` (GQA); backends must not materialise repeated KV heads where they can avoid it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Scaled dot-product attention with GQA; ``mask`` is boolean (True = may attend) or additive."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=q.shape[1] != k.shape[1]
    )


@dataclass
class DenseAttention:
    """Every token attends to the tokens of the same forward, under an optional mask.

    ``mask`` is boolean ``[B or 1, 1, T, T]`` (True = may attend); ``causal`` adds the causal constraint.
    """

    mask: torch.Tensor | None = None
    causal: bool = False

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        mask = self.mask
        if mask is not None and self.causal:
            t = q.shape[2]
            mask = mask & torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        return sdpa(q, k, v, mask=mask, causal=self.causal)


@dataclass
class PrefixAttention:
    """The forward's tokens attend to static per-layer prefix KV plus themselves (bidirectionally).

    ``prefix[layer] = (k, v)`` with ``k, v: [B, Hkv, P, D]``; ``prefix_mask`` optionally restricts which
    prefix positions are visible (``[B, P]`` boolean). This is the torch reference for decode over cached
    chunk KV; the split-S kernel computes the same thing without the concatenation.
    """

    prefix: list[tuple[torch.Tensor, torch.Tensor]]
    prefix_mask: torch.Tensor | None = None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pk, pv = self.prefix[layer]
        kk = torch.cat([pk, k], dim=2)
        vv = torch.cat([pv, v], dim=2)
        mask = None
        if self.prefix_mask is not None:
            local = torch.ones(q.shape[0], k.shape[2], dtype=torch.bool, device=q.device)
            mask = torch.cat([self.prefix_mask, local], dim=1)[:, None, None, :]
        return sdpa(q, kk, vv, mask=mask)


@dataclass
class RecordKV:
    """Wraps a backend and keeps every layer's k/v of this forward (for building KV caches)."""

    inner: AttentionBackend
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer == 0:
            self.keys.clear()
            self.values.clear()
        self.keys.append(k)
        self.values.append(v)
        return self.inner(layer, q, k, v)
