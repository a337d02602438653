from __future__ import annotations

import json

import torch
from transformers import AutoTokenizer

from pdllm.shared.model.loader import load_model
from pdllm.shared.training import train as train_mod
from pdllm.shared.training.config import TrainConfigError, load_config


def test_smoke_training_learns_and_reloads(tmp_path):
    out = tmp_path / "run"
    assert train_mod.main(["--smoke", "--out", str(out), "--no-progress"]) == 0
    records = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    answers = [(r["step"], m["ce"]) for r in records for k, m in r["modes"].items() if k in ("sft", "chunk")]
    early = [ce for s, ce in answers if s <= 10]
    late = [ce for s, ce in answers if s >= 40]
    assert early and late and max(late) < min(early) - 1.0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 60 and summary["params"] > 0
    loaded = load_model(out / "checkpoint")
    assert loaded.config.family == "dream" and loaded.config.shift_logits
    assert loaded.config.mask_token_id == loaded.tokenizer.mask_token_id == 3
    tok = AutoTokenizer.from_pretrained(str(out / "checkpoint"))
    assert tok.bos_token == "[BOS]" and tok.eos_token == "[EOS]"
    ids = torch.tensor([[tok.bos_token_id, *tok(" The access code", add_special_tokens=False)["input_ids"]]])
    assert torch.isfinite(loaded.model(ids)).all()
    assert (out / "loss_curve.png").stat().st_size > 1000


def test_config_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"lr": 0.1, "nope": 1}')
    try:
        load_config(bad)
    except TrainConfigError as exc:
        assert "nope" in str(exc)
    else:
        raise AssertionError("unknown field accepted")
    bad.write_text("{not json")
    assert train_mod.main(["--config", str(bad)]) == 2
    assert train_mod.main(["--config", str(tmp_path / "missing.json")]) == 2


def test_shipped_configs_parse():
    for name in (
        "needle.json",
        "needle_curriculum.json",
        "needle_next.json",
        "needle_long.json",
        "smoke.json",
    ):
        cfg = load_config(train_mod.CONFIG_DIR / name)
        assert len(cfg.data.mode_weights) == 6
