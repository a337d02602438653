"""Skinny GEMMs: where they are chosen (:func:`pick_config`), bad inputs refused before any launch, and the
benchmark's smoke run. Values against the references are checked under the interpreter
(``interpreter_cases.py skinny_gemm`` and ``model_fused``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from pdllm.kernels.skinny_gemm import MAX_ROWS, SkinnyConfig, pick_config, skinny_linear, skinny_silu_mul

ROOT = Path(__file__).resolve().parents[2]


def test_pick_config_takes_the_measured_projections_only() -> None:
    hidden, inter, qkv = 3584, 18944, 4608  # Dream-7B
    gate_up = pick_config(56, inter, hidden, glu=True)
    assert gate_up == SkinnyConfig(block_n=64, block_k=128, split=1, num_stages=4)
    down = pick_config(56, hidden, inter, glu=False)
    assert (
        down is not None and down.split == 2 and (hidden % down.block_n, inter % (down.block_k * 2)) == (0, 0)
    )
    assert pick_config(56, qkv, hidden, glu=False) is None  # measured within ±3% of cuBLAS: stays there
    assert pick_config(56, hidden, hidden, glu=False) is None
    assert pick_config(MAX_ROWS + 1, inter, hidden, glu=True) is None  # batched rounds: cuBLAS
    assert pick_config(0, inter, hidden, glu=True) is None
    assert pick_config(8, 100, 64, glu=True) is None  # no tile divides N


def test_bad_inputs_are_refused_before_launch() -> None:
    cfg = SkinnyConfig(block_n=16, block_k=16)
    w = torch.zeros(32, 64)
    with pytest.raises(ValueError, match="at most 64 rows"):
        skinny_linear(torch.zeros(MAX_ROWS + 1, 64), w, config=cfg)
    with pytest.raises(ValueError, match="does not tile"):
        skinny_linear(torch.zeros(4, 64), w, config=SkinnyConfig(block_n=64, block_k=16))
    with pytest.raises(ValueError, match="dtype"):
        skinny_linear(torch.zeros(4, 64, dtype=torch.bfloat16), w, config=cfg)
    with pytest.raises(ValueError, match="residual"):
        skinny_linear(torch.zeros(4, 64), w, residual=torch.zeros(4, 31), config=cfg)
    with pytest.raises(ValueError, match="split must be 1"):
        skinny_silu_mul(torch.zeros(4, 64), w, SkinnyConfig(block_n=16, block_k=16, split=2))
    with pytest.raises(ValueError, match="no skinny config"):
        skinny_linear(torch.zeros(4, 64), w)  # too small a projection for the default pick


def test_benchmark_smoke(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks import skinny_gemm

    assert skinny_gemm.main(["--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "skinny_gemm.json").read_text())
    names = [r["projection"] for r in report["rows"]]
    assert names == ["qkv", "o", "gate_up+silu", "down+residual"]
    assert all(r["rel_err_vs_before"] < 1e-5 for r in report["rows"])
    assert report["rows"][2]["skinny_config"] is not None  # tiny gate/up still tiles: the SwiGLU path ran
    assert "Per decoder layer" in (tmp_path / "skinny_gemm.md").read_text()
