"""``benchmarks/polestar_round_profile.py --smoke`` on CPU: it runs, prints its rounds by kind with updates
among them, and leaves the classes it times as it found them."""

from __future__ import annotations

import pytest

from benchmarks import polestar_round_profile as profile
from pdllm.decode_service.policies.polestar_device import DevicePolestarState


def test_profile_smoke_runs_and_restores(capsys: pytest.CaptureFixture[str]) -> None:
    drifting = DevicePolestarState.drifting
    assert profile.main(["--smoke", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "update rounds" in out and "state.drifting" in out and "k-means" in out
    assert DevicePolestarState.drifting is drifting
