"""Decode attention over static KV segments plus the step's own tokens, without concatenating segments.

:class:`SegmentedAttention` is the torch split-S: one partial softmax per static segment (an instruction
segment, one per selected chunk) and one over the local tokens, merged by log-sum-exp. Segments stay where
the prefill or KV build left them. :class:`BufferedAttention` is the alternative for a static prefix that
one build forward produced contiguously: the local K/V are written into the tail of a preallocated buffer
and one SDPA call (FlashAttention on CUDA) covers both; no per-step concatenation either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdllm.shared.model.attention import sdpa


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of grouped queries ``[B, Hkv, G*T, D]`` over ``k, v [B, Hkv, L, D]``: (out fp32, lse fp32)."""
    logits = (q @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    return torch.exp(logits - lse) @ v.float(), lse


@dataclass
class SegmentedAttention:
    """``segments[s]``: ``[layers, 2, Hkv, L_s, D]`` static KV; every query sees all of them and itself."""

    segments: list[torch.Tensor]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, hq, t, d = q.shape
        hkv = k.shape[1]
        qg = q.reshape(b, hkv, (hq // hkv) * t, d).float()
        parts = [
            _partial(qg, seg[layer, 0][None], seg[layer, 1][None]) for seg in self.segments if seg.shape[3]
        ]
        parts.append(_partial(qg, k, v))
        lse = torch.stack([p[1] for p in parts])
        weights = torch.exp(lse - torch.logsumexp(lse, dim=0))
        out = sum(w * p[0] for w, p in zip(weights, parts, strict=True))
        return out.reshape(b, hq, t, d).to(q.dtype)


class BufferedAttention:
    """Static KV ``[layers, 2, Hkv, S, D]`` copied once into a buffer with room for ``local`` tokens."""

    def __init__(self, static: torch.Tensor, local: int) -> None:
        layers, _, hkv, s, d = static.shape
        self.static_len = s
        self.buffer = torch.empty(layers, 2, 1, hkv, s + local, d, dtype=static.dtype, device=static.device)
        self.buffer[:, :, 0, :, :s] = static

    def load(self, static: torch.Tensor) -> None:
        """Replace the static KV in place (same shape), keeping the buffer's address for graph replay."""
        if static.shape[3] != self.static_len:
            raise ValueError(f"static KV has {static.shape[3]} tokens, the buffer holds {self.static_len}")
        self.buffer[:, :, 0, :, : self.static_len] = static

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        end = self.static_len + k.shape[2]
        self.buffer[layer, 0, :, :, self.static_len : end] = k
        self.buffer[layer, 1, :, :, self.static_len : end] = v
        return sdpa(q, self.buffer[layer, 0, :, :, :end], self.buffer[layer, 1, :, :, :end])


class PagedSplitSAttention:
    """The kernels helper's Triton split-S kernel over the static KV laid out once as pages.

    The static prefix is copied once into ``page_size`` pages (one request, pages in order); every layer
    call then reads it straight from the pages plus the step's local K/V, with all sizes fixed on the host
    so the call can be captured in a CUDA graph.
    """

    def __init__(self, static: torch.Tensor, page_size: int = 64) -> None:
        from pdllm.kernels.split_s_attention import split_s_attention

        self._kernel = split_s_attention
        layers, _, hkv, s, d = static.shape
        pages = max(1, -(-s // page_size))
        self.page_size = page_size
        self.pages = torch.zeros(
            layers, 2, pages, hkv, page_size, d, dtype=static.dtype, device=static.device
        )
        self.static_len = s
        self.load(static)
        device = static.device
        self.page_table = torch.arange(pages, dtype=torch.int32, device=device)[None]
        self.kv_lens = torch.tensor([s], dtype=torch.int32, device=device)
        self._offsets: dict[int, torch.Tensor] = {}

    def load(self, static: torch.Tensor) -> None:
        """Write ``static`` into the pages in place (same token count)."""
        layers, _, hkv, s, d = static.shape
        if s != self.static_len:
            raise ValueError(f"static KV has {s} tokens, the pages hold {self.static_len}")
        pages = self.pages.shape[2]
        padded = torch.zeros(
            layers, 2, hkv, pages * self.page_size, d, dtype=static.dtype, device=static.device
        )
        padded[:, :, :, :s] = static
        self.pages.copy_(padded.view(layers, 2, hkv, pages, self.page_size, d).permute(0, 1, 3, 2, 4, 5))

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = q.shape[2]
        offsets = self._offsets.get(t)
        if offsets is None:
            offsets = torch.tensor([0, t], dtype=torch.int32, device=q.device)
            self._offsets[t] = offsets
        out = self._kernel(
            q[0].transpose(0, 1),
            self.pages[layer, 0],
            self.pages[layer, 1],
            self.page_table,
            self.kv_lens,
            offsets,
            k_local=k[0].transpose(0, 1),  # strided views: the kernel takes row strides, no copy
            v_local=v[0].transpose(0, 1),
            max_q_len=t,
            max_kv_len=self.static_len,
        )
        return out.transpose(0, 1)[None]
