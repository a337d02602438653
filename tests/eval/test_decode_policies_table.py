"""The canonical decode-policies table: quality cells pooled over depths by samples, speed rows carried with
their case's device, every row in one schema. Plants that fail here: accuracy averaged over cells instead of
weighted by samples (the 1-sample cell would count as much as the 3-sample one), TPF as a mean of the cells'
TPFs, a serving row let into the speed rows."""

from __future__ import annotations

import json

import pytest

from benchmarks.decode_policies import FIELDS, main


def _eval_file(tmp_path):
    cells = [  # one task, one method, two depths with unequal samples, and a second threshold
        {"method": "pdllm", "decode_policy": "dual-cache", "threshold": None, "task": "long-answer",
         "context_length": 1024, "depth": 0.0, "accuracy": 1.0, "token_accuracy": 0.5, "tpf": 1.0,
         "tokens": 100, "forwards": 100, "samples": 3},
        {"method": "pdllm", "decode_policy": "dual-cache", "threshold": None, "task": "long-answer",
         "context_length": 1024, "depth": 1.0, "accuracy": 0.0, "token_accuracy": 0.1, "tpf": 3.0,
         "tokens": 30, "forwards": 10, "samples": 1},
        {"method": "pdllm", "decode_policy": "dual-cache", "threshold": 0.9, "task": "long-answer",
         "context_length": 1024, "depth": 0.0, "accuracy": 0.0, "token_accuracy": 0.2, "tpf": 2.0,
         "tokens": 40, "forwards": 20, "samples": 2},
    ]  # fmt: skip
    path = tmp_path / "long_dual.json"
    path.write_text(json.dumps({"device": "NVIDIA H200", "rows": cells}))
    return path


def _speed_file(tmp_path):
    rows = [
        {"case": "rounds", "policy": "dyllm", "method": "pdllm", "batch": 16, "context_tokens": 16384,
         "gen_length": 256, "tokens_per_s": 500.0, "tpf": 2.5, "speedup_vs_vanilla": 40.0,
         "speedup_vs_dual_cache": 1.1, "replayed": True, "cache_bytes": 123},
        {"case": "focus-batched", "policy": "focus", "method": "sdar", "model": "sdar8b-shapes-random",
         "batch": 64, "speedup_vs_plain_rounds": 0.66, "tokens_per_s": 270.9},
        {"case": "serve:none", "policy": "none", "requests_per_s": 1.2},
    ]  # fmt: skip
    cases = {"rounds": {"device": "NVIDIA H100 80GB HBM3"}, "focus-batched": {"device": "NVIDIA H200"}}
    path = tmp_path / "decode_engine.json"
    path.write_text(json.dumps({"device": "cpu", "cases": cases, "rows": rows}))
    return path


def test_quality_and_speed_rows_in_one_schema(tmp_path) -> None:
    out = tmp_path / "out"
    q, s = _eval_file(tmp_path), _speed_file(tmp_path)
    assert main(["--quality", f"judge-dream={q}", "--speed", str(s), "--out", str(out)]) == 0
    rows = json.loads((out / "decode_policies.json").read_text())["rows"]
    assert all(list(r) == list(FIELDS) for r in rows)
    quality = {r["threshold"]: r for r in rows if r["kind"] == "quality"}
    one = quality[None]
    assert one["model"] == "judge-dream" and one["samples"] == 4 and one["device"] == "NVIDIA H200"
    assert one["accuracy"] == pytest.approx((1.0 * 3 + 0.0 * 1) / 4)
    assert one["token_accuracy"] == pytest.approx((0.5 * 3 + 0.1 * 1) / 4)
    assert one["tpf"] == pytest.approx(130 / 110)
    assert quality[0.9]["tpf"] == pytest.approx(2.0) and quality[0.9]["samples"] == 2
    speed = [r for r in rows if r["kind"] == "speed"]
    assert [r["case"] for r in speed] == ["rounds", "focus-batched"]
    rounds, focus = speed
    assert rounds["model"] == "random" and rounds["replayed"] is True and rounds["cache_bytes"] == 123
    assert rounds["device"] == "NVIDIA H100 80GB HBM3" and rounds["accuracy"] is None
    assert focus["speedup_vs_plain"] == pytest.approx(0.66) and focus["model"] == "sdar8b-shapes-random"
    assert focus["replayed"] is False and focus["device"] == "NVIDIA H200"
    md = (out / "decode_policies.md").read_text()
    assert "## quality" in md and "## speed" in md and "judge-dream" in md


def test_bad_inputs_are_usage_errors(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--quality", "no-name-here", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "MODEL=PATH" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--speed", str(tmp_path / "missing.json"), "--out", str(tmp_path)])
    assert exc.value.code == 2 and "not found" in capsys.readouterr().err
