"""`generate --method vanilla` on a CPU with a long prompt says how long a step will take, before it starts;
the estimate (a timed short forward scaled by FLOPs) is in the range of a real forward of that length."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from pdllm.decode_service.worker import DecodeWorker
from pdllm.shared.app import cli
from pdllm.shared.model.loader import load_model

from ..model.tiny_checkpoint import make_tiny_checkpoint

CONTEXT = "The archive reopened after a two-year renovation. The access code of Mira Halden is 4821. " * 3
QUESTION = "What is the access code of Mira Halden?"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


def _generate(tiny_dir, method: str) -> list[str]:
    return ["generate", "--model", str(tiny_dir), "--context", CONTEXT, "--question", QUESTION,
            "--method", method, "--gen-length", "4", "--steps", "4"]  # fmt: skip


def test_long_vanilla_prompt_gets_an_estimate_first(tiny_dir, capsys, monkeypatch) -> None:
    monkeypatch.setattr(cli, "VANILLA_NOTE_TOKENS", 16)  # the test context is short
    decode = DecodeWorker.vanilla

    def marked(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        print("<decoding starts>", file=sys.stderr)
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(DecodeWorker, "vanilla", marked)
    assert cli.main(_generate(tiny_dir, "vanilla")) == 0
    err = capsys.readouterr().err
    note = err.index("note: every vanilla step forwards the whole")
    assert "a step should take about" in err and "4 steps about" in err
    assert note < err.index("<decoding starts>")


@pytest.mark.parametrize("method", ["pdllm", "vanilla"])
def test_no_estimate_where_steps_are_cheap(tiny_dir, capsys, method: str) -> None:
    assert cli.main(_generate(tiny_dir, method)) == 0  # a short prompt, or pdllm
    assert "note: every vanilla step" not in capsys.readouterr().err


def test_flops_grow_with_the_square_of_the_prompt(tiny_dir) -> None:
    config = load_model(tiny_dir).config
    one, two = cli.forward_flops(config, 4096, 0), cli.forward_flops(config, 8192, 0)
    assert 2 < two / one < 4


def test_estimate_is_in_the_range_of_a_measured_forward(tiny_dir, monkeypatch) -> None:
    """The estimate from a short timed forward against a real forward of the whole prompt: within 5x either
    way (a step is one such forward; the machine's load moves both)."""
    model = load_model(tiny_dir).model
    monkeypatch.setattr(cli, "CALIBRATION_TOKENS", 1024)  # a third of the prompt: the scaling is tested
    prompt = list(torch.randint(5, 50, (3000,)).tolist())
    with torch.no_grad():
        model(torch.tensor([prompt]))  # a fresh process's first forwards are slow: not what is compared
    estimate, measured_on = cli.vanilla_step_seconds(model, prompt, 4)
    assert measured_on < len(prompt)
    times = []
    with torch.no_grad():
        for _ in range(4):  # the fastest of three after a warm-up, as the estimate's own forwards
            began = time.perf_counter()
            model(torch.tensor([prompt]))
            times.append(time.perf_counter() - began)
    real = min(times[1:])
    assert real / 5 < estimate < real * 5, (estimate, real)
