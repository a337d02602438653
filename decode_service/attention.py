"""Decode attention over static KV segments plus the step's own tokens, without concatenating segments.

:class:`SegmentedAttention` is the torch split-S: one partial softmax per static segment (an instruction
segment, one per selected chunk) and one over the local tokens, merged by log-sum-exp. Segments stay where
the prefill or KV build left them. (The decode worker's rounds read the static KV from pool pages instead,
``round_attention.py``; the reference loop's other static-KV attentions are ``tests/reference``'s.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
