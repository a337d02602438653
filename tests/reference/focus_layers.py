"""What FOCUS's reference forwards (``focus.py``) attend to: the block rows' K/V kept across steps, and the
method's attention given which rows query and which rows are keys. (The rounds keep the block's K/V in pool
pages instead: ``decode_service/sdar_focus_rounds.py``.)

A FOCUS step forwards only some rows of the block past layer 1, and skips frozen rows at every layer; the
rows it does not forward are still attended to through the K/V of the last step that forwarded them. So
every request keeps, per layer, the K/V of its block's rows (:class:`BlockKV`: one slot per request, K
after RoPE, like every cache here); a forward writes its fresh rows in and reads the keys in row order.

The method's own attention sees the chosen query rows and key rows (:data:`RowsAttention`): SDAR builds its
block-causal mask over the exact cache of the earlier blocks for exactly those rows (:class:`SdarRows`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdllm.decode_service.block_diffusion import BlockKVCache
from pdllm.shared.model.attention import AttentionBackend, sdpa
from pdllm.shared.model.sdar import block_causal_mask
from pdllm.shared.model.transformer import DiffusionLM

RowsAttention = Callable[[torch.Tensor, torch.Tensor], AttentionBackend]
"""(query rows, key rows), local row indices (ascending, on the model's device) -> the backend a forward's
layers call with those rows' q and k/v."""


class BlockKV:
    """Per layer, keys and values of the block rows of ``slots`` requests, ``[slots, width, Hkv, D]``
    (row-major, so the rows of several requests are written by one ``index_copy_``)."""

    def __init__(self, model: DiffusionLM, slots: int, width: int) -> None:
        cfg = model.config
        p = next(model.parameters())
        shape = (slots, width, cfg.num_kv_heads, cfg.head_dim)
        self.width = width
        self.keys = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.num_layers)]
        self.values = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.num_layers)]

    def write(self, layer: int, flat_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store fresh ``k``/``v`` ``[1, Hkv, n, D]`` (the forward's layout) at ``slot * width + row``."""
        for store, x in ((self.keys[layer], k), (self.values[layer], v)):
            store.view(-1, *store.shape[2:]).index_copy_(0, flat_rows, x[0].transpose(0, 1))

    def block(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot ``slot``'s keys and values as ``[1, Hkv, width, D]`` views (the forward's layout)."""
        return self.keys[layer][slot].transpose(0, 1)[None], self.values[layer][slot].transpose(0, 1)[None]


@dataclass
class _MaskedPrefix:
    """The cached K/V of the earlier blocks, then the given keys, under a boolean mask (as
    ``BlockCausalAttention`` computes it: the same concatenation and SDPA call). ``width``: the query rows
    and the given keys are zero-padded to that many rows, padded keys masked out, padded queries' outputs
    dropped: one shape per window, whatever rows FOCUS forwards. On CUDA, SDPA's cuDNN backend builds a plan per new shape (H100: ~37 ms, against ~60 us
    per call once built), which unpadded FOCUS forwards would meet at nearly every call."""

    prefix: list[tuple[torch.Tensor, torch.Tensor]] | None
    mask: torch.Tensor
    width: int | None = None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = q.shape[2]
        if self.width is not None:
            q = F.pad(q, (0, 0, 0, self.width - n))
            k, v = F.pad(k, (0, 0, 0, self.width - k.shape[2])), F.pad(v, (0, 0, 0, self.width - v.shape[2]))
        if self.prefix is not None:
            pk, pv = self.prefix[layer]
            k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
        return sdpa(q, k, v, mask=self.mask)[:, :, :n]


@dataclass
class SdarRows:
    """SDAR: a window at ``positions`` (``[T]``, absolute) over the exact ``cache`` of the earlier blocks;
    query row i may see key j iff block(j) <= block(i) (a generation block may span several model blocks).
    Built once per step; the earlier blocks' K/V are the cache's own views. Every call attends with the
    window's shape (queries and keys padded to T rows, :class:`_MaskedPrefix`)."""

    cache: BlockKVCache
    positions: torch.Tensor
    block_size: int
    prefix: list[tuple[torch.Tensor, torch.Tensor]] | None = field(init=False)
    prefix_positions: torch.Tensor | None = field(init=False)

    def __post_init__(self) -> None:
        base = self.cache.attention(self.positions)
        self.prefix, self.prefix_positions = base.prefix, base.prefix_positions

    def __call__(self, q_rows: torch.Tensor, k_rows: torch.Tensor) -> AttentionBackend:
        keys = self.positions[k_rows][None]
        if self.prefix_positions is not None:
            keys = torch.cat([self.prefix_positions[None], keys], dim=-1)
        mask = block_causal_mask(self.positions[q_rows], keys, self.block_size)  # [1, 1, n, prefix + m]
        width, n, m = self.positions.numel(), q_rows.numel(), k_rows.numel()
        mask = F.pad(mask, (0, width - m, 0, width - n), value=False)
        return _MaskedPrefix(self.prefix, mask, width)


def keys_in_row_order(
    fresh: torch.Tensor, block: torch.Tensor, before: int, block_fresh: int, visible: int
) -> torch.Tensor:
    """One request's keys (or values) ``[1, Hkv, *, D]`` in local row order: its forwarded rows before the
    block, the block's rows ``[0, visible)`` from the store (``block`` ``[1, Hkv, width, D]``, fresh rows
    already written in), its forwarded rows after the block. ``fresh`` holds the forwarded rows as
    ``[before rows, block_fresh block rows, after rows]``."""
    return torch.cat(
        [fresh[:, :, :before], block[:, :, :visible], fresh[:, :, before + block_fresh :]], dim=2
    )
