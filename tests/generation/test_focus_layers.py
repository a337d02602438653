"""FOCUS's SDAR attention in its reference loop (``tests/reference/focus_layers.SdarRows``): whatever rows a
step forwards, padding them to the window's shape attends exactly as the unpadded block-causal SDPA over those
rows."""

from __future__ import annotations

import pytest
import torch

from pdllm.decode_service.block_diffusion import BlockKVCache, record_span
from pdllm.shared.model.attention import sdpa
from pdllm.shared.model.sdar import block_causal_mask
from tests.reference.focus_layers import SdarRows

from ..model.helpers import tiny_model


@pytest.mark.parametrize("seed", [0, 1, 2])
@torch.inference_mode()
def test_padded_rows_attend_as_the_unpadded_rows(seed: int) -> None:
    model = tiny_model("sdar", seed=seed)
    cfg = model.config
    block = cfg.block_size
    seq = torch.randint(3, cfg.vocab_size - 1, (24,), generator=torch.Generator().manual_seed(seed))
    cache = BlockKVCache(24, block)
    record_span(model, cache, seq, 0, 8)  # two model blocks of earlier context
    positions = torch.arange(8, 24)  # a window of four model blocks
    rows = SdarRows(cache, positions, block)
    g = torch.Generator().manual_seed(seed)
    for n, m in ((16, 16), (5, 9), (1, 3), (11, 16)):
        k_rows = torch.sort(torch.randperm(16, generator=g)[:m]).values
        q_rows = k_rows[torch.sort(torch.randperm(m, generator=g)[: min(n, m)]).values]
        q = torch.randn(1, cfg.num_heads, q_rows.numel(), cfg.head_dim, generator=g)
        k, v = (torch.randn(1, cfg.num_kv_heads, m, cfg.head_dim, generator=g) for _ in range(2))
        for layer in range(cfg.num_layers):
            pk, pv = cache.attention(positions).prefix[layer]
            keys = torch.cat([torch.arange(8), positions[k_rows]])[None]
            mask = block_causal_mask(positions[q_rows], keys, block)
            expected = sdpa(q, torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2), mask=mask)
            got = rows(q_rows, k_rows)(layer, q, k, v)
            assert got.shape == expected.shape
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
