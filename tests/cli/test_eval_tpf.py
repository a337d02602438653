"""`pdllm eval --threshold` and tokens per forward on a tiny checkpoint: the threshold reaches the sampler,
every row carries its threshold and TPF, TPF is exact on decodes counted by hand, and a bad threshold is
one error line before the model loads."""

from __future__ import annotations

import json

import pytest

from pdllm.shared.app.cli import main as pdllm_main
from pdllm.shared.app.eval import main
from pdllm.shared.app.eval_batch import BatchDecoder, Decoded
from pdllm.shared.generation.sampler import GenerationResult, trim_response

from ..model.tiny_checkpoint import make_tiny_checkpoint

EOS, MASK = 2, 3  # the tiny tokenizer's [EOS] and [MASK]
GRID = ["--tasks", "needle", "--samples", "2", "--depths", "0.5", "--length-multiples", "1"]
GRID += ["--gen-length", "8", "--block-length", "4"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    make_tiny_checkpoint(path)
    (path / "pdllm.json").write_text(json.dumps({"train_length": 128, "engine": {"chunk_size": 32}}))
    return path


def test_threshold_decodes_more_tokens_per_forward(ckpt, tmp_path, monkeypatch, capsys) -> None:
    """`--threshold none,0.05`: one grid per value, into one report. At one token per step TPF is at most 1;
    at 0.05 (the random model's confidences pass it) several tokens per forward. Each row's forwards are its
    decodes' steps, which equal the decode policy's own forward counter."""
    seen: list[tuple[float | None, GenerationResult]] = []
    real = BatchDecoder.decode

    def decode(self, items):  # type: ignore[no-untyped-def]
        out = real(self, items)
        if self.method == "vanilla":
            seen.extend((item.gen.threshold, d.result) for item, d in zip(items, out, strict=True))
        return out

    monkeypatch.setattr(BatchDecoder, "decode", decode)
    argv = ["--model", str(ckpt), *GRID, "--decode-policy", "dual-cache", "--threshold", "none,0.05"]
    traces = tmp_path / "traces.jsonl"
    assert main([*argv, "--out", str(tmp_path), "--name", "t", "--traces", str(traces)]) == 0
    records = [json.loads(line) for line in traces.read_text().splitlines()]
    assert [r.get("threshold") for r in records] == [None] * 4 + [0.05] * 4  # 2 methods x 2 samples each
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["threshold"].startswith("1/step, 0.05 (") and "first EOS" in data["tpf"]
    rows = {(r["method"], r["threshold"]): r for r in data["rows"]}
    assert set(rows) == {(m, t) for m in ("vanilla", "pdllm") for t in (None, 0.05)}
    for r in rows.values():
        assert r["tpf"] == round(r["tokens"] / r["forwards"], 4)
    for method in ("vanilla", "pdllm"):
        assert rows[(method, None)]["tpf"] <= 1.0
        assert rows[(method, 0.05)]["tpf"] > 1.0
        assert rows[(method, 0.05)]["forwards"] < rows[(method, None)]["forwards"]
    assert [t for t, _ in seen] == [None, None, 0.05, 0.05]  # vanilla's decodes, in grid order
    for threshold, result in seen:
        assert result.cache["forwards"] == result.steps  # the policy's forwards: its steps, no extra ones
        assert rows[("vanilla", threshold)]["forwards"] == sum(r.steps for t, r in seen if t == threshold)
    md = (tmp_path / "t.md").read_text()
    assert "## needle (tokens per forward)" in md and "| vanilla | 0.05 | 128 |" in md
    capsys.readouterr()


def test_tpf_counts_tokens_up_to_the_first_eos(ckpt, tmp_path, monkeypatch, capsys) -> None:
    """Decodes counted by hand (vanilla's decodes replaced by fixed results): sample 0 stops at an EOS in
    slot 3 of block 1 after 2 steps (3 tokens; the EOS fill after it and the undecoded block 2 are not
    tokens), sample 1 has no EOS, 8 tokens in 3 steps: TPF = (3 + 8) / (2 + 3) = 2.2.

    Planted by hand and seen failing: counting every decoded slot (the EOS fill too) gives (6 + 8) / 5 =
    2.8; leaving the EOS itself out (``len(token_ids)``) gives (2 + 8) / 5 = 2.0."""
    decodes = iter(
        [
            ([41, 42, EOS, EOS, EOS, EOS, MASK, MASK], 2),
            ([41, 42, 43, 44, 45, 46, 47, 48], 3),
        ]
    )

    def decode(self, items):  # type: ignore[no-untyped-def]
        fixed = [next(decodes) for _ in items]
        return [
            Decoded(GenerationResult(trim_response(r, EOS, MASK), r, n, decode_seconds=0.0)) for r, n in fixed
        ]

    monkeypatch.setattr(BatchDecoder, "decode", decode)
    argv = ["--model", str(ckpt), *GRID, "--methods", "vanilla", "--threshold", "0.8"]
    assert main([*argv, "--out", str(tmp_path), "--name", "h"]) == 0
    (row,) = json.loads((tmp_path / "h.json").read_text())["rows"]
    assert (row["threshold"], row["tokens"], row["forwards"], row["tpf"]) == (0.8, 11, 5, 2.2)
    capsys.readouterr()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("1.5", "error: --threshold must be in (0, 1] (got 1.5)"),
        ("0", "error: --threshold must be in (0, 1] (got 0)"),
        ("0.7,fast", "error: --threshold: 'fast' is not a number in (0, 1] or none"),
    ],
)
def test_bad_threshold_is_one_error_line_before_loading(tmp_path, capsys, value: str, message: str) -> None:
    argv = ["eval", "--model", str(tmp_path / "no-such-model"), "--tasks", "needle", "--out", str(tmp_path)]
    assert pdllm_main([*argv, "--threshold", value]) == 2
    err = capsys.readouterr().err
    assert err.strip() == message and "Traceback" not in err


def test_threshold_on_block_diffusion(tmp_path_factory, tmp_path, monkeypatch, capsys) -> None:
    """SDAR: both methods decode by block diffusion at the threshold, under FOCUS too, whose forwards are
    its steps (a finished block's record rides in the next block's first step, no forward of its own)."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "sdar", family="sdar")
    (path / "pdllm.json").write_text(json.dumps({"train_length": 64, "engine": {"chunk_size": 16}}))
    results: list[GenerationResult] = []
    real = BatchDecoder.decode

    def decode(self, items):  # type: ignore[no-untyped-def]
        out = real(self, items)
        if self.method == "vanilla":
            results.extend(d.result for d in out)
        return out

    monkeypatch.setattr(BatchDecoder, "decode", decode)
    argv = ["--model", str(path), *GRID, "--decode-policy", "focus", "--threshold", "0.05"]
    assert main([*argv, "--out", str(tmp_path), "--name", "s"]) == 0
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert {r["method"] for r in rows} == {"vanilla", "pdllm"}
    for r in rows:
        assert r["threshold"] == 0.05 and r["tpf"] > 1.0 and r["tpf"] == round(r["tokens"] / r["forwards"], 4)
    assert len(results) == 2 and all(r.cache["forwards"] == r.steps for r in results)
    capsys.readouterr()
