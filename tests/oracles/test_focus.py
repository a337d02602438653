"""FOCUS on Dream / LLaDA against the from-scratch oracle (``focus.py``): the reference request loop through
``generate_vanilla`` and the decode worker's rounds in process (vanilla through ``DecodeWorker.vanilla``, pdllm through
the engine); tokens and every counter (forwards, rows through layers >= 2 and through layers 0-1, focused,
evicted, frozen, decoded) must be equal."""

from __future__ import annotations

import pytest

from pdllm.decode_service.worker import DecodeWorker
from pdllm.shared.decode_policy import DecodePolicyConfig

from .cases import PROMPT, QUESTION, case_id, counters, gen, model, pdllm, pdllm_oracle_case, vanilla
from .focus import focus_decode

# (alpha, pool kernel, fixed budget, intra-block cache)
KNOBS = [(1.5, 3, None, True), (1.2, 5, None, False), (2.0, 1, None, True), (1.5, 1, 2, True)]
SCHEDULES = [(16, 16, 8, None), (16, 16, 8, 0.12), (16, 16, 16, 0.15)]
OTHER_PROMPT = [1, 5, 6, 7, 8, 9, 10]


def _policy(alpha: float, kernel: int, budget: int | None, delayed: bool) -> DecodePolicyConfig:
    knobs = {
        "focus_alpha": alpha,
        "focus_pool_kernel": kernel,
        "focus_budget": budget,
        "focus_delayed_cache": "on" if delayed else "off",
    }
    return DecodePolicyConfig("focus", focus=knobs)


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("knobs", KNOBS, ids=case_id)
@pytest.mark.parametrize("schedule", SCHEDULES, ids=case_id)
def test_vanilla_focus_matches_oracle(family: str, knobs: tuple, schedule: tuple) -> None:
    """Planted: the mean tokens unmasked per step off by one (``sum / (steps + 1)`` in ``ceil(alpha Nbar)``)
    -> fails (most dynamic-budget cases, fixed schedule and threshold). Planted: no AR-context preservation
    (predecessors of the top K not forwarded) -> fails. Planted: the block's last row never stable for the
    intra-block cache -> fails (intra-block cache on)."""
    m, g = model(family, layers=4), gen(*schedule)
    result = vanilla(m, g, _policy(*knobs))
    tokens, expected, _ = focus_decode(m, PROMPT, g.gen_length, g.block, g.steps, g.threshold, *knobs)
    assert result.raw_tokens == tokens
    assert counters(result, expected) == expected


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("knobs", KNOBS, ids=case_id)
@pytest.mark.parametrize("schedule", SCHEDULES, ids=case_id)
def test_vanilla_focus_in_the_rounds_matches_oracle(family: str, knobs: tuple, schedule: tuple) -> None:
    """The decode worker's rounds (``focus_rounds.py``, in process). Planted: a block row both forwarded and
    in the key region at layers >= 2 -> 18 of 24 fail; the region one slot short -> 13 fail; frozen rows
    forwarded at layers 0-1 -> 17 fail; the frozen rows not copied into the region -> 17 fail."""
    m, g = model(family, layers=4), gen(*schedule)
    result = DecodeWorker(m).vanilla(PROMPT, g, _policy(*knobs))
    tokens, expected, _ = focus_decode(m, PROMPT, g.gen_length, g.block, g.steps, g.threshold, *knobs)
    assert result.raw_tokens == tokens
    assert counters(result, expected) == expected


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("threshold", [None, 0.12])
def test_pdllm_focus_matches_oracle(family: str, threshold: float | None) -> None:
    """The engine decodes through the decode worker's rounds (``focus_rounds.py``). Planted: the mean tokens
    unmasked per step off by one (``sum / (steps + 1)``) -> fails (LLaDA). Planted: no AR-context preservation -> fails (fixed schedule); the block's last row never stable ->
    fails; the pseudo-label draft ignoring ``pseudo_label_rounds`` -> fails."""
    knobs = (1.5, 3, None, True)
    m, g = model(family, layers=4), gen(16, 16, 8, threshold)
    result, selected = pdllm(m, g, _policy(*knobs))
    case = pdllm_oracle_case(m, g)
    tokens, expected, _ = focus_decode(
        m, QUESTION, g.gen_length, g.block, g.steps, g.threshold, *knobs, case.static, case.first_position
    )
    assert selected == case.selected
    assert result.raw_tokens == tokens
    assert counters(result, expected) == expected
