"""The GPU benchmark script runs end to end on CPU (tiny shapes) and writes its JSON and Markdown."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.e2e_speedup import main


def test_e2e_benchmark_smoke(tmp_path: Path) -> None:
    args = ["--smoke", "--lengths", "160", "--decode-attention", "torch", "--gen-length", "8"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "e2e_speedup.json").read_text())
    (row,) = data["rows"]
    for key in (
        "context_length",
        "vanilla_s",
        "pdllm_s",
        "speedup",
        "decode_step_ms",
        "prefill_s",
        "roofline_ratio",
    ):
        assert key in row
    assert row["context_length"] == 160 and row["selected"] == [0, 1, 2]
    assert set(row["phases_s"]) == {"prefill", "score", "select", "build", "decode"}
    assert "| 160 |" in (tmp_path / "e2e_speedup.md").read_text()


def test_device_check_runs_the_engine_modes_against_the_reference() -> None:
    """The benchmark's fast == reference check (run on the GPU before timing) on CPU with the torch decode
    attention: every case ends in the reference's tokens (a stale mode name counts as a mismatch)."""
    import torch

    from benchmarks.e2e_speedup import gpu_check

    report = gpu_check(torch.device("cpu"), modes=("torch",))
    assert report["cases"] == 8 and report["mismatches"] == []
    assert gpu_check(torch.device("cpu"), modes=("segments",))["mismatches"]  # a name the engine refuses
