"""``benchmarks/serve_load.py --smoke`` end to end on CPU: real serve processes, every request answered."""

from __future__ import annotations

import json
import math

from benchmarks.serve_load import main


def test_serve_load_smoke_writes_every_scenario_and_ratio(tmp_path) -> None:
    assert (
        main(["--smoke", "--out", str(tmp_path), "--ckpt-dir", str(tmp_path / "ckpt"), "--budget-s", "120"])
        == 0
    )
    data = json.loads((tmp_path / "serve_load_smoke.json").read_text())
    rows, ratios, meta = data["rows"], data["ratios"], data["meta"]
    assert meta["smoke"] and meta["skipped"] == [] and meta["concurrency"] == 4
    assert set(rows) == {"in_process_single", "all_single", "all_load", "split_load"}
    for key in ("in_process_single", "all_single"):
        assert len(rows[key]["seconds"]) == 3 and rows[key]["median_s"] > 0
    # The service answers exactly what the in-process engine answers, and the split what the all-in-one does.
    assert rows["all_single"]["answers_equal_in_process"] is True
    assert rows["split_load"]["answers_equal_all_in_one"] == "4/4"
    for key in ("all_load", "split_load"):
        r = rows[key]
        assert (r["requests"], r["ok"], r["failed"]) == (4, 4, 0), r["errors"]
        assert r["requests_per_s"] > 0 and r["tokens_per_s"] > 0 and r["partials_min"] == 8
        assert 0 < r["ttft_s"]["p50"] <= r["latency_s"]["max"] and r["step_ms"]["p50"] > 0
    assert rows["split_load"]["decode_step_ms_metric"] > 0
    for name in ("service_overhead", "split_vs_all_throughput"):
        assert math.isfinite(ratios[name]["value"]) and isinstance(ratios[name]["met"], bool)
    md = (tmp_path / "serve_load_smoke.md").read_text()
    assert "CPU SMOKE" in md and "split / all-in-one throughput" in md and "| 4. split" in md
