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
    """Rows ``rows`` of the bank as prefix (``prefix_valid[b, j]``: key j visible), local causal or not."""

    bank: ChunkBank
    rows: slice
    prefix_valid: torch.Tensor
    local_causal: bool
    # The mask is the same at every layer: built at the first, as an additive one (0 / -inf) in the
    # queries' dtype, which the attention kernels take without converting it again at each layer.
    _mask: torch.Tensor | None = field(default=None, init=False, repr=False)
    _pad: torch.Tensor | None = field(default=None, init=False, repr=False)  # zero keys after the local ones

    def mask(self, t: int, dtype: torch.dtype) -> torch.Tensor:
        if self._mask is None or self._mask.shape[-2] != t or self._mask.dtype != dtype:
            local = torch.ones(t, t, dtype=torch.bool, device=self.prefix_valid.device)
            if self.local_causal:
                local = local.tril()
            n, p = self.prefix_valid.shape
            pad = torch.zeros(n, t, -(p + t) % KEY_MULTIPLE, dtype=torch.bool, device=local.device)
            visible = torch.cat(
                [self.prefix_valid[:, None, :].expand(-1, t, -1), local[None].expand(n, -1, -1), pad], dim=2
            )
            zero = torch.zeros((), dtype=dtype, device=visible.device)
            self._mask = torch.where(visible, zero, float("-inf"))[:, None]
        return self._mask

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.prefix_valid.shape[1]
        pad = -(p + k.shape[2]) % KEY_MULTIPLE
        if self._pad is None or self._pad.shape[2] != pad or self._pad.dtype != k.dtype:
            self._pad = k.new_zeros(k.shape[0], k.shape[1], pad, k.shape[3])
        kk = torch.cat([self.bank.kv[layer, 0, self.rows, :, :p], k, self._pad], dim=2)
        vv = torch.cat([self.bank.kv[layer, 1, self.rows, :, :p], v, self._pad], dim=2)
        return sdpa(q, kk, vv, mask=self.mask(q.shape[2], q.dtype))
