"""``benchmarks/attention.py --smoke --grid`` on CPU under the Triton interpreter: the decode rows keep their
JSON shape, gain the tuned-vs-default and roofline fields, and skipped cells are recorded with a reason; the
ragged decode batches come with the grid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_attention_benchmark_grid_smoke(tmp_path: Path) -> None:
    pytest.importorskip("triton", reason="triton not installed; the GPU run covers the benchmark")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("PDLLM_SPLIT_S_TABLE", None)
    cmd = [sys.executable, str(ROOT / "benchmarks/attention.py"), "--smoke", "--grid", "--budget-s", "0",
           "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "attention.json").read_text())
    assert {"hbm_peak_GBps", "gemm_peak_TFLOPs", "config_table", "grid"} <= set(report["meta"])
    (row,) = report["decode"]  # the first cell always runs; the budget (0 s) skips the next one
    assert (row["batch"], row["Lq"], row["S"], row["C"]) == (1, 16, 2, 32)
    keys = {"kv_bytes", "flops", "latency_us", "hbm_fraction", "speedup_vs_sdpa", "config", "tuned_vs_default",
            "speedup_vs_sdpa_default", "tflops", "flop_fraction", "roofline_us", "roofline_fraction"}  # fmt: skip
    assert keys <= set(row)
    assert {"split_s_triton", "split_s_default", "sdpa_gathered"} <= set(row["latency_us"])
    assert row["config"]["source"] == "heuristic" and row["config"]["bucket"]["rows"] == 128
    assert row["rel_err_vs_sdpa"]["split_s_triton"] < 2e-3  # fp16 under the interpreter
    reasons = {(r["batch"], r["S"]): r["reason"] for r in report["decode_skipped"]}
    assert reasons[2, 1].startswith("time budget") and "--max-call-ms" in reasons[64, 64]
    md = (tmp_path / "attention.md").read_text()
    assert "Skipped cells (2)" in md and "h:64x64w4s2" in md
    # the ragged decode batches ride with --grid: each cell's entry point and SDPA baseline checked
    ragged = report["ragged"]
    assert [r["entries"] for r in ragged] == [3, 4] and "## Ragged decode batches" in md
    for r in ragged:
        assert set(r["latency_us"]) == {"ragged", "sdpa_gathered"} and not r["errors"]
        assert r["max_abs_err"]["ragged"] < 2e-3 and r["max_abs_err"]["sdpa_gathered"] < 2e-3


def test_cudnn_paged_ab_lists_its_cells_off_cuda(tmp_path) -> None:
    """``benchmarks/cudnn_paged_ab.py`` imports without cudnn-frontend and, off CUDA, names what it would
    time and writes nothing."""
    cmd = [sys.executable, str(ROOT / "benchmarks/cudnn_paged_ab.py"), "--smoke", "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    assert "cudnn_paged" in out and "B16 Lq96 KV32768" in out
    assert not list(tmp_path.iterdir())
