"""benchmarks/kv_move_vs_recompute.py: the smoke run writes the expected rows, and moving the full-mask
decode KV through the KV tier (Redis and the CPU store) gives back exactly the KV the build produced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.kv_move_vs_recompute import DATA, main, move_once, segment_keys
from pdllm.decode_service.worker import DecodeWorker
from pdllm.shared.config import EngineConfig
from pdllm.shared.kv_tier import CPUStore, CPUStoreConfig, KVMeta, RedisStore, RedisStoreConfig
from pdllm.shared.layout import decode_layout, make_request
from pdllm.shared.model.loader import load_model


def test_smoke_writes_rows(tmp_path: Path) -> None:
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "kv_move_vs_recompute.json").read_text())
    meta, rows = data["meta"], data["rows"]
    assert meta["smoke"] and meta["device"] and meta["date"] and "--smoke" in meta["command"]
    shipped = [r for r in rows if r["setting"] == "shipped-cpu-measured"]
    assert [(r["chunk_size"], r["top_k"]) for r in shipped] == [(256, 1), (256, 3)]
    for r in shipped:
        assert r["redis_lossless"] and r["cpu_lossless"] and r["format_lossless"]
        assert r["recompute_s"] > 0 and r["redis_put_s"] > 0 and r["redis_get_s"] > 0 and r["cpu_move_s"] > 0
        assert r["segments"] == r["top_k"] == len(r["selected"])
        assert r["kv_bytes"] == r["static_tokens"] * r["kv_bytes_per_token"] < r["encoded_bytes"]
        assert r["kv_bytes_per_token"] == 8 * 2 * 2 * 32 * 4  # shipped model, fp32
    dream = [r for r in rows if r["setting"] == "dream7b-estimate"]
    assert [r["top_k"] for r in dream] == [1, 2, 4, 8, 16, 32, 64]
    for r in dream:
        assert r["kv_bytes_per_token"] == 28 * 2 * 4 * 128 * 2  # Dream-7B, bf16
        assert r["static_tokens"] == r["top_k"] * 1025
        assert r["recompute_est_s"] > 0 and r["move_redis_est_s"] > r["move_ideal_est_s"] > 0
    assert all(m["redis_lossless"] and m["cpu_lossless"] for m in data["dream_measured"])
    assert meta["assumptions"]["gpu_tflops"] == 700.0
    md = (tmp_path / "kv_move_vs_recompute.md").read_text()
    assert "| 256 | 3 |" in md and "ESTIMATES" in md and meta["command"] in md


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moved_kv_equals_built_kv(redis_server: str, dtype: str) -> None:
    """The real claim behind 'move': what decode reads back is bit for bit the KV the build produced."""
    loaded = load_model(None, dtype=dtype)
    cfg = EngineConfig(chunk_size=128, top_k=2, kv_mode="full-mask")
    worker = DecodeWorker(loaded.model, cfg)
    tok = loaded.tokenizer
    context = tok.encode((DATA / "demo_document.txt").read_text(encoding="utf-8"), add_special_tokens=False)[
        :500
    ]
    question = json.loads((DATA / "demo_question.json").read_text())["question"]
    request = make_request(
        context,
        tok.encode(question, add_special_tokens=False),
        loaded.config.bos_token_id,
        cfg,
        loaded.config.vocab_size,
    )
    layout = decode_layout(request, [0, 2], gen_length=8)
    static = worker.build(request, layout)
    built = [s.contiguous() for s in static.segments]
    assert len(built) == 2 and built[0].dtype == getattr(torch, dtype)
    meta = KVMeta.from_model_config(loaded.config, built[0].dtype)
    ids = request.chunks[0] + request.chunks[2] + request.query + [loaded.config.mask_token_id] * 8
    keys = segment_keys(meta, cfg.chunk_size, ids, len(built))
    assert len(set(keys)) == len(keys)
    redis = RedisStore(RedisStoreConfig(redis_server, ttl_s=None, part_bytes=64 << 10), meta)  # multi-part
    cpu = CPUStore(CPUStoreConfig(capacity_bytes=1 << 30, pin_memory=False))
    try:
        for store in (redis, cpu):
            got = move_once(store, keys, built).got
            for b, g in zip(built, got, strict=True):
                assert g is not None and g.dtype == b.dtype and g.shape == b.shape
                assert g.data_ptr() != b.data_ptr()  # a copy came back, not the built tensor itself
                assert torch.equal(g, b), f"{store.name}: moved KV differs from the built KV"
        assert redis.stats().corrupt == 0 and redis.stats().hits == len(built)
    finally:
        redis.close()
        cpu.close()
