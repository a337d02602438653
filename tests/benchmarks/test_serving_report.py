"""``benchmarks/serving_report.py``: serving.py runs merged into one report. Rows carry their run; ratios and
four-GPU targets never compare rows of two runs; a later file replaces the same cell; the simulator fills
``sim_req_s`` of split rows only; a merged report is an input like a run (its runs kept)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.serving import ROW_KEYS
from benchmarks.serving_report import main, merge, parse_input

META = {"smoke": False, "model": {"hidden_size": 64, "num_hidden_layers": 2}, "dtype": "bfloat16",
        "engine": {"chunk_size": 1024, "top_k": 4}, "gen_length": 32, "steps": 32, "serve_flags": [],
        "warm_burst": 1, "requests_per_cell": "max(c, 4)", "gpus_visible": 4, "budget_s": 100.0,
        "runtime_s": 50.0, "skipped": [], "errors": []}  # fmt: skip


def _row(
    layout: str, gpus: int, rps: float, conc: int = 64, ctx: int = 16384, sim: float | None = None
) -> dict:
    row = {k: 1.0 for k in ROW_KEYS}
    row.update(layout=layout, workload="unique", gpus=gpus, concurrency=conc, context_tokens=ctx,
               requests=max(conc, 4), failed=0, requests_per_s=rps, unloaded_step_ms=8.0, step_p99_ms=12.0,
               shared_gpu=False, sim_req_s=sim)  # fmt: skip
    return row


def _run(path: Path, device: str, rows: list[dict], date: str = "2026-01-01T00:00:00+00:00") -> Path:
    path.write_text(json.dumps({"device": device, "date": date, "command": f"python benchmarks/serving.py # {device}",
                                "rows": rows, "ratios": [], "overhead": None, "decode_round": [], "meta": META}))  # fmt: skip
    return path


def test_rows_are_tagged_with_their_run(tmp_path) -> None:
    a = _run(tmp_path / "serving_a.json", "GPU-A", [_row("all-in-one", 1, 1.0), _row("replicas", 2, 2.0)])
    b = _run(tmp_path / "b.json", "GPU-B", [_row("all-in-one", 1, 3.0)], date="2026-02-02T00:00:00+00:00")
    assert main(["--out", str(tmp_path / "out"), str(a), f"bee={b}"]) == 0
    report = json.loads((tmp_path / "out" / "serving.json").read_text())
    assert list(report["runs"]) == ["a", "bee"]  # the stem less serving_, or the name given
    assert [(r["run"], r["device"], r["date"][:7]) for r in report["rows"]] == [
        ("a", "GPU-A", "2026-01"), ("a", "GPU-A", "2026-01"), ("bee", "GPU-B", "2026-02")]  # fmt: skip
    assert report["runs"]["bee"]["command"] == "python benchmarks/serving.py # GPU-B"
    assert (
        report["runs"]["a"]["meta"]["gpus_visible"] == 4 and report["runs"]["a"]["file"] == "serving_a.json"
    )
    md = (tmp_path / "out" / "serving.md").read_text()
    assert "| a | GPU-A | 2026-01-01 | all-in-one, replicas | 16K | 2.00 (replicas, unique, c=64) |" in md
    assert "## a — GPU-A, 2026-01-01" in md and "## bee — GPU-B, 2026-02-02" in md
    assert (tmp_path / "out" / "serving.png").stat().st_size > 0
    assert parse_input("x=y/z.json") == ("x", Path("y/z.json")) and parse_input("y/z.json") == (
        None,
        Path("y/z.json"),
    )


def test_ratios_and_targets_never_compare_rows_of_two_runs(tmp_path) -> None:
    """Run b has four-GPU rows but no all-in-one: nothing to compare them with, whatever run a has."""
    a = _run(tmp_path / "a.json", "GPU-A", [_row("all-in-one", 1, 1.0), _row("replicas", 2, 2.0)])
    b = _run(tmp_path / "b.json", "GPU-B", [_row("all-in-one", 1, 4.0, conc=16), _row("replicas", 2, 6.0),
                                            _row("replicas4", 4, 5.0), _row("3p1d", 4, 4.5, sim=4.5)])  # fmt: skip
    report = merge([(None, a), (None, b)])
    assert {(x["run"], x["layout"]): x["vs_all_in_one"] for x in report["ratios"]} == {("a", "replicas"): 2.0}
    assert report["runs"]["a"]["meta"]["targets_x4"] == [] and report["runs"]["b"]["meta"]["targets_x4"] == []


def test_a_later_file_replaces_the_same_cell(tmp_path) -> None:
    first = _run(
        tmp_path / "1.json", "GPU-A", [_row("all-in-one", 1, 1.0, conc=1), _row("all-in-one", 1, 1.5)]
    )
    again = _run(tmp_path / "2.json", "GPU-A", [_row("all-in-one", 1, 1.7)], date="2026-03-03T00:00:00+00:00")
    report = merge([("a", first), ("a", again)])
    assert [(r["concurrency"], r["requests_per_s"], r["date"][:7]) for r in report["rows"]] == [
        (1, 1.0, "2026-01"), (64, 1.7, "2026-03")]  # fmt: skip
    # a merged report is an input too: its runs stay, the new one joins
    assert main(["--out", str(tmp_path), "--name", "m", f"a={first}"]) == 0
    other = _run(tmp_path / "3.json", "GPU-C", [_row("all-in-one", 1, 9.0)])
    assert main(["--out", str(tmp_path), "--name", "m2", str(tmp_path / "m.json"), f"c={other}"]) == 0
    merged = json.loads((tmp_path / "m2.json").read_text())
    assert list(merged["runs"]) == ["a", "c"] and [r["run"] for r in merged["rows"]] == ["a", "a", "c"]


def test_sim_req_s_is_filled_for_split_rows_only(tmp_path) -> None:
    """The committed costs (16K, 32K) give NpMd built on one side a value; not the all-in-one, replicas,
    -auto or a context the costs never measured; a value the run had is kept."""
    rows = [_row("all-in-one", 1, 1.0), _row("replicas4", 4, 4.0), _row("3p1d", 4, 3.0), _row("2p2d-auto", 4, 3.0),
            _row("2p2d", 4, 2.0, ctx=2048), _row("2p2d", 4, 2.5, sim=7.0)]  # fmt: skip
    report = merge([(None, _run(tmp_path / "x4.json", "NVIDIA H200", rows))])
    sims = {(r["layout"], r["context_tokens"]): r["sim_req_s"] for r in report["rows"]}
    assert sims.pop(("3p1d", 16384)) > 0 and sims.pop(("2p2d", 16384)) == 7.0
    assert set(sims.values()) == {None}
    meta = report["runs"]["x4"]["meta"]
    assert meta["sim_costs"]["rows"] == ["3p1d unique 16384 c64"]
    assert "H100" in meta["sim_costs"]["costs"] and "NVIDIA H200" in meta["sim_costs"]["costs"]
    (t,) = meta["targets_x4"]  # the filled value reaches the run's four-GPU targets
    assert set(t["sim_error"]) == {"3p1d", "2p2d"}
