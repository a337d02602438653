"""Fixtures shared by the serving tests."""

from __future__ import annotations

import pytest

from pdllm.decode_service.focus_rounds import FocusRound
from pdllm.decode_service.policies.focus_batch import FocusDecodeBatch


@pytest.fixture
def focus_step_sizes(monkeypatch) -> list[int]:
    """The live requests of every packed SDAR FOCUS step taken while the test runs (the worker's FOCUS
    groups, ``decode_service/focus_groups.py``), in order."""
    sizes: list[int] = []
    step = FocusDecodeBatch.step

    def counting(self: FocusDecodeBatch) -> None:
        sizes.append(sum(not r.state.done for r in self.requests))
        step(self)

    monkeypatch.setattr(FocusDecodeBatch, "step", counting)
    return sizes


@pytest.fixture
def focus_round_sizes(monkeypatch) -> list[int]:
    """The FOCUS sessions of every batched round taken while the test runs (Dream/LLaDA FOCUS in the
    rounds, ``decode_service/focus_rounds.py``), in order."""
    sizes: list[int] = []
    init = FocusRound.__init__

    def counting(self: FocusRound, members: list) -> None:
        sizes.append(len(members))
        init(self, members)

    monkeypatch.setattr(FocusRound, "__init__", counting)
    return sizes
