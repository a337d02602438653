from __future__ import annotations

import json

import torch
from transformers import AutoTokenizer

from pdllm.shared.model.loader import load_model, save_checkpoint
from pdllm.shared.training import train as train_mod
from pdllm.shared.training.checkpoint_io import init_from
from pdllm.shared.training.config import (
    CONFIG_DIR,
    TrainConfigError,
    build_model_config,
    load_config,
    smoke_variant,
)


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
        "judge_dream.json",
        "judge_sdar.json",
        "judge_dream_stage2.json",
        "judge_dream_blocks_stage2.json",
        "judge_sdar_stage2.json",
    ):
        cfg = load_config(CONFIG_DIR / name)
        assert len(cfg.data.mode_weights) == 6


def test_init_from_starts_at_the_checkpoints_weights(tmp_path):
    """A second stage loads the first stage's weights over its own init (a planted skip of the load leaves
    the fresh init, whose weights differ); a checkpoint of another shape is refused with the tensor named."""
    cfg = smoke_variant(load_config(CONFIG_DIR / "judge_dream.json"))
    tok = train_mod.load_tokenizer()
    first = train_mod.DiffusionLM(build_model_config(cfg, tok))
    first.init_weights(11)
    save_checkpoint(first, tmp_path / "stage1", tok)
    second = train_mod.DiffusionLM(build_model_config(cfg, tok))
    second.init_weights(cfg.seed)
    assert not torch.equal(
        second.state_dict()["model.embed_tokens.weight"], first.state_dict()["model.embed_tokens.weight"]
    )
    init_from(second, tmp_path / "stage1")
    for name, tensor in first.state_dict().items():
        assert torch.equal(second.state_dict()[name], tensor), name
    other = train_mod.DiffusionLM(build_model_config(load_config(CONFIG_DIR / "judge_dream.json"), tok))
    try:
        init_from(other, tmp_path / "stage1")
    except TrainConfigError as exc:
        assert "stage1" in str(exc) and "needs" in str(exc)
    else:
        raise AssertionError("a checkpoint of another shape was accepted")
