"""``benchmarks/kernel_check.py --smoke`` under the Triton interpreter: every section runs at tiny shapes, the
launchers' own configs pass their references, and a forced 2 KB limit takes the reference / cuBLAS paths."""

from __future__ import annotations

import json
from pathlib import Path

from tests.interpreter import run_under_interpreter

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_check.py"


def test_kernel_check_smoke(tmp_path: Path) -> None:
    run_under_interpreter(SCRIPT, "--smoke", "--out", str(tmp_path), timeout_s=300)
    rows = json.loads((tmp_path / "kernel_check.json").read_text())["rows"]
    assert rows and all(r["ok"] for r in rows)
    sections = {r["section"] for r in rows}
    assert {"model shapes", "model forward", "forced limit 65536", "forced limit 2048"} <= sections
    shapes = [r for r in rows if r["section"] == "model shapes"]
    assert {r["dtype"] for r in shapes} == {"float32", "float16"}
    kernels = {r["kernel"] for r in shapes if r["path"] == "triton"}
    assert {
        "split_s_attention",
        "skinny_silu_mul",
        "rms_norm",
        "rope",
        "silu_mul",
        "retention_scores",
    } <= kernels
    starved = [r for r in rows if r["section"] == "forced limit 2048"]
    assert starved and {r["path"] for r in starved} <= {"reference", "cublas"}
    assert any(r["path"] == "reference" for r in starved)
    assert (tmp_path / "kernel_check.md").read_text().count("| yes |") == len(rows)


def test_eval_answer_reads_the_accuracy_table_only() -> None:
    """The CLI check's summary of ``pdllm eval``: exact-match cells, not the tokens-per-forward table after."""
    from benchmarks.kernel_check import _answer

    report = "\n".join([
        "# Long-context retrieval", "## needle (exact match, %)", "| method | threshold | length | 50% | mean |",
        "| pdllm | 1/step | 512 | 100 | 100.0 |", "| vanilla | 1/step | 512 | 0 | 0.0 |",
        "## needle (tokens per forward)", "| method | threshold | length | 50% | all |",
        "| pdllm | 1/step | 512 | 0.75 | 0.75 |",
    ])  # fmt: skip
    assert _answer("eval-default-dtype", report) == "pdllm@512=100.0% vanilla@512=0.0%"
