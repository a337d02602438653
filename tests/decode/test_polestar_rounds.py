"""Polestar-Cache in the batched rounds (``decode_service/polestar_rounds.py``) against its reference loop."""

from __future__ import annotations

import pytest

from pdllm.decode_service.polestar_rounds import PolestarBatchSession
from pdllm.decode_service.rounds import EagerRoundForward
from pdllm.shared.decode_policy import DecodePolicyConfig
from tests.decode.helpers import (
    CASES,
    POLICY_CASES,
    alone,
    policy_session,
    pool_for,
    reference,
    round_forward,
    run_rounds,
    session,
)
from tests.engine.helpers import model

# Blocks of 2-6 tokens: update thresholds of 0-1 make cached steps update, so rows are recomputed.
KNOBS = [
    ({"clusters": 2, "top_clusters": 1, "update_threshold": 0}, None),
    ({"clusters": 4, "top_clusters": 2, "update_threshold": 1, "residual_format": "fp8"}, None),
    ({"clusters": 3, "top_clusters": 3, "update_threshold": 0, "residual_format": "none"}, 3),
    ({"clusters": 8, "top_clusters": 2, "update_threshold": 0, "drift_threshold": 1e-4}, None),
    ({"clusters": 4, "top_clusters": 1, "update_threshold": 0, "recompute": "per-layer"}, None),
]


def polestar(knobs: dict, refresh_steps: int | None = None) -> DecodePolicyConfig:
    return DecodePolicyConfig(
        "polestar", refresh_steps, polestar={f"polestar_{k}": v for k, v in knobs.items()}
    )


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("kind", ["eager", "padded"])
@pytest.mark.parametrize("knobs", KNOBS, ids=str)
def test_polestar_sessions_in_rounds_equal_the_reference_loop(family: str, kind: str, knobs: tuple) -> None:
    m = model(family)
    policy = polestar(*knobs)
    want = [reference(m, case, seed, policy) for seed, case in enumerate(POLICY_CASES)]
    pool = pool_for(m, pages=160)
    forward = round_forward(kind, m, pool)
    sessions = [policy_session(m, pool, case, seed, policy) for seed, case in enumerate(POLICY_CASES)]
    assert all(isinstance(s, PolestarBatchSession) for s in sessions)
    dual = policy_session(m, pool, POLICY_CASES[1], 9, DecodePolicyConfig(name="dual-cache"))
    plain = session(m, pool, CASES[1], 7)  # sessions of other kinds share the rounds
    run_rounds(forward, [sessions[0], dual, plain, *sessions[1:]])
    assert plain.state.tokens.tolist() == alone(m, CASES[1], 7)
    assert (
        dual.result().raw_tokens == reference(m, POLICY_CASES[1], 9, DecodePolicyConfig(name="dual-cache"))[0]
    )
    for s, (tokens, cache), case in zip(sessions, want, POLICY_CASES, strict=True):
        result = s.result()
        assert result.raw_tokens == tokens, case
        assert result.cache == cache, case  # updates, rows recomputed and peak bytes too
    assert sum(s.stats.rows_recomputed for s in sessions) > 0  # not vacuous: rows were recomputed


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_recompute_everything_in_rounds_is_plain_decoding(family: str) -> None:
    m = model(family)
    every = polestar({"clusters": 4, "top_clusters": 4, "update_threshold": 0, "residual_format": "none"})
    pool = pool_for(m, pages=128)
    forward = EagerRoundForward(m, pool, "torch")
    for seed, case in enumerate(POLICY_CASES[:2]):
        s = policy_session(m, pool, case, seed, every)
        run_rounds(forward, [s])
        assert s.state.tokens.tolist() == alone(m, case, seed)
        assert s.polestar.updates > 0
        pool.release(s.pages)


def test_host_sampler_polestar_session_equals_the_reference_loop() -> None:
    m = model("dream")
    pool = pool_for(m, pages=128)
    policy = polestar(*KNOBS[0])
    case = POLICY_CASES[2]  # sampled: temperature 0.8
    s = policy_session(m, pool, case, 2, policy, device_sampler=False)
    run_rounds(EagerRoundForward(m, pool, "torch"), [s])
    assert s.result().raw_tokens == reference(m, case, 2, policy)[0]
