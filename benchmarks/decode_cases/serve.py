"""The ``serve`` case: rows from ``serving.py`` files, one per decode policy."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from benchmarks.decode_cases.bench import Bench, speedup


def _serve_policy(meta: dict) -> str:
    """The ``--decode-policy`` a serving.py run passed to ``pdllm serve`` (``none`` without one)."""
    flags = " ".join(meta.get("serve_flags") or []).replace("=", " ").split()
    return flags[flags.index("--decode-policy") + 1] if "--decode-policy" in flags else "none"


def _seconds(date: str) -> float:
    return datetime.datetime.fromisoformat(date).timestamp()


def case_serve(bench: Bench) -> None:
    """Rows ``serve:<policy>`` from ``serving.py`` files (``--serving-files``), one per decode policy: its
    most concurrent all-in-one cell, against the no-policy file's."""
    rows = []
    for path in bench.args.serving_files:
        data = json.loads(Path(path).read_text())
        cells = [r for r in data["rows"] if r["layout"] == "all-in-one"]
        if not cells:
            continue
        top = max(cells, key=lambda r: r["concurrency"])
        policy = _serve_policy(data["meta"])
        rows.append({"case": f"serve:{policy}", "policy": policy, "method": "pdllm", "device": data["device"],
                     "date": data["date"], "file": Path(path).name, "context_tokens": top["context_tokens"],
                     "concurrency": top["concurrency"], "batch": top["concurrency"], "requests": top["requests"],
                     "failed": top["failed"], "requests_per_s": top["requests_per_s"],
                     "step_p50_ms": top["step_p50_ms"], "step_p99_ms": top["step_p99_ms"],
                     "unloaded_step_ms": top["unloaded_step_ms"]})  # fmt: skip
    nones = [r for r in rows if r["policy"] == "none"]
    for r in rows:  # against the no-policy run nearest in time (the same machine, when run in one call)
        base = min(nones, key=lambda n: abs(_seconds(n["date"]) - _seconds(r["date"])), default=None)
        r["vs_none"] = speedup(r["requests_per_s"], base["requests_per_s"] if base else None)
        r["none_file"] = base["file"] if base else None
        r["p99_over_unloaded"] = speedup(r["step_p99_ms"], r["unloaded_step_ms"])
        bench.add(r)
    info = bench.meta("serve")
    info["device"] = ", ".join(sorted({r["device"] for r in rows})) or info["device"]
    info["date"] = (
        " to ".join(sorted({min(r["date"] for r in rows), max(r["date"] for r in rows)}))
        if rows
        else info["date"]
    )
    info["setup"] = (
        "`benchmarks/serving.py --layouts all-in-one --serve-flags '--decode-policy P'`, one file per policy "
        "(`--serving-files`), the most concurrent cell of each; vs none = requests/s / that of the no-policy "
        "run nearest in time (run in the same call on the same machine); "
        "step p99 / unloaded = the loaded p99 step over the unloaded one."
    )
