"""Block-causal attention for SDAR (block diffusion): causal across blocks, bidirectional inside a block.

Blocks are fixed by absolute position: token at position p is in block ``p // block_size`` (SDAR's own
generation aligns blocks to position 0, so the prompt's last block is finished by the answer). Because a
block never sees a later one, the K/V of a finished block never change: they are an exact cache, like an
autoregressive model's. :class:`BlockCausalAttention` serves both uses: the full forward (no prefix) and a
forward over the next block(s) given the cached K/V of the earlier ones.

The transformer itself (Qwen3 layout: q/k RMSNorm per head) is :class:`~.transformer.DiffusionLM` with
``config.qk_norm``; this module only decides what each token may see.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import sdpa


def block_causal_mask(
    q_positions: torch.Tensor, k_positions: torch.Tensor | None, block_size: int
) -> torch.Tensor:
    """Boolean ``[B or 1, 1, Tq, Tk]`` mask: query i may attend key j iff block(j) <= block(i).

    ``q_positions`` / ``k_positions`` are absolute positions, ``[Tq]`` or ``[B, Tq]`` (keys: ``[Tk]`` or
    ``[B, Tk]``; None means the keys are the queries). Positions, not indices, decide the block, so the
    same helper masks a full forward and a forward whose earlier blocks come from a cache.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    k_positions = q_positions if k_positions is None else k_positions
    qb = torch.div(q_positions, block_size, rounding_mode="floor")
    kb = torch.div(k_positions, block_size, rounding_mode="floor")
    if qb.dim() == 1:
        qb = qb[None]
    if kb.dim() == 1:
        kb = kb[None]
    return (kb[:, None, None, :] <= qb[:, None, :, None]).contiguous()


@dataclass
class BlockCausalAttention:
    """Block-causal attention over (optionally) cached K/V of earlier tokens plus the forward's own tokens.

    ``positions``: absolute positions of the forward's tokens (``[T]`` or ``[B, T]``). ``prefix[layer] =
    (k, v)``, ``[B, Hkv, P, D]``, with ``prefix_positions`` (``[P]`` or ``[B, P]``): the cache, e.g. the
    finished blocks' K/V recorded by :class:`~.attention.RecordKV` (RoPE is already applied to them, so
    they are reused as is). The mask is built once per forward and shared by every layer.
    """

    positions: torch.Tensor
    block_size: int
    prefix: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    prefix_positions: torch.Tensor | None = None
    mask: torch.Tensor = field(init=False)  # boolean [B or 1, 1, T, P + T]

    def __post_init__(self) -> None:
        if (self.prefix is None) != (self.prefix_positions is None):
            raise ValueError("prefix and prefix_positions go together")
        keys = self.positions
        if self.prefix_positions is not None:
            # [T] means one row of positions for the whole batch: give both sides the same rows to concat.
            pp, qp = (x if x.dim() == 2 else x[None] for x in (self.prefix_positions, self.positions))
            rows = max(pp.shape[0], qp.shape[0])
            keys = torch.cat([pp.expand(rows, -1), qp.expand(rows, -1)], dim=-1)
        self.mask = block_causal_mask(self.positions, keys, self.block_size)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.prefix is not None:
            pk, pv = self.prefix[layer]
            k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
        return sdpa(q, k, v, mask=self.mask)
