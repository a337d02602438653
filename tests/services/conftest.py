"""Fixtures shared by the serving tests."""

from __future__ import annotations

import pytest

from pdllm.decode_service.policies.focus_batch import FocusDecodeBatch


@pytest.fixture
def focus_step_sizes(monkeypatch) -> list[int]:
    """The live requests of every packed FOCUS step taken while the test runs (the worker's batched FOCUS
    groups, ``decode_service/focus_rounds.py``), in order."""
    sizes: list[int] = []
    step = FocusDecodeBatch.step

    def counting(self: FocusDecodeBatch) -> None:
        sizes.append(sum(not r.state.done for r in self.requests))
        step(self)

    monkeypatch.setattr(FocusDecodeBatch, "step", counting)
    return sizes
