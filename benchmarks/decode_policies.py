"""One table of every decode policy: quality rows (``pdllm eval`` on named models) beside speed rows
(``decode_engine.py`` on random weights at 7B shapes, replayed or not), in one schema.

    python benchmarks/decode_policies.py --speed benchmarks/results/decode_engine.json \\
        --quality judge-dream=q/long-answer_none.json judge-dream=q/long-answer_dual-cache.json ... \\
        --out benchmarks/results

Quality rows: one per (model, task, method, policy, threshold, context), the eval's depth cells pooled:
``accuracy`` and ``token_accuracy`` weighted by samples, ``tpf`` = answer tokens / forwards over the cell's
samples (the eval's own counts). Speed rows: the per-policy cases of ``decode_engine.json`` (loop, rounds,
rounds-e2e, focus-batched, polestar, compute-skip), model ``random`` unless the row names one. A field a row
kind does not measure is null. Writes ``decode_policies.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import sys
from pathlib import Path
from typing import Any

FIELDS = ("kind", "model", "case", "task", "policy", "method", "threshold", "tpf", "accuracy", "token_accuracy",
          "samples", "replayed", "tokens_per_s", "speedup_vs_vanilla", "speedup_vs_dual_cache", "speedup_vs_plain",
          "batch", "context_tokens", "gen_length", "cache_bytes", "device", "source")  # fmt: skip
SPEED_CASES = ("loop", "rounds", "rounds-e2e", "focus-batched", "polestar", "compute-skip")


def quality_rows(model: str, path: Path) -> list[dict[str, Any]]:
    """The eval file's cells pooled over depths, one row per (task, method, policy, threshold, length)."""
    data = json.loads(path.read_text())
    groups: dict[tuple, list[dict]] = collections.defaultdict(list)
    for r in data["rows"]:
        key = (
            r["task"],
            r["method"],
            r.get("decode_policy", "none"),
            r.get("threshold"),
            r["context_length"],
        )
        groups[key].append(r)
    out = []
    for (task, method, policy, threshold, length), cells in groups.items():
        n = sum(c["samples"] for c in cells)
        tokens, forwards = sum(c.get("tokens", 0) for c in cells), sum(c.get("forwards", 0) for c in cells)
        token_acc = [c for c in cells if "token_accuracy" in c]
        row = dict.fromkeys(FIELDS)
        row.update(kind="quality", model=model, task=task, policy=policy, method=method, threshold=threshold,
                   accuracy=sum(c["accuracy"] * c["samples"] for c in cells) / n, samples=n,
                   token_accuracy=(sum(c["token_accuracy"] * c["samples"] for c in token_acc)
                                   / sum(c["samples"] for c in token_acc)) if token_acc else None,
                   tpf=tokens / forwards if forwards else None, replayed=False, context_tokens=length,
                   device=data.get("device"), source=path.name)  # fmt: skip
        out.append(row)
    return out


def speed_rows(path: Path) -> list[dict[str, Any]]:
    """The per-policy speed rows of a ``decode_engine.json``, each with its case's device."""
    data = json.loads(path.read_text())
    cases = data.get("cases", {})
    out = []
    for r in data["rows"]:
        if r["case"].split("+")[0] not in SPEED_CASES:  # rounds+replayed: a --schedule run of rounds
            continue
        row = dict.fromkeys(FIELDS)
        row.update({k: r.get(k) for k in FIELDS if k in r})
        row.update(kind="speed", model=r.get("model", "random"), replayed=bool(r.get("replayed", False)),
                   speedup_vs_plain=r.get("speedup_vs_plain_rounds", r.get("speedup_vs_plain")),
                   device=cases.get(r["case"], {}).get("device", data.get("device")), source=path.name)  # fmt: skip
        out.append(row)
    return out


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def markdown(rows: list[dict[str, Any]], command: str, date: str) -> str:
    lines = ["# Decode policies: quality and speed in one table", "", f"{date}, `{command}`", "",
             "Quality rows: `pdllm eval` on the named model, depth cells pooled (accuracy: exact answers; token "
             "accuracy: answer positions equal to the reference; TPF: answer tokens up to the first EOS over "
             "forwards). Speed rows: `decode_engine.py` at 7B shapes on random weights (`random`), one token per "
             "step unless `replayed` (recorded unmask counts); speedups against baselines of the same run.", ""]  # fmt: skip
    for kind, cols in (
        ("quality", ("model", "task", "method", "policy", "threshold", "accuracy", "token_accuracy", "tpf",
                     "samples", "context_tokens", "device")),
        ("speed", ("model", "case", "method", "policy", "batch", "context_tokens", "gen_length", "replayed", "tpf",
                   "tokens_per_s", "speedup_vs_vanilla", "speedup_vs_dual_cache", "speedup_vs_plain", "cache_bytes",
                   "device")),
    ):  # fmt: skip
        part = [r for r in rows if r["kind"] == kind]
        if not part:
            continue
        lines += [f"## {kind}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(_cell(r[c]) for c in cols) + " |" for r in part]
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Left: each policy's speed against the dual cache of the same run (the rounds cases, the dual
    cache's own rows left out); right: long-answer token accuracy against TPF, one marker per judge."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed = [r for r in rows if r["kind"] == "speed" and r["case"].split("+")[0] == "rounds"
             and r["policy"] != "dual-cache" and r["speedup_vs_dual_cache"]]  # fmt: skip
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, max(4.8, 0.16 * len(speed))))
    labels = [f"{r['case'].partition('+')[2] or 'rounds'} | {r['policy']} {r['method']} "
              f"{r['context_tokens']} b{r['batch']}" for r in speed]  # fmt: skip
    ax1.barh(range(len(speed)), [r["speedup_vs_dual_cache"] for r in speed],
             color=["tab:orange" if r["replayed"] else "tab:blue" for r in speed])  # fmt: skip
    ax1.axvline(1.0, color="grey", lw=0.8)
    ax1.set_yticks(range(len(speed)), labels, fontsize=6)
    ax1.invert_yaxis()
    ax1.set(xlabel="tokens/s vs dual cache (same run)",
            title="speed, decode rounds (orange: replayed schedule; label: case tag | policy method context batch)")  # fmt: skip
    ax1.title.set_fontsize(8)
    quality = [r for r in rows if r["kind"] == "quality" and r["tpf"] and r["task"] == "long-answer"]
    markers = dict(zip(sorted({r["model"] for r in quality}), "o^sDv"))
    colors = dict(
        zip(sorted({r["policy"] for r in quality}), plt.rcParams["axes.prop_cycle"].by_key()["color"])
    )
    for (model, policy), marker in sorted(
        {(r["model"], r["policy"]): markers[r["model"]] for r in quality}.items()
    ):
        pts = [r for r in quality if (r["model"], r["policy"]) == (model, policy)]
        ax2.scatter([r["tpf"] for r in pts], [100 * r["token_accuracy"] for r in pts], marker=marker,
                    color=colors[policy], s=20, label=f"{model}: {policy}")  # fmt: skip
    ax2.set(xlabel="tokens per forward", ylabel="token accuracy, %", title="long answers: quality vs TPF")
    if quality:
        ax2.legend(fontsize=6, ncol=2)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _named(spec: str) -> tuple[str, Path]:
    name, sep, path = spec.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected MODEL=PATH (e.g. judge-dream=q/long_none.json)")
    return name, Path(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--speed", type=Path, nargs="*", default=[], help="decode_engine.json files")
    ap.add_argument("--quality", type=_named, nargs="*", default=[], metavar="MODEL=PATH",
                    help="pdllm eval JSON files, each named by its model")  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default="decode_policies")
    args = ap.parse_args(argv)
    missing = [str(p) for p in [*args.speed, *(p for _, p in args.quality)] if not p.is_file()]
    if missing:
        ap.error(f"not found: {', '.join(missing)}")
    rows = [r for name, p in args.quality for r in quality_rows(name, p)]
    rows += [r for p in args.speed for r in speed_rows(p)]
    if not rows:
        ap.error("no rows: give --speed and/or --quality files")
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    command = "python benchmarks/decode_policies.py " + " ".join(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"date": date, "command": command, "fields": list(FIELDS)}
    (args.out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (args.out / f"{args.name}.md").write_text(markdown(rows, command, date))
    try:
        plot(rows, args.out / f"{args.name}.png")
    except ImportError:
        print("matplotlib is not installed: no plot written", file=sys.stderr)
    print(f"{len(rows)} rows -> {args.out / args.name}.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
