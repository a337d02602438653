"""``benchmarks/decode_compute_skip.py --smoke`` on CPU (tiny models): every run's row, its baselines, and
``--merge`` putting the rows into ``decode_policies.{json,md}`` (replacing the script's earlier ones)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.decode_compute_skip import MARK, ROW_KEYS, main


def test_smoke_rows_baselines_and_merge(tmp_path: Path) -> None:
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    run = json.loads((tmp_path / "decode_compute_skip_smoke.json").read_text())
    rows = run["rows"]
    assert not [r for r in rows if "error" in r]
    single = {r["policy"]: r for r in rows if not r.get("batched")}
    assert set(single) == {"none", "dual-cache", "dyllm", "focus"}  # dyllm+graphs: CUDA only
    for r in single.values():
        assert r["speedup_vs_vanilla"] == pytest.approx(r["tokens_per_s"] / single["none"]["tokens_per_s"])
        assert r["speedup_vs_dual_cache"] == pytest.approx(
            r["tokens_per_s"] / single["dual-cache"]["tokens_per_s"]
        )
    batched = [r for r in rows if r.get("batched")]
    assert {(r["policy"], r["batch"]) for r in batched} == {
        (p, b) for p in ("plain-batched", "focus") for b in (1, 3)
    }
    for r in batched:
        plain = next(p for p in batched if p["policy"] == "plain-batched" and p["batch"] == r["batch"])
        assert r["speedup_vs_vanilla"] == pytest.approx(r["tokens_per_s"] / plain["tokens_per_s"])
        assert r["rows_frac"] <= 1.0 and (r["policy"] != "plain-batched" or r["rows_frac"] == 1.0)
    into = tmp_path / "decode_policies.json"
    into.write_text(json.dumps({"device": "x", "rows": [{"policy": "none", "source": "other"}]}))
    (tmp_path / "decode_policies.md").write_text("# table\n")
    for _ in range(2):  # a second merge replaces the first one's rows and section
        assert main(["--merge", str(tmp_path / "decode_compute_skip_smoke.json")]) == 0
    merged = json.loads(into.read_text())
    assert merged["rows"][0] == {"policy": "none", "source": "other"}
    assert len(merged["rows"]) == 1 + len(rows)
    assert all(set(ROW_KEYS) <= set(r) for r in merged["rows"][1:])
    md = (tmp_path / "decode_policies.md").read_text()
    assert md.startswith("# table\n") and md.count(MARK) == 1
