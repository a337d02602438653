"""``benchmarks/polestar_round_profile.py --smoke`` on CPU: it runs, prints its rounds by kind with updates
among them and the batched stores' pieces, and leaves the classes it times as it found them."""

from __future__ import annotations

import pytest

from benchmarks import polestar_round_profile as profile
from pdllm.decode_service.polestar_update_group import UpdateGroup
from pdllm.decode_service.policies.polestar_batch import StackedLayer


def test_profile_smoke_runs_and_restores(capsys: pytest.CaptureFixture[str]) -> None:
    call, proxy = UpdateGroup.__call__, StackedLayer.proxy
    assert profile.main(["--smoke", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "update rounds" in out and "stacked.proxy" in out and "k-means (batched)" in out
    assert UpdateGroup.__call__ is call and StackedLayer.proxy is proxy
