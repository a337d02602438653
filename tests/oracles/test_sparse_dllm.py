"""Sparse-dLLM against the from-scratch oracle (``sparse_dllm.py``): vanilla through ``generate_vanilla`` and
pdllm through the in-process engine (where the question's rows are always kept); tokens and every counter
(forwards, caching steps, rows forwarded, cache bytes) must be equal."""

from __future__ import annotations

import pytest

from pdllm.shared.decode_policy import DecodePolicyConfig

from .cases import PROMPT, QUESTION, case_id, counters, gen, model, pdllm, pdllm_oracle_case, vanilla
from .sparse_dllm import sparse_dllm_decode

# (retention, pool kernel, delay steps, refresh period)
KNOBS = [(0.5, 3, 1, None), (0.3, 1, 0, None), (0.6, 5, 2, None), (0.5, 3, 1, 2)]
SCHEDULES = [(16, 16, 8, None), (12, 12, 6, 0.15)]


def _policy(retention: float, kernel: int, delay: int, every: int | None) -> DecodePolicyConfig:
    return DecodePolicyConfig(
        "sparse-dllm", refresh_steps=every, retention=retention, pool_kernel=kernel, delay_steps=delay
    )


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("knobs", KNOBS, ids=case_id)
@pytest.mark.parametrize("schedule", SCHEDULES, ids=case_id)
def test_vanilla_sparse_dllm_matches_oracle(family: str, knobs: tuple, schedule: tuple) -> None:
    """Planted: the saliency not max-pooled -> fails (kernels 3 and 5, fixed schedule). Planted: the top
    ``floor(M r)`` taken by ascending saliency -> fails. Planted: the cache taken one step early (delay x - 1)
    -> fails (delays 1 and 2). Planted: the cached suffix's keys merged in place of its values -> fails."""
    m, g = model(family, layers=2, seed=1), gen(*schedule)
    result = vanilla(m, g, _policy(*knobs))
    tokens, expected, _ = sparse_dllm_decode(m, PROMPT, g.gen_length, g.block, g.steps, g.threshold, *knobs)
    assert result.raw_tokens == tokens
    assert counters(result, expected) == expected


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("knobs", KNOBS[:2], ids=case_id)
def test_pdllm_sparse_dllm_matches_oracle(family: str, knobs: tuple) -> None:
    """Planted: the question's rows left unprotected (``StepContext.protected`` not passed to the selection)
    -> fails (every case). Planted: ascending saliency -> fails; no max-pooling -> fails (kernel 3); the
    cache taken one step early -> fails (delay 1); the pseudo-label draft ignoring ``pseudo_label_rounds``
    -> fails."""
    m, g = model(family, layers=2), gen(16, 16, 8, None)
    result, selected = pdllm(m, g, _policy(*knobs))
    case = pdllm_oracle_case(m, g)
    tokens, expected, _ = sparse_dllm_decode(
        m, QUESTION, g.gen_length, g.block, g.steps, g.threshold, *knobs, len(QUESTION),
        case.static, case.first_position,
    )  # fmt: skip
    assert selected == case.selected
    assert result.raw_tokens == tokens
    assert counters(result, expected) == expected
