"""`pdllm generate` end to end through the installed console script, on a tiny checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pdllm.shared.app.cli import main
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.model.loader import load_model
from pdllm.shared.prompt import encode_prompt
from tests.reference.vanilla import generate_vanilla

from ..model.tiny_checkpoint import make_tiny_checkpoint

CONTEXT = "The archive reopened after a two-year renovation. The access code of Mira Halden is 4821. " * 3
QUESTION = "What is the access code of Mira Halden?"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdllm.shared.app.cli", *args], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


def test_vanilla_generate_matches_library(tiny_dir, tmp_path) -> None:
    ctx = tmp_path / "doc.txt"
    ctx.write_text(CONTEXT, encoding="utf-8")
    res = _cli(
        "generate", "--model", str(tiny_dir), "--context-file", str(ctx), "--question", QUESTION,
        "--method", "vanilla", "--gen-length", "8", "--steps", "8", "--json",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    loaded = load_model(tiny_dir)
    ids = encode_prompt(loaded.tokenizer, CONTEXT, QUESTION)
    expected = generate_vanilla(
        loaded.model, ids.vanilla(loaded.config.bos_token_id), GenerationConfig(gen_length=8, steps=8)
    )
    assert out["text"] == loaded.tokenizer.decode(expected.token_ids, skip_special_tokens=True).strip()
    trace = out["trace"]
    assert trace["method"] == "vanilla" and trace["timings"]["decode_s"] > 0
    assert trace["prompt_tokens"] == len(ids.vanilla(None))


def test_text_output_prints_timings(tiny_dir) -> None:
    res = _cli(
        "generate", "--model", str(tiny_dir), "--context", CONTEXT, "--question", QUESTION,
        "--method", "vanilla", "--gen-length", "4", "--steps", "2",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "timings load_s " in res.stderr and "decode_s " in res.stderr


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--steps", "0"], "--steps must be > 0 (got 0)"),
        (["--gen-length", "10", "--block-length", "4"], "must be divisible by --block-length (4)"),
        (["--question", " "], "question is empty"),
        (["--context-file", "/nonexistent.txt"], "no such file"),
        (["--model", "/nonexistent"], "does not exist"),
        (["--threshold", "2"], "--threshold must be in (0, 1] (got 2.0)"),
    ],
)
def test_bad_input_is_one_clear_line(tiny_dir, capsys, extra: list[str], message: str) -> None:
    base = {"--model": str(tiny_dir), "--question": QUESTION, "--method": "vanilla"}
    args = ["generate"]
    for k, v in base.items():
        if k not in extra:
            args += [k, v]
    if "--context-file" not in extra:
        args += ["--context", CONTEXT]
    assert main([*args, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_non_utf8_context_file(tiny_dir, tmp_path, capsys) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"abc \xff\xfe def")
    assert (
        main(["generate", "--model", str(tiny_dir), "--context-file", str(bad), "--question", QUESTION]) == 2
    )
    assert "not valid UTF-8" in capsys.readouterr().err


def test_tiny_checkpoint_loads_with_tokenizer(tiny_dir) -> None:
    loaded = load_model(tiny_dir)
    assert loaded.tokenizer.mask_token_id == loaded.config.mask_token_id
    with torch.no_grad():
        assert loaded.model(torch.tensor([[loaded.config.bos_token_id, 5, 6]])).shape[-1] == len(
            loaded.tokenizer
        )
