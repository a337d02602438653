"""DyLLM against the from-scratch oracle (``dyllm.py``): the reference loop (``tests/reference``'s
``generate_vanilla``), the decode worker's rounds in process (vanilla through ``DecodeWorker.vanilla``, pdllm
through the engine; ``dyllm_rounds.py``); tokens and every counter (forwards, FullSteps, response-only steps,
FFN rows, K/V rows, rows in all) must be equal."""

from __future__ import annotations

import pytest

from pdllm.decode_service.worker import DecodeWorker
from pdllm.shared.decode_policy import DecodePolicyConfig

from .cases import PROMPT, QUESTION, case_id, counters, gen, model, pdllm, pdllm_oracle_case, vanilla
from .dyllm import dyllm_decode

# (tau, full steps, full-sequence interval, approximate attention)
KNOBS = [(0.9, 4, 4, True), (0.98, 2, 3, False), (0.995, 1, 2, True), (0.999, 2, 3, False), (1.0, 1, 2, True)]
SCHEDULES = [(16, 16, 8, None), (16, 16, 16, 0.12)]
# A similarity this close to tau could fall on either side of it by rounding alone: no such case is used.
MARGIN = 1e-6


def _policy(tau: float, full: int, interval: int, approximate: bool) -> DecodePolicyConfig:
    knobs = {
        "dyllm_threshold": tau,
        "dyllm_full_steps": full,
        "dyllm_full_sequence_interval": interval,
        "dyllm_approximate_attention": "on" if approximate else "off",
    }
    return DecodePolicyConfig("dyllm", dyllm=knobs)


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("knobs", KNOBS, ids=case_id)
@pytest.mark.parametrize("schedule", SCHEDULES, ids=case_id)
def test_vanilla_dyllm_matches_oracle(family: str, knobs: tuple, schedule: tuple) -> None:
    """Planted: the context cosine divided by |new|^2 instead of |new| |old| -> fails (all but one of the
    tau < 1 cases). Planted: every row salient at layer 0 (changed tokens ignored) -> fails. Planted: the
    full sequence queried on forwards ``t % interval == 0`` -> fails."""
    m, g = model(family, seed=1), gen(*schedule)
    result = vanilla(m, g, _policy(*knobs))
    tokens, expected, oracle = dyllm_decode(m, PROMPT, g.gen_length, g.block, g.steps, g.threshold, *knobs)
    assert oracle.margin > MARGIN
    assert result.raw_tokens == tokens
    assert counters(result, expected) == expected


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("knobs", KNOBS, ids=case_id)
@pytest.mark.parametrize("schedule", SCHEDULES, ids=case_id)
def test_vanilla_dyllm_in_the_rounds_matches_oracle(family: str, knobs: tuple, schedule: tuple) -> None:
    """The decode worker's rounds (``dyllm_rounds.py``, in process). Planted: the chosen rows compared
    with ``<=`` against 0.999 tau -> 11 of 20 fail; the approximate context without its ``- A_t V_{t-1}``
    term -> 7 fail; the merged K/V not written back into the cache slots -> 19 fail."""
    m, g = model(family, seed=1), gen(*schedule)
    result = DecodeWorker(m).vanilla(PROMPT, g, _policy(*knobs))
    tokens, expected, oracle = dyllm_decode(m, PROMPT, g.gen_length, g.block, g.steps, g.threshold, *knobs)
    assert oracle.margin > MARGIN
    assert result.raw_tokens == tokens
    assert counters(result, expected) == expected


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("threshold", [None, 0.12])
def test_pdllm_dyllm_matches_oracle(family: str, threshold: float | None) -> None:
    """Planted: the context cosine divided by |new|^2 instead of |new| |old| -> fails (every case). Planted:
    every row salient at layer 0, or the full sequence on ``t % interval == 0`` -> fails; the pseudo-label
    draft ignoring ``pseudo_label_rounds`` -> fails."""
    knobs = (0.99, 2, 3, True)
    m, g = model(family), gen(16, 16, 8, threshold)
    result, selected = pdllm(m, g, _policy(*knobs))
    case = pdllm_oracle_case(m, g)
    tokens, expected, oracle = dyllm_decode(
        m, QUESTION, g.gen_length, g.block, g.steps, g.threshold, *knobs, case.static, case.first_position
    )
    assert oracle.margin > MARGIN
    assert selected == case.selected
    assert result.raw_tokens == tokens
    assert counters(result, expected) == expected
