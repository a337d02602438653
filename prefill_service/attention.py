"""The attention backend of chunk scoring (batched over chunks).

:class:`BankPrefixAttention` lets a short block of tokens per chunk (query window, pseudo-labels) attend to
that chunk's banked step-3 KV plus itself, batched over chunks of different lengths through a key validity
mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdllm.shared.chunk_prefill import ChunkBank
from pdllm.shared.model.attention import sdpa

# Keys per call padded to a multiple of this (masked): cuDNN's masked attention took 108 instead of 182 µs
# for 16 chunks of 1025 + 28 keys when given 1056 (H100, bf16; benchmarks/results/e2e_notes.md).
KEY_MULTIPLE = 8


@dataclass
class BankPrefixAttention:
    """Rows ``rows`` of the bank as prefix (``prefix_valid[b, j]``: key j visible), local causal or not.

    When the bank has room after its ``p = prefix_valid.shape[1]`` slots (``score_tail``), each layer writes
    the local K/V into slots ``[p, p + t)`` of its rows and attends over the whole row, the slots after the
    local ones masked: no copy of the prefix. Otherwise the prefix, the local K/V and zero keys up to a
    multiple of ``KEY_MULTIPLE`` are concatenated. Either way the keys of a row are a multiple of it."""

    bank: ChunkBank
    rows: slice
    prefix_valid: torch.Tensor
    local_causal: bool
    # The mask is the same at every layer: built at the first, as an additive one (0 / -inf) in the
    # queries' dtype, which the attention kernels take without converting it again at each layer.
    _mask: torch.Tensor | None = field(default=None, init=False, repr=False)
    _pad: torch.Tensor | None = field(default=None, init=False, repr=False)  # zero keys after the local ones

    def keys(self, t: int) -> int:
        """Keys per row: the bank's whole width when it fits the local block, else the padded concatenation."""
        p, width = self.prefix_valid.shape[1], self.bank.kv.shape[4]
        return width if p + t <= width and width % KEY_MULTIPLE == 0 else p + t + -(p + t) % KEY_MULTIPLE

    def mask(self, t: int, dtype: torch.dtype) -> torch.Tensor:
        if self._mask is None or self._mask.shape[-2] != t or self._mask.dtype != dtype:
            local = torch.ones(t, t, dtype=torch.bool, device=self.prefix_valid.device)
            if self.local_causal:
                local = local.tril()
            n, p = self.prefix_valid.shape
            rest = torch.zeros(n, t, self.keys(t) - p - t, dtype=torch.bool, device=local.device)
            visible = torch.cat(
                [self.prefix_valid[:, None, :].expand(-1, t, -1), local[None].expand(n, -1, -1), rest], dim=2
            )
            zero = torch.zeros((), dtype=dtype, device=visible.device)
            self._mask = torch.where(visible, zero, float("-inf"))[:, None]
        return self._mask

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p, t = self.prefix_valid.shape[1], k.shape[2]
        keys = self.keys(t)
        if keys == self.bank.kv.shape[4]:  # in place: the slots after the prefix are free
            kv = self.bank.kv[layer, :, self.rows]
            kv[0, :, :, p : p + t] = k
            kv[1, :, :, p : p + t] = v
            return sdpa(q, kv[0], kv[1], mask=self.mask(t, q.dtype))
        pad = keys - p - t
        if self._pad is None or self._pad.shape[2] != pad or self._pad.dtype != k.dtype:
            self._pad = k.new_zeros(k.shape[0], k.shape[1], pad, k.shape[3])
        kk = torch.cat([self.bank.kv[layer, 0, self.rows, :, :p], k, self._pad], dim=2)
        vv = torch.cat([self.bank.kv[layer, 1, self.rows, :, :p], v, self._pad], dim=2)
        return sdpa(q, kk, vv, mask=self.mask(t, q.dtype))
