"""Polestar-Cache's reference path on tiny fp32 Dream and LLaDA models (``policies/polestar.py``).

Exact identities: every cluster recomputed at every step from exact hidden states is plain decoding; no
cluster ever recomputed is the dual cache. The pieces (spherical k-means, the KL proxy, the residual
formats) are held to from-scratch computations written here.
"""

from __future__ import annotations

import math

import pytest
import torch

from pdllm.decode_service.policies.polestar import kl_drift, proxy_log_attention, select_clusters
from pdllm.decode_service.policies.polestar_store import (
    ClusteredHidden,
    dequantize,
    quantize,
    spherical_kmeans,
    split_clusters,
)
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.settings import SettingError
from tests.reference.vanilla import generate_vanilla

from ..model.helpers import tiny_model

PROMPT = [1, 17, 33, 8, 61, 5, 40, 22, 9]
SCHEDULES = [(16, 16, 4, None), (12, 12, 6, 0.15)]


def _gen(gen: int, steps: int, block: int | None, threshold: float | None) -> GenerationConfig:
    return GenerationConfig(
        gen_length=gen, steps=steps, block_length=block, threshold=threshold, stop_at_eos=False
    )


def _polestar(**knobs: object) -> DecodePolicyConfig:
    return DecodePolicyConfig("polestar", polestar={f"polestar_{k}": v for k, v in knobs.items()})


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
def test_recompute_everything_is_plain_decoding(family: str, schedule: tuple) -> None:
    model, gen = tiny_model(family), _gen(*schedule)
    plain = generate_vanilla(model, PROMPT, gen)
    every = _polestar(clusters=4, top_clusters=4, update_threshold=0, residual_format="none")
    cached = generate_vanilla(model, PROMPT, gen, policy=every)
    assert cached.raw_tokens == plain.raw_tokens
    # not vacuous: the dual cache (the same rows forwarded, nothing recomputed) decodes differently
    dual = generate_vanilla(model, PROMPT, gen, policy=DecodePolicyConfig("dual-cache"))
    assert dual.raw_tokens != plain.raw_tokens


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("knobs", [{"drift_threshold": 1e6}, {"update_threshold": 4096}], ids=str)
def test_never_recompute_is_dual_cache(family: str, knobs: dict) -> None:
    model, gen = tiny_model(family, seed=1), _gen(16, 16, 4, None)
    dual = generate_vanilla(model, PROMPT, gen, policy=DecodePolicyConfig("dual-cache"))
    never = generate_vanilla(model, PROMPT, gen, policy=_polestar(**knobs))
    assert never.raw_tokens == dual.raw_tokens


@pytest.mark.parametrize("fmt", ["int8", "fp8", "none"])
def test_paper_defaults_run_and_offload(fmt: str) -> None:
    model, gen = tiny_model("llada", seed=2), _gen(16, 16, 4, None)
    result = generate_vanilla(model, PROMPT, gen, policy=_polestar(residual_format=fmt))
    assert len(result.raw_tokens) == 16 and result.cache["policy"] == "polestar"
    assert result.cache["cache_bytes"] > 0


def _kmeans_from_scratch(x: torch.Tensor, k: int, rounds: int) -> list[int]:
    unit = [row / row.norm() for row in x.double()]
    dirs = [unit[j * len(unit) // k] for j in range(k)]
    assign: list[int] = []
    for _ in range(rounds):
        new = []
        for u in unit:
            sims = [float(u @ d) for d in dirs]
            new.append(sims.index(max(sims)))
        if new == assign:
            break
        assign = new
        for j in range(k):
            members = [u for u, a in zip(unit, assign, strict=True) if a == j]
            if members:
                s = torch.stack(members).sum(0)
                dirs[j] = s / s.norm()
    return assign


@pytest.mark.parametrize(("n", "k"), [(40, 6), (9, 3), (5, 5), (7, 1)])
def test_spherical_kmeans_matches_from_scratch(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * 10 + k)
    centers = torch.randn(k, 16, generator=g) * 3
    x = centers[torch.arange(n) % k] + torch.randn(n, 16, generator=g)
    assert spherical_kmeans(x, k, 20).tolist() == _kmeans_from_scratch(x, k, 20)


def test_split_clusters() -> None:
    assert split_clusters(8, 30, 10) == (6, 2)
    assert split_clusters(8, 100, 1) == (7, 1)
    assert split_clusters(8, 12, 0) == (8, 0)
    assert split_clusters(8, 3, 0) == (3, 0)
    assert split_clusters(1, 5, 5) == (1, 1)


def test_store_centroids_and_members_from_scratch() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 8, generator=g)
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 12, 13, 14, 15, 16, 17, 18, 19])  # block at rows [6, 12)
    positions = torch.arange(100, 120)
    store = ClusteredHidden.build(x, rows, positions, 6, (2, 3), "none", 20)
    pre = spherical_kmeans(x[rows[:6]], 2, 20)
    suf = spherical_kmeans(x[rows[6:]], 3, 20) + 2
    assert store.assign.tolist() == torch.cat([pre, suf]).tolist()
    for c in range(5):
        members = rows[store.assign == c]
        torch.testing.assert_close(store.centroids[c], x[members].mean(0))
        assert int(store.centroid_positions[c]) == round(float(positions[members].double().mean()))
        assert store.members([c]).tolist() == members.tolist()
    torch.testing.assert_close(store.hidden(rows), x[rows], rtol=0, atol=0)  # "none" is exact
    new = torch.randn(2, 8, generator=g)
    store.update(torch.tensor([1, 14]), new)
    h = x[rows].clone()
    h[1], h[8] = new[0], new[1]
    for c in range(5):  # the touched clusters' centroids follow their members
        torch.testing.assert_close(store.centroids[c], h[store.assign == c].mean(0))


def _proxy_from_scratch(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.empty(heads, q.shape[2], k.shape[2], dtype=torch.float64)
    for h in range(heads):
        for c in range(q.shape[2]):
            logits = [
                float(q[0, h, c] @ k[0, h // (heads // kv_heads), j]) / math.sqrt(q.shape[3])
                for j in range(k.shape[2])
            ]
            m = max(logits)
            z = sum(math.exp(v - m) for v in logits)
            out[h, c] = torch.tensor([v - m - math.log(z) for v in logits])
    return out


def test_drift_proxy_matches_from_scratch() -> None:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 3, 8, generator=g)
    k1, k2 = torch.randn(1, 2, 10, 8, generator=g), torch.randn(1, 2, 10, 8, generator=g)
    lp1, lp2 = proxy_log_attention(q, k1), proxy_log_attention(q, k2)
    ref1, ref2 = _proxy_from_scratch(q, k1), _proxy_from_scratch(q, k2)
    torch.testing.assert_close(lp1.double(), ref1, rtol=0, atol=1e-5)
    kl = [
        sum(float((ref2[h, c].exp() * (ref2[h, c] - ref1[h, c])).sum()) for h in range(4)) / 4
        for c in range(3)
    ]
    torch.testing.assert_close(
        kl_drift(lp2, lp1).double(), torch.tensor(kl, dtype=torch.float64), atol=1e-5, rtol=0
    )
    assert float(kl_drift(lp1, lp1).abs().max()) < 1e-6
    scores = torch.tensor([0.1, 0.5, 0.5, 0.05])
    assert select_clusters(scores, 2, 0.0) == [1, 2]  # ties: the lower cluster first
    assert select_clusters(scores, 3, 0.2) == [1, 2]
    assert select_clusters(scores, 2, 0.6) == []


@pytest.mark.parametrize(("fmt", "rel", "code_bytes"), [("int8", 0.5 / 127, 1), ("fp8", 2**-4, 1)])
def test_residuals_round_trip_within_format_error(fmt: str, rel: float, code_bytes: int) -> None:
    g = torch.Generator().manual_seed(5)
    r = torch.randn(32, 64, generator=g) * torch.logspace(-3, 1, 32)[:, None]
    codes, scale = quantize(r, fmt)
    back = dequantize(codes, scale)
    absmax = r.abs().amax(-1, keepdim=True)
    # int8: uniform, half a step of absmax / 127; e4m3: 3 mantissa bits (half-ulp 2^-4 relative) and
    # subnormals below 2^-6 in steps of 2^-9 (half: 2^-10), in units of the row's scale
    bound = absmax * rel if fmt == "int8" else r.abs() * rel + scale[:, None] * 2**-10
    assert bool(((back - r).abs() <= bound * (1 + 1e-5)).all())
    assert codes.element_size() == code_bytes and scale.dtype == torch.float32


def test_bad_knobs_are_refused() -> None:
    with pytest.raises(
        SettingError, match="polestar_top_clusters must be in \\[1, 2\\], at most polestar_clusters"
    ):
        _polestar(clusters=2, top_clusters=3)
    with pytest.raises(SettingError, match="polestar_top_clusters must be at most polestar_clusters \\(8\\)"):
        _polestar(top_clusters=9)
    with pytest.raises(SettingError, match="polestar_clusters must be in \\[1, 1024\\]"):
        _polestar(clusters=0)
    with pytest.raises(SettingError, match="polestar_clusters needs decode_policy polestar, not dual-cache"):
        DecodePolicyConfig("dual-cache", polestar={"polestar_clusters": 4})
    with pytest.raises(SettingError, match="polestar_residual_format must be one of int8, fp8, none"):
        _polestar(residual_format="nvfp4")
    with pytest.raises(ValueError, match="unknown polestar knobs"):
        DecodePolicyConfig("polestar", polestar={"clusters": 4})


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_rows_recomputed_at_a_layer_propagate_to_the_later_layers(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every cluster drifts at layer 0, none later: the rows recomputed at layer 0 must still run every
    # later layer (their inputs changed), which again makes plain decoding.
    model, gen = tiny_model(family, seed=4), _gen(16, 16, 4, None)
    layers, calls = model.config.num_layers, [0]

    def layer0_only(kl: torch.Tensor, top: int, threshold: float) -> list[int]:
        layer = calls[0] % layers
        calls[0] += 1
        return list(range(kl.shape[0])) if layer == 0 else []

    monkeypatch.setattr("pdllm.decode_service.policies.polestar.select_clusters", layer0_only)
    config = _polestar(clusters=3, top_clusters=1, update_threshold=0, residual_format="none")
    cached = generate_vanilla(model, PROMPT, gen, policy=config)
    assert calls[0] > 0 and calls[0] % layers == 0
    assert cached.raw_tokens == generate_vanilla(model, PROMPT, gen).raw_tokens
