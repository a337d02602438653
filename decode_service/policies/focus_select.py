"""FOCUS's importance delta and selection (``focus.py``: Eq. 2-5, Algorithm 1 lines 7-18) for many
requests at once, as tensor ops over their blocks padded to one width: the decode worker's rounds select
every FOCUS request of a round with one call and one host read (``decode_service/sdar_focus_rounds.py``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .focus import FocusConfig


def importance_batched(
    q: torch.Tensor, k: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor, kernel: int
) -> torch.Tensor:
    """Eq. 2 for ``R`` padded blocks: ``q`` ``[R, Hq, W, D]``, ``k`` ``[R, Hkv, W, D]``; ``queries`` /
    ``keys`` ``[R, W]`` mark the real query / key rows. ``[R, W]`` float64 (padded keys: 0)."""
    r, heads, w, dim = q.shape
    keys_d = k.double().repeat_interleave(heads // k.shape[1], dim=1)
    scores = q.double() @ keys_d.transpose(-1, -2) / math.sqrt(dim)  # [R, Hq, W, W]
    outside = ~keys[:, None, None, :]
    scores = scores.masked_fill(outside, float("-inf"))  # a real key never pools a padded one
    if kernel > 1:
        scores = F.max_pool1d(scores.reshape(-1, 1, w), kernel, 1, kernel // 2).reshape(scores.shape)
        scores = scores.masked_fill(outside, float("-inf"))  # nor does a padded key pool a real one
    weights = torch.softmax(scores, dim=-1) * queries[:, None, :, None]
    return weights.sum(dim=(1, 2))


def select_batched(
    delta: torch.Tensor,
    masked: torch.Tensor,
    frozen: torch.Tensor,
    valid: torch.Tensor,
    reach: torch.Tensor,
    k_hist: torch.Tensor,
    quota: torch.Tensor,
    config: FocusConfig,
    block_length: int,
) -> torch.Tensor:
    """Algorithm 1 lines 7-18 for ``R`` padded blocks (``[R, W]``; ``reach`` / ``k_hist`` / ``quota``
    ``[R]``, quota 0 where none): the rows forwarded past layer 1, ``[R, W]`` bool. K: Eq. 4, the fixed
    ``budget``, or ``ceil(f x valid rows)`` under ``replay_retained_frac`` f; then raised to the quota."""
    count = valid.sum(-1, keepdim=True).to(delta.dtype)
    d = delta.masked_fill(~valid, 0.0)
    mean = d.sum(-1, keepdim=True) / count
    sigma = (((d - mean) * valid) ** 2).sum(-1, keepdim=True).div(count).sqrt()
    n_sigma = (masked & (delta >= sigma)).sum(-1)  # Eq. 5
    if config.replay_retained_frac is not None:  # ceil(f x block rows), as ``replay_ceil`` rounds it
        k = (count.squeeze(-1) * config.replay_retained_frac - 1e-9).ceil().clamp(min=1).to(n_sigma.dtype)
    elif config.budget is not None:
        k = torch.full_like(n_sigma, config.budget)
    else:
        k = torch.clamp(torch.maximum(k_hist, n_sigma), max=block_length)  # Eq. 4
    k = torch.maximum(k, quota)
    rows = torch.arange(delta.shape[1], device=delta.device).expand_as(delta)
    key = delta.masked_fill(~masked, float("-inf"))
    # A stable descending sort ranks ties by row, as the reference's (-dI, row) order does.
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, rows)
    top = masked & (rank < k[:, None])
    chosen = top | F.pad(top[:, 1:], (0, 1))  # AR-context preservation: row j when j + 1 is on top
    last = torch.where(chosen, rows, -1).max(-1, keepdim=True).values
    placeholders = masked & (rows >= reach[:, None]) & (rows < last)
    return chosen | placeholders | (valid & ~masked & ~frozen)
