"""Chunk prefill attention and retention-score references against dense masked attention."""

from __future__ import annotations

import pytest
import torch

from pdllm.kernels.chunk_prefill_attention import chunk_prefill_attention, chunk_prefill_attention_reference
from pdllm.kernels.retention_scores import retention_scores_reference


def _pack(gen: torch.Generator, lens: list[int], hq: int, hkv: int, d: int) -> tuple[torch.Tensor, ...]:
    total = sum(lens)
    q = torch.randn(total, hq, d, generator=gen)
    k = torch.randn(total, hkv, d, generator=gen)
    v = torch.randn(total, hkv, d, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def _dense_probs(q: torch.Tensor, k: torch.Tensor, cu: torch.Tensor, causal: bool) -> torch.Tensor:
    """Softmax over the whole pack with a block-diagonal (optionally causal) mask, float64: [Hq, T, T]."""
    total = q.shape[0]
    seq = torch.repeat_interleave(torch.arange(cu.numel() - 1), (cu[1:] - cu[:-1]).long())
    allowed = seq[:, None] == seq[None, :]
    if causal:
        allowed &= torch.ones(total, total, dtype=torch.bool).tril()
    kk = k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * q.shape[2] ** -0.5
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (7, 1)])
def test_chunk_prefill_matches_dense_block_diagonal(causal: bool, hq: int, hkv: int) -> None:
    gen = torch.Generator().manual_seed(hq * 10 + causal)
    q, k, v, cu = _pack(gen, [5, 17, 1, 9], hq, hkv, 16)
    p = _dense_probs(q, k, cu, causal)
    want = torch.einsum("hqk,khd->qhd", p, v.double().repeat_interleave(hq // hkv, 1))
    ref, lse = chunk_prefill_attention_reference(q, k, v, cu, causal=causal, return_lse=True)
    torch.testing.assert_close(ref.double(), want, rtol=1e-5, atol=1e-5)
    fast = chunk_prefill_attention(q, k, v, cu, causal=causal)
    torch.testing.assert_close(fast.double(), want, rtol=1e-5, atol=1e-5)
    # LSE: exp(s - lse) must reproduce the probabilities of a row.
    kk = k.double().repeat_interleave(hq // hkv, 1)
    s = torch.einsum("hd,khd->hk", q[6].double(), kk[5:22]) * 0.25
    if causal:
        s[:, 2:] = float("-inf")
    torch.testing.assert_close(torch.exp(s - lse[6].double()[:, None]), p[:, 6, 5:22], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_chunk_prefill_equal_lengths_batched_path(causal: bool) -> None:
    gen = torch.Generator().manual_seed(9)
    q, k, v, cu = _pack(gen, [6, 6, 6], 8, 2, 16)
    want = chunk_prefill_attention_reference(q, k, v, cu, causal=causal)
    got = chunk_prefill_attention(q, k, v, cu, causal=causal, max_seqlen=6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_chunk_prefill_errors() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v, cu = _pack(gen, [4], 3, 2, 16)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        chunk_prefill_attention(q, k, v, cu)
    with pytest.raises(ValueError, match="int32"):
        chunk_prefill_attention(q[:, :2], k, v, cu.long())


@pytest.mark.parametrize("causal", [False, True])
def test_retention_reference_matches_dense(causal: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    lens, qlens = [12, 20, 6], [3, 5, 6]
    q, k, _, cu = _pack(gen, lens, 8, 2, 16)
    p = _dense_probs(q, k, cu, causal)
    want = torch.zeros(q.shape[0], dtype=torch.float64)
    for i, lq in enumerate(qlens):
        a, b = int(cu[i]), int(cu[i + 1])
        c = b - a - lq
        for j in range(a, a + c):
            want[j] = p[:, b - lq : b, j].sum() + p[:, j, b - lq : b].sum()
    got = retention_scores_reference(q, k, cu, torch.tensor(qlens, dtype=torch.int32), causal=causal)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    if causal:
        # Chunk tokens cannot see the query: only the query->chunk direction remains, at most Hq*lq each.
        assert float(got.max()) <= 8 * max(qlens)


def test_retention_errors() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, _, cu = _pack(gen, [4], 4, 2, 16)
    with pytest.raises(ValueError, match="query tokens"):
        retention_scores_reference(q, k, cu, torch.tensor([5], dtype=torch.int32))
    with pytest.raises(ValueError, match="query_lens"):
        retention_scores_reference(q, k, cu, torch.tensor([1, 1], dtype=torch.int32))
