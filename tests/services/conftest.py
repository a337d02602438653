"""Fixtures shared by the serving tests."""

from __future__ import annotations

import pytest

from pdllm.decode_service.focus_rounds import FocusRound


@pytest.fixture
def focus_round_sizes(monkeypatch) -> list[int]:
    """The FOCUS sessions of every batched round taken while the test runs (per kind: Dream/LLaDA's,
    ``decode_service/focus_rounds.py``, SDAR's, ``sdar_focus_rounds.py``), in order."""
    sizes: list[int] = []
    init = FocusRound.__init__

    def counting(self: FocusRound, members: list) -> None:
        sizes.append(len(members))
        init(self, members)

    monkeypatch.setattr(FocusRound, "__init__", counting)
    return sizes
