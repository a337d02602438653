"""Tokens per forward and confidence thresholds of ``pdllm eval`` (``shared/eval/tpf.py``), and reports that
carry them: tables, and merging with a report written before rows had ``threshold`` and ``tpf``."""

from __future__ import annotations

import json

import pytest

from pdllm.shared.eval.report import main as report_main
from pdllm.shared.eval.report import merge, write_markdown
from pdllm.shared.eval.tpf import answer_tokens, parse_thresholds, tpf

EOS, MASK = 2, 3


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ([7, 8, EOS, EOS, EOS, EOS, MASK, MASK], 3),  # EOS counted, its fill and the undecoded block not
        ([EOS, 9, 9, 9], 1),  # an EOS first: one token
        ([7, 8, 9, 10], 4),  # no EOS: every slot
        ([7, 8, 9, 10, MASK, MASK, MASK, MASK], 4),  # never decoded: not tokens
    ],
)
def test_answer_tokens_stop_at_the_first_eos(raw: list[int], want: int) -> None:
    """Planted: counting every decoded slot (``sum(t != mask)``) gives 6 for the first case and fails."""
    assert answer_tokens(raw, EOS, MASK) == want


def test_answer_tokens_without_an_eos_id() -> None:
    assert answer_tokens([7, EOS, 9, MASK], None, MASK) == 3


def test_tpf_pools_tokens_over_forwards() -> None:
    assert tpf(11, 5) == 2.2 and tpf(0, 0) is None


def test_thresholds_parse_a_value_a_list_and_none() -> None:
    assert parse_thresholds(None) == [None]
    assert parse_thresholds("0.9") == [0.9]
    assert parse_thresholds("0.7,0.8,0.9") == [0.7, 0.8, 0.9]
    assert parse_thresholds("none, 0.9, 1") == [None, 0.9, 1.0]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0", r"^--threshold must be in \(0, 1\] \(got 0\)$"),
        ("1.5", r"^--threshold must be in \(0, 1\] \(got 1.5\)$"),
        ("-0.2", r"^--threshold must be in \(0, 1\] \(got -0.2\)$"),
        ("nan", r"^--threshold must be in \(0, 1\] \(got nan\)$"),
        ("0.9,high", r"^--threshold: 'high' is not a number in \(0, 1\] or none$"),
        ("0.7,,0.9", r"^--threshold: '' is not a number"),
        ("0.9,0.90", r"^--threshold: 0.90 is given twice$"),
    ],
)
def test_bad_thresholds_are_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_thresholds(text)


def _row(method: str, depth: float, accuracy: float, **extra: object) -> dict:
    return {"method": method, "decode_policy": "none", "task": "needle", "context_length": 128,
            "depth": depth, "accuracy": accuracy, "samples": 2, "seconds": 0.1, **extra}  # fmt: skip


def _report(path, rows: list[dict], **header: object) -> None:
    body = {"title": "t", "train_length": 128, "command": path.stem, "seconds": 1.0, **header, "rows": rows}
    path.write_text(json.dumps(body))


def test_merge_keeps_an_old_report_without_threshold_or_tpf(tmp_path) -> None:
    """A report written before rows carried ``threshold`` and ``tpf`` merges with a new one: its rows are
    one token per step (a new 1/step row of the same cell wins), cells at a threshold are separate cells,
    and its rows stay out of the TPF table only."""
    old = [_row("vanilla", 0.0, 0.5), _row("vanilla", 1.0, 0.25)]
    new = [
        _row("vanilla", 0.0, 1.0, threshold=None, tpf=1.0, tokens=16, forwards=16),
        _row("vanilla", 0.0, 0.75, threshold=0.9, tpf=2.0, tokens=16, forwards=8),
        _row("vanilla", 1.0, 0.5, threshold=0.9, tpf=4.0, tokens=12, forwards=3),
    ]
    _report(tmp_path / "old.json", old)
    _report(tmp_path / "new.json", new, threshold="1/step, 0.9")
    header, rows = merge([tmp_path / "old.json", tmp_path / "new.json"])
    cells = {(r.get("threshold"), r["depth"]): r for r in rows}
    assert len(rows) == 4 and set(cells) == {(None, 0.0), (None, 1.0), (0.9, 0.0), (0.9, 1.0)}
    assert cells[(None, 0.0)]["accuracy"] == 1.0  # the later run's cell wins
    assert "tpf" not in cells[(None, 1.0)]  # the old row, as it was
    assert header["threshold"].startswith("1/step, 0.9 (") and "first EOS" in header["tpf"]

    assert report_main([str(tmp_path / "old.json"), str(tmp_path / "new.json"), "--out", str(tmp_path),
                        "--name", "m"]) == 0  # fmt: skip
    md = (tmp_path / "m.md").read_text()
    assert "| vanilla | 1/step | 128 | 100 | 25 | 62.5 |" in md  # exact match: old and new 1/step cells
    assert "| vanilla | 0.9 | 128 | 75 | 50 | 62.5 |" in md
    tpf_table = md.split("## needle (tokens per forward)")[1]
    assert "| vanilla | 1/step | 128 | 1.00 | — | 1.00 |" in tpf_table  # the old depth-1 row has none
    # all: pooled, (16 + 12) / (8 + 3), not the mean of 2.0 and 4.0
    assert "| vanilla | 0.9 | 128 | 2.00 | 4.00 | 2.55 |" in tpf_table
    assert (tmp_path / "m_needle.png").stat().st_size > 0


def test_merge_of_old_reports_only_is_unchanged_but_for_the_threshold_column(tmp_path) -> None:
    _report(tmp_path / "a.json", [_row("vanilla", 0.0, 0.5)])
    _report(tmp_path / "b.json", [_row("pdllm", 0.0, 1.0)])
    header, rows = merge([tmp_path / "a.json", tmp_path / "b.json"])
    assert len(rows) == 2 and "tpf" not in header
    write_markdown(rows, header, tmp_path / "m.md")
    md = (tmp_path / "m.md").read_text()
    assert "| pdllm | 1/step | 128 | 100 | 100.0 |" in md and "tokens per forward" not in md
