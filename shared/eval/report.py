"""Reports of ``pdllm eval`` runs: Markdown tables, heatmaps (methods side by side, as the paper's
Figure 6), and merging the JSON of several runs (a grid split over device calls) into one report.

A row's cell is its method, confidence threshold, task, context length and depth. Its ``threshold`` is None
for one token per step, as in reports written before rows carried it (a row without the field is read so);
its ``tpf`` (tokens per forward, ``shared/eval/tpf.py``) gets a table per task, whose ``all`` column pools
the row's cells (their summed ``tokens`` over their summed ``forwards``). Rows without ``tpf`` (reports
written before it existed) are left out of that table only.

``python -m pdllm.shared.eval.report --name NAME --out DIR A.json B.json ...``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from pdllm.shared.cli_args import Parser
from pdllm.shared.eval.tpf import TPF_NOTE, describe, threshold_header

METHODS = ("vanilla", "pdllm")


# Per-cell metrics and their table titles; a task gets a table for each metric its rows carry.
METRICS = (
    ("accuracy", "exact match, %"),
    ("token_accuracy", "token accuracy, %"),
    ("agreement", "token agreement with no-cache decoding, %"),
)
# The long-answer task's `accuracy` is the exact-passage rate, the infilling task's the exact-span rate.
TITLES = {("long-answer", "accuracy"): "exact passage, %", ("infilling", "accuracy"): "exact span, %"}
XLABELS = {"long-answer": "gold paragraph depth", "infilling": "depth of the missing span"}
TPF_TITLE = "tokens per forward"


def threshold_of(row: dict) -> float | None:
    """The row's confidence threshold; None (one token per step) where the row has none."""
    return row.get("threshold")


def _threshold_order(t: float | None) -> tuple[bool, float]:
    return (t is not None, t or 0.0)


def _pooled_tpf(rows: list[dict]) -> float:
    """The rows' tokens over their forwards where all carry both, else the mean of their ``tpf``."""
    if all("tokens" in r and "forwards" in r for r in rows) and sum(r["forwards"] for r in rows):
        return sum(r["tokens"] for r in rows) / sum(r["forwards"] for r in rows)
    return sum(r["tpf"] for r in rows) / len(rows)


def _table(rows: list[dict], task: str, metric: str, title: str) -> list[str]:
    """One Markdown table of ``metric`` for ``task``: a line per method, threshold and length."""
    mine = [r for r in rows if r["task"] == task and r.get(metric) is not None]
    if not mine:
        return []
    depths = sorted({r["depth"] for r in rows if r["task"] == task})
    last = "all" if metric == "tpf" else "mean"
    lines = ["", f"## {task} ({title})", ""]
    lines.append("| method | threshold | length | " + " | ".join(f"{d:.0%}" for d in depths) + f" | {last} |")
    lines.append("| --- | --- | --- | " + " | ".join("---" for _ in depths) + " | --- |")
    for method in sorted({r["method"] for r in mine}):
        for threshold in sorted({threshold_of(r) for r in mine}, key=_threshold_order):
            for length in sorted({r["context_length"] for r in mine}):
                cells = {
                    r["depth"]: r
                    for r in mine
                    if (r["method"], threshold_of(r), r["context_length"]) == (method, threshold, length)
                }
                if not cells:
                    continue
                if metric == "tpf":
                    body = " | ".join(f"{cells[d]['tpf']:.2f}" if d in cells else "—" for d in depths)
                    end = f"{_pooled_tpf(list(cells.values())):.2f}"
                else:
                    got = {d: r[metric] for d, r in cells.items()}
                    body = " | ".join(f"{100 * got[d]:.0f}" if d in got else "—" for d in depths)
                    end = f"{100 * sum(got.values()) / len(got):.1f}"
                lines.append(f"| {method} | {describe(threshold)} | {length} | {body} | {end} |")
    return lines


def write_markdown(rows: list[dict], header: dict, path: Path) -> None:
    lines = [f"# {header['title']}", ""]
    lines += [f"- {k}: {v}" for k, v in header.items() if k != "title"]
    for task in sorted({r["task"] for r in rows}):
        for metric, title in METRICS:
            lines += _table(rows, task, metric, TITLES.get((task, metric), title))
        lines += _table(rows, task, "tpf", TPF_TITLE)
    path.write_text("\n".join(lines) + "\n")


def write_tables(rows: list[dict], header: dict, out_dir: Path, name: str) -> Path:
    """``<name>.json`` (header + rows) and ``<name>.md``; returns the Markdown path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps({**header, "rows": rows}, indent=1) + "\n")
    write_markdown(rows, header, out_dir / f"{name}.md")
    return out_dir / f"{name}.md"


def write_heatmaps(rows: list[dict], out_dir: Path, name: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for task in sorted({r["task"] for r in rows}):
        methods = sorted({r["method"] for r in rows if r["task"] == task}, key=METHODS.index)
        thresholds = sorted({threshold_of(r) for r in rows if r["task"] == task}, key=_threshold_order)
        lengths = sorted({r["context_length"] for r in rows if r["task"] == task})
        depths = sorted({r["depth"] for r in rows if r["task"] == task})
        # A panel per method and threshold; titles name the threshold unless every row is one token per step.
        panels = [(m, t) for m in methods for t in thresholds]
        fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.6), squeeze=False)
        for ax, (method, threshold) in zip(axes[0], panels):
            grid = torch.full((len(lengths), len(depths)), float("nan"))
            for r in rows:
                if (r["task"], r["method"], threshold_of(r)) == (task, method, threshold):
                    grid[lengths.index(r["context_length"]), depths.index(r["depth"])] = r["accuracy"]
            im = ax.imshow(grid.numpy(), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
            ax.set_yticks(range(len(lengths)), [str(n) for n in lengths], fontsize=8)
            ax.set_xlabel(XLABELS.get(task, "gold fact depth"))
            if ax is axes[0][0]:
                ax.set_ylabel("context tokens")
            suffix = "" if thresholds == [None] else f", threshold {describe(threshold)}"
            ax.set_title(f"{method}{suffix} — {task}")
            for i in range(len(lengths)):
                for j in range(len(depths)):
                    if not torch.isnan(grid[i, j]):
                        ax.text(j, i, f"{100 * grid[i, j]:.0f}", ha="center", va="center", fontsize=6)
        label = TITLES.get((task, "accuracy"), METRICS[0][1]).removesuffix(", %")
        fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label=label)
        path = out_dir / f"{name}_{task}.png"
        fig.savefig(path, dpi=130, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def merge(paths: list[Path]) -> tuple[dict, list[dict]]:
    """Header of the last run (commands of all joined) and the rows of all; a later run's cell wins.

    The last run's header describes the settings of the cells it won (e.g. a newer default), so it is the
    one to show; earlier runs only fill cells the later ones did not measure. A cell is keyed by its
    threshold too (a row without one: one token per step), and the header's thresholds are those of the
    merged rows.
    """
    runs = [json.loads(p.read_text()) for p in paths]
    if len({r["train_length"] for r in runs}) > 1:
        raise ValueError("runs with different train_length cannot be merged")
    header = {k: v for k, v in runs[-1].items() if k not in ("rows", "seconds", "command")}
    header["command"] = " ; ".join(r.get("command", "?") for r in runs)
    header["seconds"] = round(sum(r.get("seconds", 0.0) for r in runs), 1)
    cells: dict[tuple, dict] = {}
    for run in runs:
        for row in run["rows"]:
            key = (row["method"], threshold_of(row), row["task"], row["context_length"], row["depth"])
            cells[key] = row
    rows = list(cells.values())
    header["threshold"] = threshold_header(sorted({threshold_of(r) for r in rows}, key=_threshold_order))
    if any("tpf" in r for r in rows):
        header["tpf"] = TPF_NOTE
    return header, rows


def main(argv: list[str] | None = None) -> int:
    ap = Parser(
        prog="python -m pdllm.shared.eval.report", description="Merge pdllm eval JSON files into one report."
    )
    ap.add_argument(
        "runs", type=Path, nargs="+", help="JSON files `pdllm eval` wrote; a later run's cell wins"
    )
    ap.add_argument("--out", type=Path, required=True, help="directory of the merged report")
    ap.add_argument("--name", required=True, help="file name stem of the merged report")
    ap.add_argument("--title", default=None, help="report title (default: the last run's)")
    args = ap.parse_args(argv)
    try:
        header, rows = merge(args.runs)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.title:
        header["title"] = args.title
    write_tables(rows, header, args.out, args.name)
    for path in write_heatmaps(rows, args.out, args.name):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
