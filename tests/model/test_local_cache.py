"""The local-row KV cache backend: a partial forward against a cache of the same tokens is the full forward."""

from __future__ import annotations

import pytest
import torch

from pdllm.decode_service.local_cache import LocalCacheAttention, LocalKVCache
from pdllm.shared.model.attention import DenseAttention

from .helpers import tiny_model

TOKENS = torch.tensor([[1, 17, 33, 8, 61, 5, 40, 22, 9, 70, 11, 3]])
N = TOKENS.shape[1]


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize(("lo", "hi"), [(4, 8), (0, 3), (7, N)])
@torch.inference_mode()
def test_partial_forward_over_unchanged_cache_is_the_full_forward(family: str, lo: int, hi: int) -> None:
    model = tiny_model(family)
    positions = torch.arange(N)[None]
    cache = LocalKVCache()
    full = model(TOKENS, positions, LocalCacheAttention(DenseAttention(), cache, 0, N, record=True))
    torch.testing.assert_close(full, model(TOKENS, positions), rtol=0, atol=0)  # recording changes nothing
    assert cache.rows == N and len(cache.keys) == model.config.num_layers
    part = model(TOKENS[:, lo:hi], positions[:, lo:hi], LocalCacheAttention(DenseAttention(), cache, lo, hi))
    # Row j of the partial forward is token lo + j; Dream's first row reads its own state (no row before).
    first = 1 if model.config.shift_logits and lo > 0 else 0
    torch.testing.assert_close(part[:, first:], full[:, lo + first : hi], rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_visible_rows_equal_a_masked_dense_forward() -> None:
    # One layer: the cache is recorded unmasked, so a masked reference agrees with it at layer 0 only.
    model = tiny_model("llada", num_layers=1)
    positions = torch.arange(N)[None]
    cache = LocalKVCache()
    model(TOKENS, positions, LocalCacheAttention(DenseAttention(), cache, 0, N, record=True))
    keep = torch.tensor([0, 2, 3, 5, 6, 7, 8, 11])  # rows 5..8 are forwarded and must stay visible
    backend = LocalCacheAttention(DenseAttention(), cache, 5, 9, visible=[keep])
    got = model(TOKENS[:, 5:9], positions[:, 5:9], backend)
    mask = torch.zeros(N, N, dtype=torch.bool)
    mask[:, keep] = True
    want = model(TOKENS, positions, DenseAttention(mask=mask[None, None]))[:, 5:9]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_partial_forward_needs_a_refresh_first() -> None:
    backend = LocalCacheAttention(DenseAttention(), LocalKVCache(), 2, 4)
    q = torch.zeros(1, 4, 2, 16)
    with pytest.raises(RuntimeError, match="refreshed local KV cache first"):
        backend(0, q, q[:, :2], q[:, :2])


@pytest.mark.parametrize("family", ["dream", "llada"])
@torch.inference_mode()
def test_evicting_cache_equals_a_masked_dense_forward(family: str) -> None:
    """A cache that holds some rows: the partial forward sees those (the ones it forwards replaced by its
    own) and its own rows. One layer, so the cached K/V are what a fresh forward computes."""
    model = tiny_model(family, num_layers=1)
    positions = torch.arange(N)[None]
    held = torch.tensor([0, 2, 4, 5, 9, 11])  # row 4 is forwarded below: its fresh K/V replace the cached
    cache = LocalKVCache()
    keep = lambda layer, q, k: held  # noqa: E731
    model(TOKENS, positions, LocalCacheAttention(DenseAttention(), cache, 0, N, record=True, keep=keep))
    assert cache.rows == len(held) and cache.held[0].tolist() == held.tolist()
    assert cache.split(0, 4, 8) == (2, 4)
    got = model(TOKENS[:, 4:8], positions[:, 4:8], LocalCacheAttention(DenseAttention(), cache, 4, 8))
    mask = torch.zeros(N, N, dtype=torch.bool)
    mask[:, [0, 2, 4, 5, 6, 7, 9, 11]] = True
    want = model(TOKENS, positions, DenseAttention(mask=mask[None, None]))[:, 4:8]
    first = 1 if model.config.shift_logits else 0  # Dream's first row would read row 3's state
    torch.testing.assert_close(got[:, first:], want[:, first:], rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_cache_holding_every_row_is_the_full_cache() -> None:
    """Holding all rows through ``keep`` gives bit for bit the K/V of a cache that holds every row."""
    model = tiny_model("dream")
    positions = torch.arange(N)[None]
    full, every = LocalKVCache(), LocalKVCache()
    model(TOKENS, positions, LocalCacheAttention(DenseAttention(), full, 0, N, record=True))
    keep = lambda layer, q, k: torch.arange(N)  # noqa: E731
    model(TOKENS, positions, LocalCacheAttention(DenseAttention(), every, 0, N, record=True, keep=keep))
    a = model(TOKENS[:, 3:7], positions[:, 3:7], LocalCacheAttention(DenseAttention(), full, 3, 7))
    b = model(TOKENS[:, 3:7], positions[:, 3:7], LocalCacheAttention(DenseAttention(), every, 3, 7))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
