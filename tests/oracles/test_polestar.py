"""Polestar-Cache against the from-scratch oracle (``polestar.py``): vanilla through ``generate_vanilla`` and
pdllm through the in-process engine; tokens and every counter (forwards, refreshes, rows forwarded, cache
bytes, updates, rows recomputed) must be equal."""

from __future__ import annotations

import pytest

from pdllm.shared.decode_policy import DecodePolicyConfig

from .cases import PROMPT, QUESTION, case_id, counters, gen, model, pdllm, pdllm_oracle_case, vanilla
from .polestar import polestar_decode

# (clusters, top clusters, update threshold T, drift threshold, residual format, refresh period, recompute)
KNOBS = [
    (8, 2, 4, 0.0, "int8", None, "propagated"),
    (4, 1, 0, 0.0, "int8", None, "propagated"),
    (4, 2, 1, 0.0, "none", None, "propagated"),
    (6, 2, 0, 1e-4, "int8", 3, "propagated"),
    (3, 1, 1, 0.0, "none", None, "propagated"),
    (4, 2, 0, 0.0, "fp8", None, "propagated"),
    (4, 1, 0, 0.0, "int8", None, "per-layer"),
    (6, 2, 1, 0.0, "none", 3, "per-layer"),
]
SCHEDULES = [(16, 16, 8, None), (16, 16, 16, 0.1)]


def _policy(
    clusters: int, top: int, t: int, drift: float, fmt: str, every: int | None, recompute: str
) -> DecodePolicyConfig:
    knobs = {
        "polestar_clusters": clusters,
        "polestar_top_clusters": top,
        "polestar_update_threshold": t,
        "polestar_drift_threshold": drift,
        "polestar_residual_format": fmt,
        "polestar_recompute": recompute,
    }
    return DecodePolicyConfig("polestar", refresh_steps=every, polestar=knobs)


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("knobs", KNOBS, ids=case_id)
@pytest.mark.parametrize("schedule", SCHEDULES, ids=case_id)
def test_vanilla_polestar_matches_oracle(family: str, knobs: tuple, schedule: tuple) -> None:
    """Planted: the KL drift's arguments swapped (``KL(P_prev || P_now)``) and the previous proxy never
    advanced -> fails (most cases; either half alone fails too). Planted: the periodic refresh one step late
    -> fails (refresh-period cases). Planted: k-means seeded with rows 0..k-1 -> fails; recomputed K/V not
    written back to the cache -> fails; centroid positions floored instead of rounded -> fails; the
    per-layer knob ignored (a layer's rows always joined with the layer before's) -> the per-layer cases
    fail."""
    m, g = model(family), gen(*schedule)
    result = vanilla(m, g, _policy(*knobs))
    *oracle_knobs, recompute = knobs
    tokens, expected, _ = polestar_decode(
        m, PROMPT, g.gen_length, g.block, g.steps, g.threshold, *oracle_knobs, recompute=recompute
    )
    assert result.raw_tokens == tokens
    assert counters(result, expected) == expected


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("threshold", [None, 0.12])
def test_pdllm_polestar_matches_oracle(family: str, threshold: float | None) -> None:
    """Planted: the KL drift's arguments swapped and the previous proxy never advanced -> fails (every
    case). Planted: k-means seeded with rows 0..k-1, recomputed K/V not written back, centroid positions
    floored -> each fails; the pseudo-label draft ignoring ``pseudo_label_rounds`` -> fails."""
    knobs = (4, 1, 0, 0.0, "int8", None, "propagated")
    m, g = model(family), gen(16, 16, 8, threshold)
    result, selected = pdllm(m, g, _policy(*knobs))
    case = pdllm_oracle_case(m, g)
    tokens, expected, _ = polestar_decode(
        m,
        QUESTION,
        g.gen_length,
        g.block,
        g.steps,
        g.threshold,
        *knobs[:-1],
        case.static,
        case.first_position,
    )
    assert selected == case.selected
    assert result.raw_tokens == tokens
    assert counters(result, expected) == expected
