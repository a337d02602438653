"""`pdllm eval` on a tiny SDAR (block-diffusion) checkpoint: both methods run (vanilla by block diffusion over
the whole prompt, pdllm by block diffusion over the selected chunks), plain or under FOCUS, and what they do
not run is refused before the first sample."""

from __future__ import annotations

import json

import pytest
import torch

from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.app.eval import main
from pdllm.shared.app.eval_grid import make_decoder
from pdllm.shared.app.eval_settings import EvalSettings
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.eval.tasks import make_sample
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.model.loader import load_model
from pdllm.shared.prompt import encode_prompt
from tests.reference.block_diffusion import generate_block_diffusion
from tests.reference.focus import generate_focus_block_diffusion

from ..model.tiny_checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "sdar", family="sdar")
    (path / "pdllm.json").write_text(json.dumps({"train_length": 64, "engine": {"chunk_size": 16}}))
    return path


def test_grid_runs_both_methods(ckpt, tmp_path, capsys) -> None:
    argv = ["--model", str(ckpt), "--tasks", "needle", "--samples", "2", "--depths", "0,1"]
    argv += ["--length-multiples", "1", "--gen-length", "8", "--block-length", "4"]
    assert main([*argv, "--out", str(tmp_path), "--name", "t"]) == 0
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert sorted((r["method"], r["depth"]) for r in rows) == [
        ("pdllm", 0.0),
        ("pdllm", 1.0),
        ("vanilla", 0.0),
        ("vanilla", 1.0),
    ]
    assert all(r["samples"] == 2 and 0.0 <= r["accuracy"] <= 1.0 for r in rows)
    capsys.readouterr()


def test_decoders_are_the_exact_sdar_decodes(ckpt) -> None:
    loaded = load_model(ckpt)
    settings = EvalSettings(gen_length=8, block_length=4)
    sample = make_sample("needle", 64, 0.5, 0, loaded.tokenizer)
    gen = GenerationConfig(gen_length=8, steps=8, block_length=4)
    none = DecodePolicyConfig()
    ids = encode_prompt(loaded.tokenizer, sample.context, sample.question)
    vanilla = make_decoder(loaded, "vanilla", settings, 64)(sample, gen, none)
    prompt = torch.tensor(ids.vanilla(loaded.config.bos_token_id))
    assert vanilla == generate_block_diffusion(loaded.model, prompt, gen).token_ids
    pdllm = make_decoder(loaded, "pdllm", settings, 64)(sample, gen, none)
    engine = PrefillingEngine(
        loaded.model, loaded.tokenizer, settings.engine_config(loaded, 64, len(ids.query))
    )
    assert pdllm == engine.generate(ids.context, ids.query, gen)[0].token_ids


def test_focus_runs_both_methods(ckpt, tmp_path, capsys) -> None:
    argv = ["--model", str(ckpt), "--tasks", "needle", "--samples", "1", "--depths", "0.5"]
    argv += ["--length-multiples", "1", "--gen-length", "8", "--block-length", "4", "--agreement"]
    argv += ["--decode-policy", "focus", "--focus-budget", "2"]
    assert main([*argv, "--out", str(tmp_path), "--name", "f"]) == 0
    rows = json.loads((tmp_path / "f.json").read_text())["rows"]
    assert sorted(r["method"] for r in rows) == ["pdllm", "vanilla"]
    assert all(r["decode_policy"] == "focus" and 0.0 <= r["agreement"] <= 1.0 for r in rows)
    capsys.readouterr()


def test_focus_decoders_are_the_in_process_focus_decodes(ckpt) -> None:
    loaded = load_model(ckpt)
    settings = EvalSettings(gen_length=8, block_length=4)
    sample = make_sample("needle", 64, 0.5, 0, loaded.tokenizer)
    gen = GenerationConfig(gen_length=8, steps=8, block_length=4)
    focus = DecodePolicyConfig("focus", focus={"focus_budget": 2, "focus_delayed_cache": "off"})
    ids = encode_prompt(loaded.tokenizer, sample.context, sample.question)
    vanilla = make_decoder(loaded, "vanilla", settings, 64)(sample, gen, focus)
    prompt = torch.tensor(ids.vanilla(loaded.config.bos_token_id))
    assert (
        vanilla == generate_focus_block_diffusion(loaded.model, prompt, gen, focus.focus_config()).token_ids
    )
    pdllm = make_decoder(loaded, "pdllm", settings, 64)(sample, gen, focus)
    engine = PrefillingEngine(
        loaded.model, loaded.tokenizer, settings.engine_config(loaded, 64, len(ids.query))
    )
    expected = engine.generate(ids.context, ids.query, gen, decode_policy=focus)[0]
    assert pdllm == expected.token_ids and expected.cache["policy"] == "focus"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--kv-mode", "chunk-only"], "kv_mode='chunk-only' is not supported by the pdllm engine on SDAR"),
        (
            ["--decode-policy", "dual-cache"],
            "decode policy 'dual-cache' is not supported by the pdllm engine",
        ),
        (["--decode-policy", "dyllm"], "decode policy 'dyllm' is not supported by the pdllm engine"),
        (["--block-length", "6", "--gen-length", "12"], "block_length is 6, but this SDAR"),
    ],
)
def test_unsupported_settings_are_refused_before_any_sample(ckpt, tmp_path, extra, message) -> None:
    argv = ["--model", str(ckpt), "--tasks", "needle", "--samples", "1", "--depths", "0"]
    argv += ["--length-multiples", "1", "--methods", "pdllm", "--out", str(tmp_path), *extra]
    with pytest.raises(ValueError, match=message):
        main(argv)
    assert not list(tmp_path.iterdir())  # no cell was decoded
