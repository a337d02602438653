"""`pdllm eval` end to end on a tiny checkpoint: output files, their schema, and the checkpoint's defaults."""

from __future__ import annotations

import json
import shutil

import pytest

from pdllm.decode_service.worker import DecodeWorker
from pdllm.shared.app.eval import main
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.eval.long_answer import LongAnswerSample, held_out_sentences, make_long_answer_sample
from pdllm.shared.eval.report import main as report_main

from ..model.tiny_checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    make_tiny_checkpoint(path)
    (path / "pdllm.json").write_text(
        json.dumps({"train_length": 128, "engine": {"chunk_size": 32, "chunk_boundary": "sentence"}})
    )
    return path


def test_grid_writes_json_markdown_and_heatmaps(ckpt, tmp_path, capsys) -> None:
    argv = ["--model", str(ckpt), "--tasks", "needle", "--samples", "2", "--depths", "0,1"]
    argv += ["--length-multiples", "0.5,1", "--gen-length", "4", "--out", str(tmp_path), "--name", "t"]
    assert main(argv) == 0
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["train_length"] == 128  # from pdllm.json
    assert "chunk_size=32" in data["pdllm"] and "chunk_boundary=sentence" in data["pdllm"]
    rows = data["rows"]
    assert len(rows) == 2 * 2 * 2  # methods x lengths x depths
    assert {r["context_length"] for r in rows} == {64, 128}
    for r in rows:
        assert set(r) >= {"method", "task", "context_length", "depth", "accuracy", "samples"}
        assert r["samples"] == 2 and 0.0 <= r["accuracy"] <= 1.0
        assert r["threshold"] is None and 0.0 < r["tpf"] <= 1.0  # one token per step
    md = (tmp_path / "t.md").read_text()
    assert md.count("| vanilla | 1/step |") == 2 * 2  # lengths x (exact match, tokens per forward)
    assert (tmp_path / "t_needle.png").stat().st_size > 0
    capsys.readouterr()

    # Merging two runs: the later run's cell wins, cells only one run has are kept.
    second = tmp_path / "second"
    assert main([*argv[:-4], "--methods", "pdllm", "--out", str(second), "--name", "t"]) == 0
    assert (
        report_main([str(tmp_path / "t.json"), str(second / "t.json"), "--out", str(tmp_path), "--name", "m"])
        == 0
    )
    merged = json.loads((tmp_path / "m.json").read_text())
    assert len(merged["rows"]) == len(rows)
    assert " ; " in merged["command"]


def test_unknown_task_is_a_clear_error(ckpt, tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown task"):
        main(["--model", str(ckpt), "--tasks", "haystack", "--out", str(tmp_path)])


def test_shipped_defaults_without_file(ckpt, tmp_path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(ckpt, bare)
    (bare / "pdllm.json").unlink()
    argv = [
        "--model",
        str(bare),
        "--tasks",
        "needle",
        "--samples",
        "1",
        "--depths",
        "0",
        "--methods",
        "pdllm",
    ]
    argv += ["--length-multiples", "1", "--train-length", "128", "--gen-length", "4", "--out", str(tmp_path)]
    assert main([*argv, "--name", "b"]) == 0
    header = json.loads((tmp_path / "b.json").read_text())["pdllm"]
    assert "chunk_size=32" in header and "chunk_boundary=fixed" in header  # train_length // 4, engine default


def test_decode_policy_reaches_both_methods(ckpt, tmp_path, monkeypatch) -> None:
    """`--decode-policy` and its knobs pass through to the vanilla decode and the engine, and are recorded."""
    from pdllm.shared.app import engine as engine_module

    seen: list[tuple[str, object]] = []
    real_vanilla, real_prepare = DecodeWorker.vanilla_job, engine_module.PrefillingEngine.prepare

    def vanilla_job(self, prompt, gen, policy=None):  # type: ignore[no-untyped-def]
        seen.append(("vanilla", policy))
        return real_vanilla(self, prompt, gen, policy)

    def prepare(self, *args):  # type: ignore[no-untyped-def]
        seen.append(("pdllm", args[-1]))
        return real_prepare(self, *args)

    monkeypatch.setattr(DecodeWorker, "vanilla_job", vanilla_job)
    monkeypatch.setattr(engine_module.PrefillingEngine, "prepare", prepare)
    argv = ["--model", str(ckpt), "--tasks", "needle", "--samples", "1", "--depths", "0.5"]
    argv += ["--length-multiples", "1", "--gen-length", "4", "--block-length", "2", "--out", str(tmp_path)]
    argv += ["--decode-policy", "sparse-dllm", "--sparse-retention", "0.25", "--name", "p"]
    assert main(argv) == 0
    want = DecodePolicyConfig("sparse-dllm", retention=0.25)
    assert seen == [("vanilla", want), ("pdllm", want)]
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["decode_policy"] == "sparse-dllm retention=0.25"
    assert {r["decode_policy"] for r in data["rows"]} == {"sparse-dllm"}


def test_bad_decode_policy_knob_is_refused_before_loading(tmp_path) -> None:
    argv = ["--model", str(tmp_path / "no-such-model"), "--tasks", "needle", "--out", str(tmp_path)]
    with pytest.raises(ValueError, match=r"^--sparse-pool-kernel must be odd \(got 2\)"):
        main([*argv, "--decode-policy", "sparse-dllm", "--sparse-pool-kernel", "2"])
    with pytest.raises(ValueError, match=r"^--gen-length \(8\) must be divisible by --block-length \(3\)"):
        main([*argv, "--block-length", "3"])


LONG = ["--tasks", "long-answer", "--samples", "1", "--depths", "0.5", "--train-length", "256"]


def short_passages(tokenizer, context_tokens: int, depth: float, seed: int) -> LongAnswerSample:
    hay = held_out_sentences()
    return make_long_answer_sample(
        tokenizer, context_tokens, depth, seed, hay, distractors=1, bounds=(40, 60)
    )


def test_long_answer_scores_passages_and_agreement(ckpt, tmp_path, monkeypatch) -> None:
    """long-answer on a random model: exact-passage rate, token accuracy and agreement with no-cache
    decoding per cell, in the JSON rows and as Markdown tables; each sample decoded twice (policy, none)."""
    from pdllm.shared.app import eval_settings

    policies: list[str] = []
    real = DecodeWorker.vanilla_job

    def vanilla_job(self, prompt, gen, policy=None):  # type: ignore[no-untyped-def]
        policies.append(policy.name)
        return real(self, prompt, gen, policy)

    monkeypatch.setattr(DecodeWorker, "vanilla_job", vanilla_job)
    # Shorter passages than the task's 128-256 tokens keep the random model's full-length decodes cheap.
    monkeypatch.setattr(eval_settings, "make_eval_sample", short_passages)
    argv = ["--model", str(ckpt), *LONG, "--length-multiples", "1", "--block-length", "32"]
    argv += ["--decode-policy", "dual-cache", "--agreement", "--out", str(tmp_path), "--name", "la"]
    assert main(argv) == 0  # --gen-length 8 (the default) does not divide 32: long-answer sizes its own
    data = json.loads((tmp_path / "la.json").read_text())
    assert "multiple of 32" in data["long-answer"] and "none" in data["agreement"]
    rows = data["rows"]
    assert [(r["method"], r["task"], r["context_length"]) for r in rows] == [
        ("vanilla", "long-answer", 256),
        ("pdllm", "long-answer", 256),
    ]
    for r in rows:
        assert r["decode_policy"] == "dual-cache"
        assert (
            0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["token_accuracy"] <= 1.0 and 0.0 <= r["agreement"] <= 1.0
        )
    assert policies == ["dual-cache", "none"]  # vanilla: the policy's decoding, then the reference
    md = (tmp_path / "la.md").read_text()
    for title in ("exact passage", "token accuracy", "token agreement with no-cache decoding"):
        assert f"## long-answer ({title}, %)" in md
    assert (tmp_path / "la_long-answer.png").stat().st_size > 0


def test_agreement_under_policy_none_decodes_once(ckpt, tmp_path, monkeypatch) -> None:

    calls: list[str] = []
    real = DecodeWorker.vanilla_job

    def vanilla_job(self, prompt, gen, policy=None):  # type: ignore[no-untyped-def]
        calls.append(policy.name)
        return real(self, prompt, gen, policy)

    monkeypatch.setattr(DecodeWorker, "vanilla_job", vanilla_job)
    argv = [
        "--model",
        str(ckpt),
        "--tasks",
        "needle",
        "--samples",
        "2",
        "--depths",
        "0",
        "--methods",
        "vanilla",
    ]
    argv += [
        "--length-multiples",
        "1",
        "--gen-length",
        "4",
        "--agreement",
        "--out",
        str(tmp_path),
        "--name",
        "n",
    ]
    assert main(argv) == 0
    (row,) = json.loads((tmp_path / "n.json").read_text())["rows"]
    assert calls == ["none", "none"] and row["agreement"] == 1.0 and "token_accuracy" not in row


def test_long_answer_bad_input_is_a_clear_error(ckpt, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"unknown task 'long_answer' \(expected one of .*long-answer"):
        main(["--model", str(ckpt), "--tasks", "needle,long_answer", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match=r"long-answer needs contexts of at least 256 tokens .* gives 128"):
        main(["--model", str(ckpt), *LONG, "--length-multiples", "0.5,1", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match=r"--tasks is empty"):
        main(["--model", str(ckpt), "--tasks", ",", "--out", str(tmp_path)])
