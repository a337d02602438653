"""`pdllm eval --eval-batch N`: a cell's decodes denoised together give what one at a time gives.

Whole rows (accuracy, tokens, forwards, TPF, agreement), every sample's unmask-schedule record and trace
(timings and memory aside) are compared between ``--eval-batch 4`` and ``--eval-batch 1`` on a grid with a
threshold whose decodes take different numbers of steps (so requests of a batch finish in different
rounds), for both methods, under caching policies and on SDAR (block diffusion, plain and FOCUS).

Planted and seen failing: :meth:`LocalDecoder.run_many` returning results in completion order instead of
submission order (the records and agreement pairs swap), and each result's steps replaced by its batch's
rounds, forwards counted per round instead of per request (the cell's forwards and TPF change).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdllm.decode_service.local import LocalDecodeError, LocalJob
from pdllm.decode_service.worker import DecodeWorker
from pdllm.shared.app.eval import main
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.model.loader import load_model

from ..model.tiny_checkpoint import make_tiny_checkpoint

GRID = ["--tasks", "needle", "--samples", "4", "--depths", "0.5", "--length-multiples", "1"]
GRID += ["--gen-length", "8", "--block-length", "4", "--threshold", "none,0.05", "--agreement"]
VOLATILE = {"seconds", "timings", "peak_memory_bytes", "memory_kind"}  # wall time and memory


@pytest.fixture(scope="module")
def dream(tmp_path_factory) -> Path:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")
    (path / "pdllm.json").write_text(json.dumps({"train_length": 128, "engine": {"chunk_size": 32}}))
    return path


@pytest.fixture(scope="module")
def sdar(tmp_path_factory) -> Path:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "sdar", family="sdar")
    (path / "pdllm.json").write_text(json.dumps({"train_length": 64, "engine": {"chunk_size": 16}}))
    return path


def _stable(value: Any) -> Any:
    """``value`` without its wall times and memory readings."""
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


def _run(ckpt: Path, out: Path, batch: int, policy: str) -> dict[str, Any]:
    """The rows, schedule records and traces of the grid under ``policy`` at ``--eval-batch batch``."""
    out.mkdir()
    argv = ["--model", str(ckpt), *GRID, "--decode-policy", policy, "--eval-batch", str(batch)]
    argv += ["--out", str(out), "--name", "e", "--record-schedule", str(out / "s.json")]
    assert main([*argv, "--traces", str(out / "t.jsonl")]) == 0
    rows = json.loads((out / "e.json").read_text())["rows"]
    schedules = json.loads((out / "s.json").read_text())["samples"]
    traces = [json.loads(line) for line in (out / "t.jsonl").read_text().splitlines()]
    return _stable({"rows": rows, "schedules": schedules, "traces": traces})


@pytest.mark.parametrize(
    ("family", "policy"), [("dream", "dual-cache"), ("dream", "dyllm"), ("sdar", "none"), ("sdar", "focus")]
)
def test_batched_eval_equals_one_at_a_time(family, policy, dream, sdar, tmp_path, capsys) -> None:
    ckpt = dream if family == "dream" else sdar
    one = _run(ckpt, tmp_path / "one", 1, policy)
    four = _run(ckpt, tmp_path / "four", 4, policy)
    capsys.readouterr()
    assert {r["method"] for r in one["rows"]} == {"vanilla", "pdllm"}
    assert len(one["schedules"]) == len(one["traces"]) == 2 * 2 * 4  # thresholds x methods x samples
    threshold = [s["forwards"] for s in one["schedules"] if s["threshold"] == 0.05]
    assert len(set(threshold)) > 1, "the batches' requests must finish in different rounds"
    assert four["rows"] == one["rows"]
    assert four["schedules"] == one["schedules"]
    assert four["traces"] == one["traces"]


def test_run_many_keeps_the_others_results_when_one_fails(dream) -> None:
    """A request whose session cannot start fails alone: the error names it, the others' results are
    in it, each the same as decoding it by itself (its own steps, in submission order)."""
    loaded = load_model(str(dream), device="cpu")
    worker = DecodeWorker(loaded.model)
    gen = GenerationConfig(gen_length=8, steps=8, block_length=4, threshold=0.05)
    prompts = [[1, *range(10 + i, 40 + 3 * i)] for i in range(3)]
    alone = [worker.vanilla(p, gen) for p in prompts]

    def broken() -> Any:
        raise RuntimeError("no session")

    jobs = [worker.vanilla_job(p, gen) for p in prompts]
    with pytest.raises(LocalDecodeError, match=r"request 1 of 4 failed .*no session") as caught:
        worker.local.run_many([jobs[0], LocalJob(broken, 0, 0, gen), *jobs[1:]])
    assert set(caught.value.errors) == {1}
    got = [r for r in caught.value.results if r is not None]
    assert [(r.raw_tokens, r.steps) for r in got] == [(r.raw_tokens, r.steps) for r in alone]
    with pytest.raises(RuntimeError, match="^no session$"):  # one request: its own error, as it is
        worker.local.run(LocalJob(broken, 0, 0, gen))


def test_a_failed_decode_names_its_sample(dream, tmp_path, monkeypatch) -> None:
    """One sample's request fails in a batch of four: the error names that sample's cell and seed."""
    real = DecodeWorker.vanilla_job
    made: list[int] = []

    def vanilla_job(self, prompt, gen, policy=None):  # type: ignore[no-untyped-def]
        made.append(1)
        if len(made) == 3:  # the third sample's

            def broken() -> Any:
                raise RuntimeError("no session")

            return LocalJob(broken, 0, 0, gen)
        return real(self, prompt, gen, policy)

    monkeypatch.setattr(DecodeWorker, "vanilla_job", vanilla_job)
    argv = ["--model", str(dream), *GRID[:8], "--gen-length", "4", "--methods", "vanilla"]
    with pytest.raises(
        RuntimeError, match=r"vanilla decode of needle length=128 depth=0.5 seed=2 .*no session"
    ):
        main([*argv, "--eval-batch", "4", "--out", str(tmp_path), "--name", "f"])
