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
from typing import Protocol, cast

import torch
import torch.nn.functional as F

from pdllm.kernels.chunk_prefill_attention import chunk_prefill_attention


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
class VarlenAttention:
    """Row ``b`` of a right-padded batch attends within its first ``lens[b]`` tokens (causally or not) through
    :func:`~pdllm.kernels.chunk_prefill_attention.chunk_prefill_attention` on the packed tokens, instead of a
    padded (and, bidirectionally, masked) SDPA: no FLOPs on padding, and no mask that rules out flash.

    Padding rows get a zero output; nothing reads them (the chunk bank keeps each row's first ``lens[b]``
    tokens, and a later layer's real tokens never see them). Built once per batch: the packing index and
    ``cu_seqlens`` are reused by every layer, so no call syncs the device.
    """

    lens: list[int]
    width: int
    causal: bool
    device: torch.device
    cu_seqlens: torch.Tensor = field(init=False)
    # Flat [B * width] rows of the real tokens (None: no padding, the packed views are the batch as is).
    index: torch.Tensor | None = field(init=False)

    def __post_init__(self) -> None:
        if not self.lens or min(self.lens) <= 0 or max(self.lens) > self.width:
            raise ValueError(f"need 0 < lens <= width={self.width}, got {self.lens}")
        lens = torch.tensor(self.lens, dtype=torch.int32)
        self.cu_seqlens = F.pad(lens.cumsum(0, dtype=torch.int32), (1, 0)).to(self.device)
        self.index = None
        if any(n != self.width for n in self.lens):
            rows = [torch.arange(n) + b * self.width for b, n in enumerate(self.lens)]
            self.index = torch.cat(rows).to(self.device)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, hq, t, d = q.shape
        if (b, t) != (len(self.lens), self.width):
            raise ValueError(f"built for [{len(self.lens)}, *, {self.width}, *], got q {tuple(q.shape)}")
        # [B, H, T, D] views of token-major memory (the model's layout): flattening is free.
        packed = [x.transpose(1, 2).reshape(b * t, x.shape[1], d) for x in (q, k, v)]
        if self.index is not None:
            packed = [x.index_select(0, self.index) for x in packed]
        out = cast(
            torch.Tensor,
            chunk_prefill_attention(*packed, self.cu_seqlens, causal=self.causal, max_seqlen=max(self.lens)),
        )
        if self.index is not None:
            out = q.new_zeros(b * t, hq, d).index_copy_(0, self.index, out)
        return out.view(b, t, hq, d).transpose(1, 2)


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
