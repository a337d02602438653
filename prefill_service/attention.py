"""Attention backends of the fast prefill path (batched over chunks).

:class:`WriteKV` copies each layer's chunk K/V into the :class:`ChunkBank` while the batched chunk prefill
runs; :class:`BankPrefixAttention` lets a short block of tokens per chunk (query window, pseudo-labels)
attend to that chunk's banked KV plus itself, batched over chunks of different lengths through a key
validity mask; :class:`RetentionProbe` computes the top-B retention mass during the KV build forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdllm.shared.model.attention import AttentionBackend, sdpa


@dataclass
class ChunkBank:
    """Step-3 KV of N chunks, padded: ``kv[layer, 0|1, chunk, head, token, dim]``; ``lens[chunk]`` tokens."""

    kv: torch.Tensor
    lens: list[int]

    def segment(self, i: int) -> torch.Tensor:
        """Chunk ``i`` in the chunk-KV layout ``[layers, 2, Hkv, T, D]`` (a view)."""
        return self.kv[:, :, i, :, : self.lens[i]]

    def take(self, rows: list[int]) -> ChunkBank:
        """A bank of ``rows`` in that order: a view when they are a run, else a copy."""
        if rows and rows == list(range(rows[0], rows[0] + len(rows))):
            return ChunkBank(self.kv[:, :, rows[0] : rows[0] + len(rows)], [self.lens[i] for i in rows])
        index = torch.tensor(rows, dtype=torch.long, device=self.kv.device)
        return ChunkBank(self.kv.index_select(2, index), [self.lens[i] for i in rows])


@dataclass
class WriteKV:
    inner: AttentionBackend
    bank: ChunkBank
    rows: slice

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = k.shape[2]
        self.bank.kv[layer, 0, self.rows, :, :t] = k
        self.bank.kv[layer, 1, self.rows, :, :t] = v
        return self.inner(layer, q, k, v)


@dataclass
class BankPrefixAttention:
    """Rows ``rows`` of the bank as prefix (``prefix_valid[b, j]``: key j visible), local causal or not."""

    bank: ChunkBank
    rows: slice
    prefix_valid: torch.Tensor
    local_causal: bool

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.prefix_valid.shape[1]
        kk = torch.cat([self.bank.kv[layer, 0, self.rows, :, :p], k], dim=2)
        vv = torch.cat([self.bank.kv[layer, 1, self.rows, :, :p], v], dim=2)
        t = q.shape[2]
        local = torch.ones(t, t, dtype=torch.bool, device=q.device)
        if self.local_causal:
            local = local.tril()
        mask = torch.cat(
            [self.prefix_valid[:, None, :].expand(-1, t, -1), local[None].expand(q.shape[0], -1, -1)], dim=2
        )
        return sdpa(q, kk, vv, mask=mask[:, None])


@dataclass
class RetentionProbe:
    """Bidirectional dense attention that also sums, per key position, the query<->key softmax mass.

    ``mass[j] += sum_h sum_{k in query} A[k, j] (+ A[j, k] when both directions)``, over layers and query
    heads; full-row softmax normalisation, computed ``block`` rows at a time so the full T x T matrix of a
    long build never exists at once.
    """

    query: slice
    both: bool
    block: int
    mass: torch.Tensor

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        g = q.shape[1] // k.shape[1]
        kr = k[0].repeat_interleave(g, dim=0).float()
        scale = q.shape[-1] ** -0.5
        qf = q[0].float()
        rows = torch.softmax((qf[:, self.query] @ kr.transpose(1, 2)) * scale, dim=-1)
        self.mass += rows.sum(dim=(0, 1)).to(self.mass.dtype)
        if self.both:
            kq = kr[:, self.query]
            for a in range(0, q.shape[2], self.block):
                logits = (qf[:, a : a + self.block] @ kr.transpose(1, 2)) * scale
                lse = torch.logsumexp(logits, dim=-1, keepdim=True)
                to_query = torch.exp((qf[:, a : a + self.block] @ kq.transpose(1, 2)) * scale - lse)
                self.mass[a : a + self.block] += to_query.sum(dim=(0, 2)).to(self.mass.dtype)
        return sdpa(q, k, v)
