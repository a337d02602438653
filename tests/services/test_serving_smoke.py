"""``benchmarks/serving.py --smoke`` end to end on CPU: real serve processes, the report's exact schema; the
split layout against the all-in-one and the single-request service overhead over the in-process engine."""

from __future__ import annotations

import json
import math

import torch

from benchmarks.serving import (
    DIAG_KEYS,
    ROW_KEYS,
    Clock,
    burst,
    documents,
    main,
    smoke_config,
    start_layout,
    wait_routable,
    write_checkpoint,
)
from pdllm.shared.model.loader import load_tokenizer

TOP_KEYS = {"device", "date", "command", "rows", "ratios", "overhead", "decode_round", "meta"}
POSITIVE = ("requests", "requests_per_s", "gen_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "step_p50_ms",
            "step_p99_ms", "unloaded_step_ms")  # fmt: skip


def test_serving_smoke_sweep_writes_schema_and_skips_two_gpu_layouts(tmp_path) -> None:
    rounds = tmp_path / "decode_rounds.json"
    rounds.write_text(json.dumps({"device": "x", "decode_round": [{"active": 1, "round_ms": 2.5}]}))
    argv = ["--smoke", "--out", str(tmp_path), "--ckpt-dir", str(tmp_path / "ckpt"), "--budget-s", "45",
            "--layouts", "all-in-one,replicas,1p1d-build-on-decode", "--decode-round-json", str(rounds)]  # fmt: skip
    assert main(argv) == 0
    data = json.loads((tmp_path / "serving.json").read_text())
    assert set(data) == TOP_KEYS and data["device"] == "cpu"
    assert data["decode_round"] == [{"active": 1, "round_ms": 2.5}]
    meta = data["meta"]
    assert meta["errors"] == [], meta["errors"]
    assert meta["warm_burst"] == "concurrency of each cell"
    assert {s["layout"] for s in meta["skipped"]} == {"replicas", "1p1d-build-on-decode"}
    rows = data["rows"]
    assert [(r["layout"], r["concurrency"], r["context_tokens"]) for r in rows] == [
        ("all-in-one", 1, 2048),
        ("all-in-one", 4, 2048),
    ]
    for r in rows:
        assert tuple(r) == ROW_KEYS + DIAG_KEYS
        assert sum(r["kv_sources"].values()) == r["requests"]  # every answered request names one
        assert r["requests"] == 4 and r["failed"] == 0
        for key in POSITIVE:
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert r["ttft_p50_s"] <= r["ttft_p99_s"] and r["step_p50_ms"] <= r["step_p99_ms"]
        assert math.isfinite(r["peak_gib"]) and r["peak_gib"] >= 0  # CPU: an RSS delta, may be 0
        assert r["decode_step_ms_worker"] > 0 and r["answers_equal_all_in_one"] is None
        assert r["workload"] == "unique" and r["hit_rate"] == 0.0  # every request its own document
    assert data["ratios"] == [] and data["overhead"] is None
    md = (tmp_path / "serving.md").read_text()
    assert "CPU SMOKE" in md and "| all-in-one | unique | 0 | 4 | 2048 |" in md and "round_ms" in md
    assert (tmp_path / "serving.png").stat().st_size > 0


def test_reuse_workload_serves_returning_documents_from_the_chunk_tier(tmp_path) -> None:
    """Three documents, requests Zipf over them after a warm-up that reads each twice (the default write
    policy stores a document whole from its second request on): every chunk a hit."""
    argv = ["--smoke", "--out", str(tmp_path), "--ckpt-dir", str(tmp_path / "ckpt"), "--budget-s", "60",
            "--workloads", "reuse", "--documents", "3", "--reuse-requests", "6", "--concurrency", "2"]  # fmt: skip
    assert main(argv) == 0
    data = json.loads((tmp_path / "serving.json").read_text())
    assert data["meta"]["errors"] == [], data["meta"]["errors"]
    (row,) = data["rows"]
    assert (row["workload"], row["concurrency"], row["requests"], row["failed"]) == ("reuse", 2, 6, 0)
    assert row["hit_rate"] == 1.0
    assert "| all-in-one | reuse | 0 | 2 | 2048 |" in (tmp_path / "serving.md").read_text()


def test_replicas_layout_routes_on_cpu(tmp_path) -> None:
    """The 2-GPU layouts are skipped on CPU by ``main``; their process wiring still starts and answers."""
    torch.set_num_threads(1)
    ckpt = tmp_path / "ckpt"
    write_checkpoint(smoke_config(), ckpt, torch.device("cpu"), "float32", {"chunk_size": 256, "top_k": 3})
    docs = documents(load_tokenizer(ckpt), 2048, 5, seed=7)
    env = lambda g: {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # noqa: E731
    worker = [
        "--model",
        str(ckpt),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--port",
        "0",
        "--metrics-port",
        "0",
    ]
    procs: list = []
    clock = Clock(40)
    try:
        address = start_layout("replicas", worker, worker[:2] + worker[-4:], env, procs, clock)
        assert [p.role for p in procs] == ["prefill", "prefill", "decode", "decode", "router"]
        wait_routable(address, docs[0], 8, clock, 30)  # until the router's health checks pass
        b = burst(address, docs[1:], 8, 4, clock)
        assert b["errors"] == [] and len(b["ok"]) == 4
    finally:
        for p in procs:
            p.kill()


def test_split_against_all_in_one_and_service_overhead(tmp_path) -> None:
    """What a split prefill/decode deployment is compared with: the all-in-one on the same documents (same
    answers on CPU's fp32), and a served single request against the in-process engine."""
    argv = ["--smoke", "--out", str(tmp_path), "--ckpt-dir", str(tmp_path / "ckpt"), "--budget-s", "90",
            "--layouts", "all-in-one,1p1d-build-on-decode", "--share-gpu", "--concurrency", "4",
            "--warm-burst", "2", "--single-repeats", "3", "--name", "split"]  # fmt: skip
    assert main(argv) == 0
    data = json.loads((tmp_path / "split.json").read_text())
    meta = data["meta"]
    assert meta["errors"] == [] and meta["skipped"] == [], meta
    rows = {r["layout"]: r for r in data["rows"]}
    assert set(rows) == {"all-in-one", "1p1d-build-on-decode"}
    for r in rows.values():
        assert (r["requests"], r["failed"]) == (4, 0) and r["decode_step_ms_worker"] > 0
        assert 0 < r["ttft_p50_s"] <= r["latency_max_s"]
    assert rows["1p1d-build-on-decode"]["answers_equal_all_in_one"] == "4/4"
    (ratio,) = data["ratios"]
    assert ratio["layout"] == "1p1d-build-on-decode" and ratio["target_min"] == 1.7
    assert math.isfinite(ratio["vs_all_in_one"]) and isinstance(ratio["met"], bool)
    o = data["overhead"]
    assert o["requests"] == 3 and len(o["in_process"]["seconds"]) == len(o["served"]["seconds"]) == 3
    assert o["answers_equal_in_process"] is True and math.isfinite(o["service_overhead"])
    md = (tmp_path / "split.md").read_text()
    assert (
        "vs all-in-one" in md
        and "service overhead" in md
        and "| 1p1d-build-on-decode | unique | 2048 | 4 |" in md
    )
