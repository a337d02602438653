"""The host-vs-device sampler benchmark runs end to end on CPU (tiny shapes) and writes its results."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.decode_sampler import main


def test_decode_sampler_benchmark_smoke(tmp_path: Path) -> None:
    assert main(["--smoke", "--settings", "one-block,threshold-0.9", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "decode_sampler_smoke.json").read_text())
    assert [r["setting"] for r in data["rows"]] == ["one-block", "threshold-0.9"]
    for row in data["rows"]:
        assert row["single_equal"] and row["rounds_equal@4"]
        assert row["single_step_ms_device"] > 0 and row["round_ms_device@4"] > 0
    assert data["checks"] == {"single": "60/60", "rounds": "10/10"}
    assert "| one-block |" in (tmp_path / "decode_sampler_smoke.md").read_text()
