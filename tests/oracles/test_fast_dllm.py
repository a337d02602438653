"""Fast-dLLM's prefix and dual cache, with and without a periodic refresh, against the from-scratch oracle
(``fast_dllm.py``): vanilla through ``generate_vanilla`` and pdllm through the in-process engine; tokens and
every counter (forwards, refreshes, rows forwarded, cache bytes) must be equal."""

from __future__ import annotations

import pytest

from pdllm.shared.decode_policy import DecodePolicyConfig

from .cases import PROMPT, QUESTION, case_id, counters, gen, model, pdllm, pdllm_oracle_case, vanilla
from .fast_dllm import fast_dllm_decode

# (gen_length, steps, block_length, threshold)
SCHEDULES = [(16, 16, 8, None), (16, 8, 8, None), (12, 12, 6, 0.15)]


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("name", ["dual-cache", "prefix-cache"])
@pytest.mark.parametrize("every", [None, 2, 3])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=case_id)
def test_vanilla_cache_matches_oracle(family: str, name: str, every: int | None, schedule: tuple) -> None:
    """Planted: the periodic refresh fires one step late (``(step_in_block - 1) % N == 0``, N = 2 and 3) ->
    fails (every case with a refresh period: refresh count, rows forwarded, tokens). Planted: the prefix
    cache forwarding only the block -> fails (every prefix-cache case). Planted: a cached step merging the
    cached suffix's keys in place of its values -> fails (every dual-cache case)."""
    m, g = model(family, layers=2, seed=1), gen(*schedule)
    result = vanilla(m, g, DecodePolicyConfig(name, refresh_steps=every))
    tokens, expected, oracle = fast_dllm_decode(
        m, PROMPT, g.gen_length, g.block, g.steps, g.threshold, name == "dual-cache", every
    )
    assert result.raw_tokens == tokens
    assert counters(result, expected) == expected
    assert result.steps == expected["forwards"]
    if every == 2 and schedule == SCHEDULES[0]:  # 8 steps per block: refreshed at steps 0, 2, 4 and 6
        assert [s for _, s in oracle.refreshed_at] == [0, 2, 4, 6] * 2


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("name", ["dual-cache", "prefix-cache"])
@pytest.mark.parametrize("every", [None, 3])
def test_pdllm_cache_matches_oracle(family: str, name: str, every: int | None) -> None:
    """Over pdllm's static chunk KV (the oracle's own selection and full-mask build), the policy caches the
    query suffix and the answer only. Planted: the periodic refresh fires one step late -> fails (every=3).
    Planted: the pseudo-label draft ignoring ``pseudo_label_rounds`` -> fails (every case: the selection
    moves). Planted: the prefix cache forwarding only the block -> fails (prefix cache); the cached suffix's
    keys merged in place of its values -> fails (dual cache)."""
    m, g = model(family, layers=2), gen(16, 16, 8, None)
    result, selected = pdllm(m, g, DecodePolicyConfig(name, refresh_steps=every))
    case = pdllm_oracle_case(m, g)
    tokens, expected, _ = fast_dllm_decode(
        m, QUESTION, g.gen_length, g.block, g.steps, g.threshold, name == "dual-cache", every,
        case.static, case.first_position,
    )  # fmt: skip
    assert selected == case.selected
    assert result.raw_tokens == tokens
    assert counters(result, expected) == expected
