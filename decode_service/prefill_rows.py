"""A chunk-prefill forward carried in a decode round: the all-in-one's prefill and decode in one forward.

The prefill worker hands its chunk forwards over (:class:`~pdllm.shared.chunk_prefill.ChunkForward`); the
scheduler packs the next one after a round's rows, so the GEMMs read the weights once for both (a decode
round alone re-reads all of them for a few hundred rows). The chunk rows sit at positions 0..T-1 of their
chunk and attend within it (``kernels/chunk_prefill_attention``, causal or not); every layer stores their
K/V into the chunk bank as the piece's own forward would. The LM head never sees them.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from pdllm.kernels.chunk_prefill_attention import chunk_prefill_attention
from pdllm.shared.chunk_prefill import ChunkForward
from pdllm.shared.generation.device_sampler import to_device


@dataclass
class PrefillRows:
    """The packed rows ``[start, start + len(ids))`` of a chunk forward: ``bank_rows`` / ``bank_slots``
    (chunk row of the bank, token in it) of each, the chunks' ``cu_seqlens`` over them."""

    start: int
    ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    max_len: int
    causal: bool
    bank_kv: torch.Tensor  # [layers, 2, chunks, Hkv, width, D]
    bank_rows: torch.Tensor
    bank_slots: torch.Tensor

    @classmethod
    def of(cls, work: ChunkForward, start: int, device: torch.device) -> PrefillRows:
        lens = [work.bank.lens[i] for i in work.group]
        ids = [t for i in work.group for t in work.chunks[i]]
        positions = [p for n in lens for p in range(n)]
        rows = [i for i, n in zip(work.group, lens, strict=True) for _ in range(n)]
        t = len(ids)
        longs = to_device([*ids, *positions, *rows, *positions], torch.long, device)
        cu = to_device([0, *accumulate(lens)], torch.int32, device)
        return cls(
            start,
            longs[:t],
            longs[t : 2 * t],
            cu,
            max(lens),
            work.causal,
            work.bank.kv,
            longs[2 * t : 3 * t],
            longs[3 * t :],
        )

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store layer ``layer``'s K/V ``[P, Hkv, D]`` of the rows into the bank; their attention ``[P, Hq, D]``."""
        self.bank_kv[layer, 0][self.bank_rows, :, self.bank_slots] = k
        self.bank_kv[layer, 1][self.bank_rows, :, self.bank_slots] = v
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = chunk_prefill_attention(q, k, v, self.cu_seqlens, causal=self.causal, max_seqlen=self.max_len)
        assert isinstance(out, torch.Tensor)
        return out
