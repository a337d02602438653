"""Sparse-dLLM on the vanilla path, tiny fp32 Dream and LLaDA models.

Exact identities (derived in ``policies/sparse_dllm.py``): retention 1 keeps every row outside the block,
so the cache is the dual cache's; with no delay that *is* the dual cache, with the paper's one-step delay it
is the dual cache refreshed at each block's first two steps. Every step full (refresh every step, or at
most delay + 1 steps per block) is plain decoding. The selection is held to a from-scratch computation of
the paper's equations, and the one-step-late rule to the K/V and queries of each block's second step.
"""

from __future__ import annotations

import math

import pytest
import torch

from pdllm.decode_service.local_cache import LocalCacheAttention, LocalKVCache
from pdllm.decode_service.policies import (
    DecodePolicyConfig,
    SaliencyKeep,
    SparseDLLM,
    StepContext,
    StepPlan,
)
from pdllm.decode_service.policies.sparse_dllm import saliency
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.model.attention import DenseAttention
from pdllm.shared.settings import SettingError
from tests.reference.policy import PolicyLogits, denoise_with_policy
from tests.reference.vanilla import generate_vanilla

from ..model.helpers import tiny_model

PROMPT = [1, 17, 33, 8, 61, 5, 40, 22, 9, 70, 11, 3, 58]
# (gen_length, steps, block_length, threshold)
SCHEDULES = [(16, 16, 4, None), (16, 8, 8, None), (12, 12, 6, 0.15), (16, 16, 4, 0.2)]


def _gen(gen: int, steps: int, block: int | None, threshold: float | None) -> GenerationConfig:
    return GenerationConfig(
        gen_length=gen, steps=steps, block_length=block, threshold=threshold, stop_at_eos=False
    )


def _sparse(**kwargs) -> DecodePolicyConfig:  # type: ignore[no-untyped-def]
    return DecodePolicyConfig("sparse-dllm", **kwargs)


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
def test_refresh_every_step_is_plain_decoding(family: str, schedule: tuple) -> None:
    model, gen = tiny_model(family), _gen(*schedule)
    plain = generate_vanilla(model, PROMPT, gen)
    sparse = generate_vanilla(model, PROMPT, gen, policy=_sparse(refresh_steps=1, retention=0.3))
    assert sparse.raw_tokens == plain.raw_tokens and sparse.steps == plain.steps


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize(("steps", "delay"), [(8, 1), (12, 2), (4, 0)])
def test_at_most_delay_plus_one_steps_per_block_is_plain_decoding(
    family: str, steps: int, delay: int
) -> None:
    model, gen = tiny_model(family, seed=2), _gen(16, steps, 4, None)
    sparse = generate_vanilla(model, PROMPT, gen, policy=_sparse(delay_steps=delay, retention=0.2))
    assert sparse.raw_tokens == generate_vanilla(model, PROMPT, gen).raw_tokens


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_full_retention_without_delay_is_dual_cache(family: str, schedule: tuple, seed: int) -> None:
    model, gen = tiny_model(family, seed=seed), _gen(*schedule)
    dual = generate_vanilla(model, PROMPT, gen, policy=DecodePolicyConfig("dual-cache"))
    for kernel in (1, 5):  # pooling cannot matter when every candidate is kept
        policy = _sparse(retention=1.0, delay_steps=0, pool_kernel=kernel)
        sparse = generate_vanilla(model, PROMPT, gen, policy=policy)
        assert sparse.raw_tokens == dual.raw_tokens
        assert sparse.cache["rows_forwarded"] == dual.cache["rows_forwarded"]
        assert sparse.cache["refreshes"] == dual.cache["refreshes"]


class _DualRefreshedTwice:
    """The dual cache, refreshed at each block's first *two* steps."""

    name = "dual-twice"

    def plan(self, ctx: StepContext) -> StepPlan:
        if ctx.step_in_block < 2:
            return StepPlan.full(ctx)
        return StepPlan(refresh=False, lo=ctx.block_start - ctx.lead, hi=ctx.block_end)


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
def test_full_retention_with_the_delay_is_dual_cache_taken_at_the_second_step(
    family: str, schedule: tuple
) -> None:
    model, gen = tiny_model(family, seed=4), _gen(*schedule)
    local = torch.tensor(PROMPT + [model.config.mask_token_id] * gen.gen_length)
    positions = torch.arange(local.numel())[None]
    run = lambda policy: denoise_with_policy(  # noqa: E731
        model, local.clone(), positions, len(PROMPT), gen, policy, DenseAttention()
    )
    assert run(SparseDLLM(retention=1.0)).raw_tokens == run(_DualRefreshedTwice()).raw_tokens


def _from_scratch(q: torch.Tensor, k: torch.Tensor, start: int, end: int, r: float, s: int) -> list[int]:
    """The paper's equations with Python loops in float64: A = Q_b K_f^T / sqrt(d) per query head (GQA:
    head h reads KV head h // group), averaged over the block's queries and the heads, max-pooled over
    windows of s candidates clipped at the ends, then the top floor(|I| r), earlier rows first on ties."""
    q, k = q[0].double(), k[0].double()
    heads, kv_heads, dim, n = q.shape[0], k.shape[0], q.shape[2], k.shape[1]
    candidates = [j for j in range(n) if not start <= j < end]
    scores = []
    for j in candidates:
        total = 0.0
        for h in range(heads):
            for i in range(start, end):
                total += float(q[h, i] @ k[h // (heads // kv_heads), j]) / math.sqrt(dim)
        scores.append(total / (heads * (end - start)))
    m = len(scores)
    pooled = [max(scores[max(0, c - s // 2) : c + s // 2 + 1]) for c in range(m)]
    order = sorted(range(m), key=lambda c: (-pooled[c], c))[: int(m * r)]
    return sorted(candidates[c] for c in order)


@pytest.mark.parametrize("retention", [0.5, 0.3, 1.0, 0.05])
@pytest.mark.parametrize("kernel", [1, 3, 5])
@pytest.mark.parametrize(("start", "end"), [(8, 12), (0, 4), (16, 20), (13, 17)])
def test_saliency_selection_matches_the_papers_equations(
    retention: float, kernel: int, start: int, end: int
) -> None:
    gen = torch.Generator().manual_seed(start * 100 + kernel)
    q, k = torch.randn(1, 4, 20, 16, generator=gen), torch.randn(1, 2, 20, 16, generator=gen)
    got = SaliencyKeep(start, end, retention, kernel)(0, q, k)
    assert got.tolist() == _from_scratch(q, k, start, end, retention, kernel)
    assert got.dtype == torch.long and len(got) == int(16 * retention)


def test_pooled_ties_go_to_the_earlier_row() -> None:
    # One salient key: pooling gives it and its two neighbours the same score; keeping 2 keeps the earlier.
    q = torch.zeros(1, 1, 8, 4)
    q[0, 0, 6:8, 0] = 1.0
    k = torch.zeros(1, 1, 8, 4)
    k[0, 0, 2, 0] = 5.0
    assert SaliencyKeep(6, 8, retention=0.34, kernel=3)(0, q, k).tolist() == [1, 2]
    assert SaliencyKeep(6, 8, retention=0.34, kernel=1)(0, q, k).tolist()[1] == 2


class _Recording:
    """The method's backend, remembering each call's q and k (every local row at a full step)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.calls.append((layer, q.clone(), k.clone()))
        return DenseAttention()(layer, q, k, v)


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_cache_is_taken_one_step_late_from_that_steps_queries(family: str) -> None:
    """Step 0 of a block is plain (no cache written); step 1 is full and the cache holds exactly its K/V
    at the rows its block queries select; step 2 forwards the block (+ the row before it on Dream) only; the
    next block starts plain again and leaves the cache of the last block alone until its own step 1."""
    model, gen = tiny_model(family, seed=5, num_layers=3), _gen(8, 8, 4, None)
    mask, p, lead = model.config.mask_token_id, len(PROMPT), int(family == "dream")
    local = torch.tensor(PROMPT + [mask] * 8)
    positions = torch.arange(local.numel())[None]
    inner = _Recording()
    policy = SparseDLLM(retention=0.4, pool_kernel=3)
    fn = PolicyLogits(model, local, positions, p, gen, policy, inner)
    response = torch.full((8,), mask)
    with torch.inference_mode():
        fn(response, torch.arange(4))
        assert not fn.cache.ready and fn.stats.refreshes == 0
        response[1] = 42  # the sampler's unmasking between the block's first two steps
        inner.calls.clear()
        fn(response, torch.tensor([0, 2, 3]))
        assert fn.cache.ready and fn.stats.refreshes == 1
        for layer, q, k in inner.calls:  # the step-1 forward: every row, the new token in it
            assert k.shape[2] == local.numel()
            want = _from_scratch(q, k, p, p + 4, 0.4, 3)
            assert fn.cache.held[layer].tolist() == want
            torch.testing.assert_close(fn.cache.keys[layer], k[:, :, want], rtol=0, atol=0)
        cached = [t.clone() for t in fn.cache.keys]
        response[2] = 43
        inner.calls.clear()
        fn(response, torch.tensor([0, 3]))
        assert [q.shape[2] for _, q, _ in inner.calls] == [4 + lead] * 3  # the block only
        for (_, _, k), held in zip(inner.calls, fn.cache.held, strict=True):
            assert held is not None and len(held) == int((local.numel() - 4) * 0.4)
            seen = held[(held < p - lead) | (held >= p + 4)]  # the row before the block is fresh
            assert k.shape[2] == len(seen) + 4 + lead
        response[0], response[3] = 44, 45
        fn(response, torch.arange(4, 8))  # block 1, step 0: plain, the cache untouched
        assert all(torch.equal(a, b) for a, b in zip(fn.cache.keys, cached, strict=True))
        assert fn.stats.refreshes == 1
        fn(response, torch.arange(4, 8))  # block 1, step 1: a new cache around block 1
        assert fn.stats.refreshes == 2
        assert all(not ((h >= p + 4) & (h < p + 8)).any() for h in fn.cache.held if h is not None)
    n = local.numel()
    assert fn.stats.rows_forwarded == 4 * n + 1 * (4 + lead)


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_rows_forwarded_and_cache_size(family: str) -> None:
    model, gen = tiny_model(family), _gen(16, 16, 4, None)
    lead, n = int(family == "dream"), len(PROMPT) + 16
    sparse = generate_vanilla(model, PROMPT, gen, policy=_sparse()).cache
    assert sparse["refreshes"] == 4  # one cache per block, taken at its second step
    assert sparse["rows_forwarded"] == 4 * 2 * n + 8 * (4 + lead)  # two full steps per block
    kept = int((n - 4) * 0.5)
    assert sparse["cache_bytes"] == 2 * 2 * 2 * kept * 16 * 4  # layers, K/V, kv heads, kept, head dim, fp32


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_eviction_changes_the_cached_steps(family: str) -> None:
    """Low retention really drops rows: the cached steps' logits differ from the dual cache's."""
    model, gen = tiny_model(family, seed=1), _gen(8, 8, 4, None)
    local = torch.tensor(PROMPT + [model.config.mask_token_id] * 8)
    positions = torch.arange(local.numel())[None]
    out = []
    for policy in (SparseDLLM(retention=1.0), SparseDLLM(retention=0.1)):
        fn = PolicyLogits(model, local.clone(), positions, len(PROMPT), gen, policy, DenseAttention())
        response, at = torch.full((8,), model.config.mask_token_id), torch.arange(4)
        with torch.inference_mode():
            fn(response, at), fn(response, at)
            out.append(fn(response, at))
    assert not torch.allclose(out[0], out[1], atol=1e-4)


def test_evicting_cache_with_visible_rows_is_refused() -> None:
    cache = LocalKVCache()
    k = torch.randn(1, 2, 6, 16)
    cache.store(0, k, k, held=torch.tensor([0, 5]))
    backend = LocalCacheAttention(DenseAttention(), cache, 2, 4, visible=[torch.arange(4)])
    with pytest.raises(ValueError, match="not an evicting one"):
        backend(0, torch.randn(1, 4, 2, 16), k[:, :, 2:4], k[:, :, 2:4])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"retention": 0.0}, "sparse_retention must be in (0, 1] (got 0.0)"),
        ({"retention": 1.5}, "sparse_retention must be in (0, 1] (got 1.5)"),
        ({"pool_kernel": 4}, "sparse_pool_kernel must be odd (got 4)"),
        ({"pool_kernel": 0}, "sparse_pool_kernel must be in [1, 255] (got 0)"),
        ({"delay_steps": -1}, "sparse_delay_steps must be in [0, 4096] (got -1)"),
        ({"refresh_steps": 0}, "cache_refresh_steps must be in [1, 4096] (got 0)"),
    ],
)
def test_bad_knobs_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(SettingError) as err:
        _sparse(**kwargs)
    assert message in str(err.value)


@pytest.mark.parametrize("name", ["none", "dual-cache", "prefix-cache"])
def test_sparse_knobs_need_the_sparse_policy(name: str) -> None:
    with pytest.raises(SettingError) as err:
        DecodePolicyConfig(name, retention=0.5)
    assert f"sparse_retention needs decode_policy sparse-dllm, not {name}" in str(err.value)
    assert err.value.kind == "sparse_retention_without_sparse_dllm"


def test_direct_construction_checks_its_knobs() -> None:
    for bad in ({"retention": 0.0}, {"pool_kernel": 2}, {"delay_steps": -1}, {"refresh_steps": 0}):
        with pytest.raises(ValueError, match="need"):
            SparseDLLM(**bad)  # type: ignore[arg-type]


def test_paper_defaults() -> None:
    assert _sparse().sparse() == (0.5, 3, 1)
    assert SparseDLLM() == SparseDLLM(retention=0.5, pool_kernel=3, delay_steps=1)


@pytest.mark.parametrize("protected", [0, 3, 8])
@pytest.mark.parametrize("retention", [0.5, 0.05, 1.0])
def test_protected_rows_are_kept_and_the_others_selected_by_saliency(
    protected: int, retention: float
) -> None:
    """Rows [0, p) (pdllm's question) are always kept; the top floor((M - p) r) of the other candidates by
    pooled saliency fill the rest (p = 0: the paper's selection)."""
    gen = torch.Generator().manual_seed(protected)
    q, k = torch.randn(1, 4, 20, 16, generator=gen), torch.randn(1, 2, 20, 16, generator=gen)
    start, end = 12, 16
    got = SaliencyKeep(start, end, retention, 3, protected)(0, q, k).tolist()
    n = int((16 - protected) * retention)
    assert got[:protected] == list(range(protected)) and len(got) == protected + n
    pooled = torch.nn.functional.max_pool1d(saliency(q, k, start, end)[None, None], 3, 1, 1)[0, 0]
    candidates = list(range(protected, 16))
    best = sorted(candidates, key=lambda c: (-float(pooled[c]), c))[:n]
    assert got[protected:] == sorted(c + (end - start) * (c >= start) for c in best)
    if protected == 0:
        assert got == _from_scratch(q, k, start, end, retention, 3)


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_protected_rows_stay_in_every_layers_cache(family: str) -> None:
    model, gen = tiny_model(family, seed=2), _gen(8, 8, 4, None)
    local = torch.tensor(PROMPT + [model.config.mask_token_id] * 8)
    positions = torch.arange(local.numel())[None]
    policy = SparseDLLM(retention=0.05, delay_steps=0)
    fn = PolicyLogits(model, local, positions, len(PROMPT), gen, policy, DenseAttention(), protected=5)
    response, at = torch.full((8,), model.config.mask_token_id), torch.arange(4)
    with torch.inference_mode():
        fn(response, at)
    assert fn.cache.held and all(h is not None and h[:5].tolist() == list(range(5)) for h in fn.cache.held)
    with pytest.raises(ValueError, match="protected rows"):
        PolicyLogits(model, local, positions, len(PROMPT), gen, policy, DenseAttention(), protected=14)
