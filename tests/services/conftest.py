"""Fixtures shared by the serving tests."""

from __future__ import annotations

import pytest

from pdllm.decode_service.sdar_focus_rounds import SdarFocusRound


@pytest.fixture
def focus_round_sizes(monkeypatch) -> list[int]:
    """The FOCUS sessions of every batched round taken while the test runs (SDAR's,
    ``decode_service/sdar_focus_rounds.py``), in order."""
    sizes: list[int] = []
    init = SdarFocusRound.__init__

    def counting(self: SdarFocusRound, members: list) -> None:
        init(self, members)
        sizes.append(len(self.members))

    monkeypatch.setattr(SdarFocusRound, "__init__", counting)
    return sizes
