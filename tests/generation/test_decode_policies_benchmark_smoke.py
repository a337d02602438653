"""``benchmarks/decode_policies.py --smoke`` on CPU (tiny model): the report's JSON shape, the speedups'
baselines, vanilla probes, and the time budget skipping cells with a recorded reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.decode_policies import ROW_KEYS, main

POLICIES = {"none", "prefix-cache", "dual-cache", "sparse-dllm", "polestar"}


def test_smoke_writes_every_policy_row(tmp_path: Path) -> None:
    assert main(["--smoke", "--gens", "8,16", "--vanilla-share", "0", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "decode_policies.json").read_text())
    assert set(data) == {"device", "rows", "meta"} and data["device"] == "cpu"
    meta = data["meta"]
    assert {"date", "command", "device", "runs", "skipped", "errors"} <= set(meta) and meta["errors"] == []
    rows = data["rows"]
    assert all(tuple(r) == ROW_KEYS and r["batch"] == 1 and r["tokens_per_s"] > 0 for r in rows)
    cells = {(r["method"], r["context_tokens"], r["gen_length"]) for r in rows}
    assert cells == {
        (m, c, g) for m, c in (("vanilla", 48), ("pdllm", 384), ("vanilla", 384)) for g in (8, 16)
    }
    for method, context, gen in cells:
        policies = {r["policy"]: r for r in rows if (r["method"], r["context_tokens"], r["gen_length"]) ==
                    (method, context, gen)}  # fmt: skip
        want = {"none", "dual-cache"} if (method, context) == ("vanilla", 384) else POLICIES
        assert set(policies) == want
        assert policies["dual-cache"]["speedup_vs_dual_cache"] == pytest.approx(1.0)
        vanilla = next(r for r in rows if (r["policy"], r["method"], r["context_tokens"], r["gen_length"]) ==
                       ("none", "vanilla", context, gen))  # fmt: skip
        for r in policies.values():
            assert r["speedup_vs_vanilla"] == pytest.approx(r["tokens_per_s"] / vanilla["tokens_per_s"])
    runs = meta["runs"]
    assert all(
        r["timing"].startswith("probe") for r in runs if (r["policy"], r["method"]) == ("none", "vanilla")
    )
    assert all(r["timing"] == "full" for r in runs if r["method"] == "pdllm" or r["policy"] != "none")
    sparse = [r for r in runs if r["policy"] == "sparse-dllm"]
    assert all(r["cache"]["refreshes"] == r["gen_length"] // 8 for r in sparse)  # one cache per block
    assert [s["batch"] for s in meta["skipped"]] == [16]
    md = (tmp_path / "decode_policies.md").read_text()
    assert "CPU SMOKE" in md and "| pdllm | 384 | 16 | sparse-dllm |" in md and "whole prompt" in md
    assert (tmp_path / "decode_policies.png").stat().st_size > 0


def test_no_budget_skips_every_cell_with_a_reason(tmp_path: Path) -> None:
    assert main(["--smoke", "--gens", "8", "--budget-s", "0", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "decode_policies.json").read_text())
    assert data["rows"] == [] and data["meta"]["runs"] == []
    skipped = data["meta"]["skipped"]
    assert len(skipped) == 5 + 5 + 2 + 1  # the three cells' policies, then batch 16
    assert all(s["reason"].startswith("time budget") for s in skipped[:-1])
    assert "| method |" in (tmp_path / "decode_policies.md").read_text()
