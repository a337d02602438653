"""``benchmarks/serving.py --smoke`` end to end on CPU: real serve processes, the report's exact schema."""

from __future__ import annotations

import json
import math

import torch

from benchmarks.serve_load import Clock, documents, smoke_config, wait_routable, write_checkpoint
from benchmarks.serving import DIAG_KEYS, ROW_KEYS, burst, main, start_layout
from pdllm.shared.model.loader import load_tokenizer

TOP_KEYS = {"device", "date", "command", "rows", "decode_round", "meta"}
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
    md = (tmp_path / "serving.md").read_text()
    assert "CPU SMOKE" in md and "| all-in-one | 0 | 4 | 2048 |" in md and "round_ms" in md
    assert (tmp_path / "serving.png").stat().st_size > 0


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
