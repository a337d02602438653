"""Split-S reference (the kernel's algorithm in torch) against naive softmax(QK^T)V on gathered KV."""

from __future__ import annotations

import pytest
import torch

from pdllm.kernels.split_s_attention import (
    SplitSConfig,
    naive_attention,
    plan_splits,
    split_s_attention_reference,
)

from .helpers import make_problem


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("page_size", [8, 16, 64])
def test_reference_matches_naive_random_ragged(group: int, page_size: int) -> None:
    gen = torch.Generator().manual_seed(100 * group + page_size)
    batch = 3
    q_lens = torch.randint(1, 12, (batch,), generator=gen).tolist()
    n_chunks = torch.randint(1, 17, (batch,), generator=gen).tolist()
    chunk_lens = [torch.randint(1, 40, (s,), generator=gen).tolist() for s in n_chunks]
    p = make_problem(gen, q_lens, chunk_lens, hkv=2, group=group, head_dim=16, page_size=page_size)
    want = naive_attention(*p.args())
    for n_splits in (None, 1, 3, 16):
        cfg = SplitSConfig(block_m=16, block_n=16, num_splits=n_splits)
        got = split_s_attention_reference(*p.args(), config=cfg)
        assert _rel(got, want) < 1e-5, n_splits


@pytest.mark.parametrize("n_chunks", [1, 2, 5, 16])
def test_chunk_count_and_empty_local(n_chunks: int) -> None:
    gen = torch.Generator().manual_seed(n_chunks)
    chunk_lens = [[int(x) for x in torch.randint(1, 30, (n_chunks,), generator=gen)] for _ in range(2)]
    p = make_problem(gen, [4, 9], chunk_lens, hkv=1, group=4, head_dim=32, page_size=16, local=False)
    got = split_s_attention_reference(*p.args(), config=SplitSConfig(block_n=16, num_splits=4))
    assert _rel(got, naive_attention(*p.args())) < 1e-5


def test_split_with_a_single_token() -> None:
    gen = torch.Generator().manual_seed(7)
    # 32 paged slots + 1 local token = 33 keys; splits of 16 leave one token in the last split.
    p = make_problem(gen, [1], [[16, 16]], hkv=1, group=2, head_dim=16, page_size=16)
    cfg = SplitSConfig(block_n=16, num_splits=3)
    plan = plan_splits(33, 1, 1, 2, cfg, 1)
    assert (plan.num_splits, plan.split_size) == (3, 16)
    assert _rel(split_s_attention_reference(*p.args(), config=cfg), naive_attention(*p.args())) < 1e-5


def test_holes_in_partial_pages_are_masked() -> None:
    gen = torch.Generator().manual_seed(3)
    p = make_problem(gen, [3], [[5, 9, 1]], hkv=2, group=2, head_dim=16, page_size=8, local=False)
    assert p.page_fill.tolist() == [[5, 8, 1, 1]]
    want = naive_attention(*p.args())
    got = split_s_attention_reference(*p.args(), config=SplitSConfig(block_n=16, num_splits=2))
    assert _rel(got, want) < 1e-5
    # Garbage in the holes must not leak in: poison them and expect the same answer.
    p.k_pages.view(-1)[:] = torch.where(p.k_pages.view(-1) == 0, 1e4, p.k_pages.view(-1))
    assert _rel(split_s_attention_reference(*p.args(), config=SplitSConfig(block_n=16)), want) < 1e-5


def test_request_without_queries_and_scale() -> None:
    gen = torch.Generator().manual_seed(11)
    p = make_problem(gen, [2, 0, 3], [[7], [4], [20]], hkv=1, group=3, head_dim=16, page_size=8)
    for scale in (None, 0.05):
        want = naive_attention(*p.args(), scale=scale)
        got = split_s_attention_reference(*p.args(), scale=scale, config=SplitSConfig(block_n=16))
        assert _rel(got, want) < 1e-5


def test_plan_follows_the_wave_model() -> None:
    cfg = SplitSConfig(block_m=64, block_n=64)
    # Batch 1 (16 programs per split): many splits, all in one wave of 264 slots.
    small = plan_splits(4128, batch=1, num_kv_heads=4, max_rows=224, config=cfg, num_sms=132)
    assert (small.m_blocks, small.num_splits, small.split_size) == (4, 13, 320)
    # 128 programs per split: two splits fill one wave; three would need two waves.
    assert plan_splits(8224, 8, 4, 224, cfg, 132).num_splits == 2
    # Enough programs already: no split, no partials.
    assert plan_splits(4128, 32, 4, 224, cfg, 132).num_splits == 1
    # Never below min_split_tokens, and a forced count is honoured (after rounding to blocks).
    assert plan_splits(300, 1, 1, 16, cfg, 132).num_splits == 2
    forced = plan_splits(33, 1, 1, 2, SplitSConfig(block_n=16, num_splits=3), 1)
    assert (forced.num_splits, forced.split_size) == (3, 16)


def test_bad_inputs_raise_clear_errors() -> None:
    gen = torch.Generator().manual_seed(0)
    p = make_problem(gen, [2], [[8]], hkv=2, group=2, head_dim=16, page_size=8)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        naive_attention(p.q[:, :3], *p.args()[1:])
    with pytest.raises(ValueError, match="int32"):
        split_s_attention_reference(p.q, p.k_pages, p.v_pages, p.page_table.long(), *p.args()[4:])
    with pytest.raises(ValueError, match="both be given"):
        split_s_attention_reference(*p.args()[:6], p.k_local, None)
    with pytest.raises(ValueError, match="dtype mismatch"):
        split_s_attention_reference(p.q.double(), *p.args()[1:])
    with pytest.raises(ValueError, match="head dim"):
        split_s_attention_reference(p.q[..., :12], p.k_pages[..., :12], p.v_pages[..., :12], *p.args()[3:6])
    with pytest.raises(ValueError, match="num_splits"):
        SplitSConfig(num_splits=0)


def test_request_without_paged_kv_sees_only_its_local_tokens() -> None:
    gen = torch.Generator().manual_seed(12)
    p = make_problem(gen, [3, 2], [[20], []], hkv=2, group=2, head_dim=16, page_size=8)
    assert p.kv_lens.tolist() == [24, 0]
    want = naive_attention(*p.args())
    got = split_s_attention_reference(*p.args(), config=SplitSConfig(block_n=16, num_splits=2))
    assert _rel(got, want) < 1e-5
    # Request 1 by hand: its 2 queries over its 2 local tokens, GQA head h*2+j -> KV head h.
    q, k, v = p.q[3:5].double(), p.k_local[3:5].double(), p.v_local[3:5].double()
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)  # [2 tokens, Hq, D]
    att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * 16**-0.5, -1)
    assert _rel(want[3:5], torch.einsum("hqk,khd->qhd", att, v)) < 1e-6


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"block_m": 24}, "power of two"),
        ({"block_n": 512}, "<= 256"),
        ({"num_warps": 3}, "num_warps"),
        ({"num_stages": 0}, "num_stages"),
        ({"programs_per_sm": 0.0}, "programs_per_sm"),
        ({"partial_cost": -0.1}, "partial_cost"),
        ({"min_split_tokens": 0}, "min_split_tokens"),
    ],
)
def test_config_validation(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SplitSConfig(**bad)
