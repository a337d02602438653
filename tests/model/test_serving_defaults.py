"""A checkpoint's ``pdllm.json``: its training length and recommended engine settings reach every command."""

from __future__ import annotations

import json
import shutil

import pytest

from pdllm.shared.app.cli import main
from pdllm.shared.config import EngineConfig
from pdllm.shared.model.loader import (
    DEFAULT_MODEL_DIR,
    CheckpointError,
    load_model,
    read_serving_defaults,
)
from pdllm.shared.rpc.validation import RequestDefaults

from .tiny_checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


def test_shipped_model_carries_its_training_length_and_chunking() -> None:
    serving = read_serving_defaults(DEFAULT_MODEL_DIR)
    assert serving.train_length == 1024
    cfg = EngineConfig.from_settings(serving.engine)
    # K chunks of C tokens (each with its BOS) + a question must fit the training length.
    assert cfg.top_k * (cfg.chunk_size + 1) + 32 <= serving.train_length


def test_overrides_win_and_unknown_settings_are_refused() -> None:
    cfg = EngineConfig.from_settings({"chunk_size": 256, "top_k": 3}, top_k=5, kv_mode=None)
    assert (cfg.chunk_size, cfg.top_k, cfg.kv_mode) == (256, 5, EngineConfig.kv_mode)
    with pytest.raises(ValueError, match="unknown engine setting"):
        EngineConfig.from_settings({"chunk_sise": 256})
    with pytest.raises(ValueError, match="chunk_size"):
        EngineConfig.from_settings({"chunk_size": 0})


def test_router_defaults_follow_the_checkpoint() -> None:
    d = RequestDefaults.for_engine({"chunk_size": 64, "top_k": 2, "score_mode": "self-info"}, model="m")
    assert (d.chunk_size, d.top_k, d.score_mode, d.model) == (64, 2, "self-info", "m")
    assert RequestDefaults.for_engine({}).chunk_size == RequestDefaults().chunk_size


@pytest.mark.parametrize(
    "text,message",
    [
        ("{not json", "not valid JSON"),
        ('{"train_length": 1024, "chunking": {}}', "expected an object"),
        ('{"train_length": -4}', "positive integer"),
        ('{"engine": [256]}', "must be an object"),
    ],
)
def test_bad_file_is_a_clear_checkpoint_error(tiny_dir, tmp_path, text: str, message: str) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, ckpt)
    (ckpt / "pdllm.json").write_text(text)
    with pytest.raises(CheckpointError, match=message):
        load_model(ckpt)


def test_generate_uses_the_checkpoint_chunking_unless_told(tiny_dir, tmp_path, capsys) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, ckpt)
    (ckpt / "pdllm.json").write_text(
        json.dumps({"train_length": 64, "engine": {"chunk_size": 16, "top_k": 1}})
    )
    context = "The access code of Mira Halden is 4821. " * 12
    n_tokens = len(load_model(ckpt).tokenizer.encode(context, add_special_tokens=False))
    args = ["generate", "--model", str(ckpt), "--context", context, "--question", "Code?", "--json"]
    args += ["--gen-length", "4", "--steps", "2"]
    assert main(args) == 0
    trace = json.loads(capsys.readouterr().out)["trace"]
    assert trace["num_chunks"] == -(-n_tokens // 16) and len(trace["selected_chunk_ids"]) == 1
    assert main([*args, "--chunk-size", "32", "--top-k", "2"]) == 0
    trace = json.loads(capsys.readouterr().out)["trace"]
    assert trace["num_chunks"] == -(-n_tokens // 32) and len(trace["selected_chunk_ids"]) == 2
