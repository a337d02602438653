"""`pdllm generate --method pdllm` on a tiny SDAR checkpoint: runs in process, equals block diffusion on the
prompt of the chunks it selected, and refuses what the SDAR decode does not run (one clear line)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdllm.shared.app.cli import main
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.layout import split_context
from pdllm.shared.model.loader import load_model
from pdllm.shared.prompt import encode_prompt
from tests.reference.block_diffusion import generate_block_diffusion

from ..model.tiny_checkpoint import make_tiny_checkpoint
from .test_generate import CONTEXT, QUESTION

FLAGS = ["--chunk-size", "16", "--chunk-boundary", "fixed", "--top-k", "2", "--kv-mode", "full-mask"]
GEN = ["--gen-length", "8", "--steps", "8", "--block-length", "4"]


@pytest.fixture(scope="module")
def sdar_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "sdar", family="sdar")


def _generate(sdar_dir: Path, *extra: str) -> list[str]:
    base = ["generate", "--model", str(sdar_dir), "--context", CONTEXT, "--question", QUESTION]
    return [*base, "--method", "pdllm", *extra]


def test_pdllm_on_sdar_equals_block_diffusion_on_the_selection(sdar_dir: Path, capsys) -> None:
    rc = main([*_generate(sdar_dir, *FLAGS, *GEN), "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    out = json.loads(captured.out)
    selected = out["trace"]["selected_chunk_ids"]
    assert len(selected) == 2 and out["trace"]["steps"] == 8
    loaded = load_model(sdar_dir)
    ids = encode_prompt(loaded.tokenizer, CONTEXT, QUESTION)
    chunks = split_context(list(ids.context), 16)
    prompt = list(ids.instruction)
    for i in selected:
        prompt += [loaded.config.bos_token_id, *chunks[i]]
    prompt += list(ids.query)
    gen = GenerationConfig(gen_length=8, steps=8, block_length=4)
    expected = generate_block_diffusion(loaded.model, torch.tensor(prompt), gen)
    assert out["text"] == loaded.tokenizer.decode(expected.token_ids, skip_special_tokens=True).strip()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--kv-mode", "chunk-only"], "kv_mode='chunk-only' is not supported by the pdllm engine on SDAR"),
        (["--top-b", "4"], "top_b=4 is not supported by the pdllm engine on SDAR"),
        (["--gen-length", "12", "--steps", "12", "--block-length", "6"], "multiple of 4"),
    ],
)
def test_unsupported_options_are_one_clear_line(
    sdar_dir: Path, capsys, extra: list[str], message: str
) -> None:
    assert main(_generate(sdar_dir, "--chunk-size", "16", "--top-k", "2", *GEN, *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
