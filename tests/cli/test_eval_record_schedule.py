"""`pdllm eval --record-schedule`: one record per decoded sample with its cell, its unmask counts per step
(whole blocks, summing to the block length), forwards and TPF equal to the eval's own rows, and the decode
policy's counters and fractions; the file loads back as replayable schedules."""

from __future__ import annotations

import json

import pytest

from pdllm.shared.app.eval import main
from pdllm.shared.generation.schedule import load_schedules, parse_select

from ..model.tiny_checkpoint import make_tiny_checkpoint

GRID = ["--tasks", "needle", "--samples", "2", "--depths", "0.5", "--length-multiples", "1"]
GRID += ["--gen-length", "8", "--block-length", "4"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    make_tiny_checkpoint(path)
    (path / "pdllm.json").write_text(json.dumps({"train_length": 128, "engine": {"chunk_size": 32}}))
    return path


def test_every_decoded_sample_is_recorded(ckpt, tmp_path, capsys) -> None:
    file = tmp_path / "schedules.json"
    argv = ["--model", str(ckpt), *GRID, "--decode-policy", "dyllm", "--threshold", "none,0.05"]
    assert main([*argv, "--out", str(tmp_path), "--name", "r", "--record-schedule", str(file)]) == 0
    header, samples = load_schedules(file)
    assert header["decode_policy"] == "dyllm" and "--record-schedule" in header["command"]
    # 2 thresholds x 2 methods x 2 samples, in grid order
    assert [(s["threshold"], s["method"], s["seed"]) for s in samples] == [
        (t, m, seed) for t in (None, 0.05) for m in ("vanilla", "pdllm") for seed in (0, 1)
    ]
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    for row in rows:
        mine = [s for s in samples if (s["threshold"], s["method"]) == (row["threshold"], row["method"])]
        assert sum(s["forwards"] for s in mine) == row["forwards"]
        assert sum(s["tokens"] for s in mine) == row["tokens"]
    for s in samples:
        assert (s["gen_length"], s["block_length"], s["decode_policy"], s["task"]) == (
            8,
            4,
            "dyllm",
            "needle",
        )
        assert all(sum(block) == 4 for block in s["steps"]) and len(s["steps"]) <= 2
        assert s["forwards"] == sum(map(len, s["steps"])) == s["policy_stats"]["forwards"]
        if s["threshold"] is None:
            assert all(n == 1 for block in s["steps"] for n in block)
        assert 0 < s["fractions"]["salient_frac"] <= 1 and 0 < s["fractions"]["ffn_frac"] <= 1
    assert any(n > 1 for s in samples if s["threshold"] for block in s["steps"] for n in block)
    _, picked = load_schedules(file, parse_select("threshold=0.05,method=pdllm"))
    assert [s["seed"] for s in picked] == [0, 1]
    with pytest.raises(ValueError, match="no sample matches"):
        load_schedules(file, parse_select("threshold=0.9"))
    capsys.readouterr()
