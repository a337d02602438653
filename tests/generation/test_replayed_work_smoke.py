"""``benchmarks/decode_engine.py --schedule``: the recorded work of FOCUS, DyLLM and Polestar-Cache forced in
the speed cases (``decode_cases/replay.py``'s ``Replay.knobs``), CPU smoke runs: rows carry what was forced
(``replayed_fractions``, the selected samples' mean fractions) beside what the run measured
(``measured_fractions``, ``rows_frac``), and a schedule without a policy's fractions leaves it unforced, its
rows saying so. DyLLM and Polestar from a small synthetic schedule (no recording of them is committed);
FOCUS from the SDAR judge's recorded long answers.

Planted by hand, each seen failing, then reverted: ``Replay.fractions`` taking the first sample's
fraction (not the mean) -> all 3 tests fail; the rounds' sessions built without the knobs -> the rounds test
fails; focus-batched leaving FOCUS's config unforced (the knobs dropped) -> the focus-batched test fails.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import pytest

from benchmarks.decode_cases.replay import Replay
from benchmarks.decode_engine import main
from benchmarks.e2e_speedup import QUERY_TOKENS
from benchmarks.shapes import tiny
from pdllm.shared.generation.schedule import write_schedules

ROOT = Path(__file__).resolve().parents[2]
JUDGE = ROOT / "benchmarks/results/decode_policies_quality/judge_sdar/sched_long-answer_focus.json"
# (policy, fractions) per synthetic sample; a "none" sample records no fractions
WORK = [
    ("dyllm", {"salient_frac": 0.42, "ffn_frac": 0.4}),
    ("dyllm", {"salient_frac": 0.5, "ffn_frac": 0.5}),
    ("polestar", {"recomputed_rows_per_update_layer": 2.5, "updates_per_forward": 0.3}),
    ("none", {}),
]


def synthetic(path: Path) -> Path:
    samples = [
        {"method": "vanilla", "decode_policy": policy, "threshold": 0.9, "task": "long-answer", "seed": i,
         "gen_length": 16, "block_length": 8, "steps": [[2, 1, 1, 2, 2], [1, 3, 2, 2]], "tokens": 16,
         "forwards": 9, "tpf": 1.78, "policy_stats": {}, "fractions": fractions}
        for i, (policy, fractions) in enumerate(WORK)
    ]  # fmt: skip
    write_schedules(path, {"model": "synthetic"}, samples)
    return path


def test_replay_takes_the_mean_recorded_fractions(tmp_path: Path) -> None:
    replay = Replay.load(synthetic(tmp_path / "s.json"), None)
    assert replay.fractions("dyllm") == {"ffn_frac": 0.45}  # the mean over the samples holding it
    assert replay.knobs("dyllm") == {"replay_ffn_frac": 0.45}
    assert replay.knobs("polestar") == {
        "replay_rows_per_update_layer": 2.5,
        "replay_updates_per_forward": 0.3,
    }
    assert replay.knobs("focus") == replay.knobs("dual-cache") == {}
    counters = {"policy": "focus", "forwards": 4, "rows_forwarded": 30, "rows_plain": 40}
    assert replay.sparsity("focus", [counters, counters], 4) == {
        "replayed_fractions": None,
        "sparsity": "own: the schedule records no focus fractions",
        "measured_fractions": {"retained_frac": 0.75},
    }
    assert replay.sparsity("dual-cache", [], 4) == {}
    only = Replay.load(tmp_path / "s.json", "decode_policy=polestar")
    assert only.knobs("dyllm") == {} and "polestar {'recomputed_rows_per_update_layer': 2.5" in only.note()


def _ceil(share: float, rows: int) -> int:
    return math.ceil(Fraction(str(share)) * rows)


def test_rounds_rows_replay_recorded_dyllm_and_polestar_work(tmp_path: Path) -> None:
    """DyLLM's SparseSteps choose ``ceil(f x queried rows)`` salient rows per layer (its FFN-row counter, from
    its step counts), each Polestar update recomputes ``ceil(r)`` rows per layer and updates run at most at
    the recorded rate; the report shows forced -> measured."""
    schedule = synthetic(tmp_path / "s.json")
    argv = ["--smoke", "--cases", "rounds", "--rounds-policies", "dyllm,polestar", "--batches", "1,3"]
    assert main([*argv, "--schedule", str(schedule), "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "decode_engine.json").read_text())
    assert data["cases"]["rounds+replayed"]["errors"] == []
    rows = data["rows"]
    assert {(r["policy"], r["method"], r["batch"]) for r in rows} == {
        (p, m, b) for p in ("dyllm", "polestar") for m in ("vanilla", "pdllm") for b in (1, 3)
    }
    layers = tiny().num_layers
    for r in rows:
        assert r["replayed"] is True and r["sparsity"] == "replayed"
        measured = r["measured_fractions"]
        if r["policy"] == "polestar":
            assert r["replayed_fractions"] == {
                "recomputed_rows_per_update_layer": 2.5,
                "updates_per_forward": 0.3,
            }
            assert (
                measured["recomputed_rows_per_update_layer"] == 3.0
            )  # ceil(2.5) at every layer of every update
            assert 0 < measured["updates_per_forward"] <= 0.3
            continue
        assert r["replayed_fractions"] == {"ffn_frac": 0.45}
        c = r["cache"]  # request 0's counters
        n = c["rows_total"] // (c["forwards"] * layers)  # its local rows
        response = r["gen_length"] + 1  # Dream: the response and the row before it
        sparse, short = c["forwards"] - c["full_steps"], c["response_only_steps"]
        per_layer = c["full_steps"] * n + (sparse - short) * _ceil(0.45, n) + short * _ceil(0.45, response)
        assert c["rows_forwarded"] == layers * per_layer
        if r["method"] == "vanilla":
            assert n == 1 + 48 + QUERY_TOKENS + r["gen_length"]
        if r["batch"] == 1:  # the measured share pools every request's counters
            assert measured["ffn_frac"] == round(c["rows_forwarded"] / c["rows_total"], 4)
    md = (tmp_path / "decode_engine.md").read_text()
    assert "ffn_frac 0.450 -> " in md and "recomputed_rows_per_update_layer 2.500 -> 3.000" in md


def test_focus_batched_rows_replay_the_judges_retained_share(tmp_path: Path) -> None:
    """The SDAR judge's long answers (``method=vanilla``): FOCUS forced to their mean retained share
    forwards more rows than FOCUS's own choices at the same schedule; a copy of the file without its
    fractions leaves FOCUS unforced, and its rows say so."""
    stripped = json.loads(JUDGE.read_text())
    want = [s["fractions"]["retained_frac"] for s in stripped["samples"] if s["method"] == "vanilla"]
    for s in stripped["samples"]:
        s["fractions"] = {}
    (tmp_path / "own.json").write_text(json.dumps(stripped))
    fracs = {}
    for name, path in (("forced", JUDGE), ("own", tmp_path / "own.json")):
        out = tmp_path / name
        argv = ["--smoke", "--cases", "focus-batched", "--focus-batches", "3", "--focus-gen", "32"]
        assert (
            main([*argv, "--schedule", str(path), "--schedule-select", "method=vanilla", "--out", str(out)])
            == 0
        )
        rows = json.loads((out / "decode_engine.json").read_text())["rows"]
        for r in rows:
            if r["policy"] == "plain-rounds":
                assert "replayed_fractions" not in r
                continue
            assert r["measured_fractions"] == {"retained_frac": round(r["rows_frac"], 4)}
            if name == "forced":
                assert r["sparsity"] == "replayed"
                assert r["replayed_fractions"] == {"retained_frac": round(sum(want) / len(want), 4)}
            else:
                assert r["replayed_fractions"] is None and r["sparsity"].startswith("own: ")
            fracs[name, r["policy"]] = r["rows_frac"]
    for policy in ("focus-rounds", "focus-rounds-eager-layers"):
        assert fracs["forced", policy] > fracs["own", policy]
    assert fracs["forced", "focus-rounds"] == pytest.approx(fracs["forced", "focus-rounds-eager-layers"])
