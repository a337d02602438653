"""Serving reports: one ``benchmarks/serving.py`` run's files, and several runs merged into one file set.

    python -m benchmarks.serving_report --out benchmarks/results --name serving RUN.json [RUN.json ...]
    # a new run appended to the merged report (its runs kept; NAME=PATH names a run):
    python -m benchmarks.serving_report --out benchmarks/results benchmarks/results/serving.json x4=new.json

Inputs: serving.py JSONs (one run each; named NAME, else the file's stem less ``serving_``) or merged reports
(their runs kept). Rows gain ``run``, ``device``, ``date``, ``command``; ``runs`` keeps each run's head, meta,
overhead, handoff and decode rounds. A later input's row replaces the same (run, layout, workload, context,
concurrency). Comparisons stay within a run: ``ratios`` (tagged with the run) and each run's
``meta.targets_x4``. A split row (NpMd, built on one side) without ``sim_req_s`` gets the router simulator's
value on the committed H100 costs (``serving.simulator_costs``); its run's ``meta.sim_costs`` says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make benchmarks importable
    sys.path.insert(0, str(ROOT))

from benchmarks.serving import ROW_DEFAULTS, ROW_KEYS, parse_layout, simulated_req_s, simulator_costs  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MERGED_NOTE = ("One section per run of benchmarks/serving.py (Dream-7B shapes, random bf16 weights). Ratios and "
               "targets compare rows of the same run only: runs differ in GPU, date and code. What the numbers "
               "mean: serving_notes.md.")  # fmt: skip


TARGET_SPLIT_RATIO = 1.7  # split prefill/decode (two GPUs) vs the all-in-one, requests/s
# four GPUs at the same context and concurrency, same run: the best layout vs the one-GPU all-in-one;
# the best NpMd vs replicas4, its step p99 vs its unloaded step; the simulator vs each NpMd row
TARGET_X4 = {"best_vs_all_in_one": 3.6, "split_vs_replicas": 0.9, "split_step_p99_over_unloaded": 2.0,
             "sim_error": 0.10}  # fmt: skip


# ---------------------------------------------------------------------------------------- one run
def targets_x4(rows: list[dict]) -> list[dict]:
    """The four-GPU targets per (workload, context, concurrency) that has rows on 4 GPUs of their own
    (not squeezed) and a one-GPU all-in-one row, same run (``TARGET_X4``); None where a row is missing."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (r.get("workload", "unique"), r["context_tokens"], r["concurrency"])
        groups.setdefault(key, {})[r["layout"]] = r
    out = []
    for (workload, ctx, conc), by in groups.items():
        four = {x: r for x, r in by.items() if r["gpus"] == 4 and not r.get("shared_gpu")}
        aio = by.get("all-in-one")
        if not four or aio is None or not aio["requests_per_s"]:
            continue
        best = max(four.values(), key=lambda r: r["requests_per_s"])
        splits = [r for x, r in four.items() if parse_layout(x).split]
        split = max(splits, key=lambda r: r["requests_per_s"]) if splits else None
        rep = next((r for x, r in four.items() if parse_layout(x).replicas), None)
        vs_rep = split["requests_per_s"] / rep["requests_per_s"] if split and rep and rep["requests_per_s"] else None  # fmt: skip
        p99 = split["step_p99_ms"] / split["unloaded_step_ms"] if split and split["unloaded_step_ms"] else None  # fmt: skip
        sims = {r["layout"]: r["sim_req_s"] / r["requests_per_s"] - 1 for r in splits
                if r.get("sim_req_s") is not None and r["requests_per_s"]}  # fmt: skip
        met = lambda v, ok: None if v is None else bool(ok(v))  # noqa: E731
        out.append({"workload": workload, "context_tokens": ctx, "concurrency": conc, "best": best["layout"],
                    "best_vs_all_in_one": best["requests_per_s"] / aio["requests_per_s"],
                    "best_met": best["requests_per_s"] / aio["requests_per_s"] >= TARGET_X4["best_vs_all_in_one"],
                    "best_split": split["layout"] if split else None, "split_vs_replicas": vs_rep,
                    "split_vs_replicas_met": met(vs_rep, lambda v: v >= TARGET_X4["split_vs_replicas"]),
                    "split_step_p99_over_unloaded": p99,
                    "split_step_met": met(p99, lambda v: v <= TARGET_X4["split_step_p99_over_unloaded"]),
                    "sim_error": sims, "sim_met": met(sims or None, lambda v: max(map(abs, v.values()))
                                                      <= TARGET_X4["sim_error"]),
                    "every_request_answered": all(r["failed"] == 0 for r in [aio, *four.values()]),
                    "targets": TARGET_X4})  # fmt: skip
    return out


def ratios(rows: list[dict]) -> list[dict]:
    """Each layout's requests/s over the all-in-one's at the same context and concurrency (same run)."""

    def key(r: dict) -> tuple:
        return r.get("workload", "unique"), r["context_tokens"], r["concurrency"]

    alone = {key(r): r for r in rows if r["layout"] == "all-in-one"}
    out = []
    for r in rows:
        base = alone.get(key(r))
        if r["layout"] == "all-in-one" or base is None or not base["requests_per_s"]:
            continue
        value = r["requests_per_s"] / base["requests_per_s"]
        answered = r["failed"] == 0 and base["failed"] == 0
        split = r["layout"].startswith("1p1d")
        out.append({"layout": r["layout"], "workload": key(r)[0], "context_tokens": r["context_tokens"],
                    "concurrency": r["concurrency"],
                    "vs_all_in_one": value, "target_min": TARGET_SPLIT_RATIO if split else None,
                    "met": (answered and value >= TARGET_SPLIT_RATIO) if split else None,
                    "every_request_answered": answered})  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------- report
def _f(value: object, none: str = "None") -> str:
    return none if value is None else format(value, ".4g") if isinstance(value, float) else str(value)


def write(out: Path, name: str, report: dict) -> None:
    """One serving.py run's report (the run's own schema): ``name``.json, .md and .png under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    label = "CPU SMOKE (tiny random model; not a GPU result)" if report["meta"]["smoke"] else report["device"]
    lines = [f"# Serving concurrency sweep — {label}, {report['date']}", "", f"`{report['command']}`", ""]
    (out / f"{name}.md").write_text("\n".join(lines + run_lines(report)) + "\n")
    plot(out / f"{name}.png", report)


def run_lines(report: dict) -> list[str]:
    """A run's Markdown below its header: the setup, the rows, the ratios, the simulator, the four-GPU
    targets, the service overhead, the handoff, the decode rounds, skipped cells and errors."""
    meta = report["meta"]
    lines = [f"Model {meta['model'].get('hidden_size')}-hidden x {meta['model'].get('num_hidden_layers')} layers, "
             f"random {meta['dtype']} weights; C={meta['engine']['chunk_size']}, K={meta['engine']['top_k']}; "
             f"gen {meta['gen_length']} ({meta['steps']} steps); serve flags: {' '.join(meta['serve_flags']) or 'none'}; "
             f"warm-up burst: {meta['warm_burst']}; requests per cell: {meta['requests_per_cell']}. GPUs visible: "
             f"{meta['gpus_visible']}. Runtime {meta.get('runtime_s', 0):.0f} s of a {meta['budget_s']:.0f} s budget.",
             "", "| " + " | ".join(ROW_KEYS) + " |", "|" + "---|" * len(ROW_KEYS)]  # fmt: skip
    lines += ["| " + " | ".join(_f(r.get(k, ROW_DEFAULTS.get(k)), "—") for k in ROW_KEYS) + " |" for r in report["rows"]]  # fmt: skip
    notes: dict[str, list[str]] = {}  # rows merged from other runs say how they differ (e.g. a shared GPU)
    for r in (r for r in report["rows"] if r.get("note")):
        notes.setdefault(r["note"], []).append(f"{r['layout']} x{r['concurrency']} @ {r['context_tokens']}")
    lines += [""] * bool(notes) + [f"Rows {', '.join(rows)}: {note}" for note, rows in notes.items()]
    lines += ratio_lines(report, meta)
    if report.get("handoff"):  # kv_handoff.py's list: one decode KV moved from a prefill to a decode worker
        keys = list(report["handoff"][0])
        lines += ["", f"KV handoff ({meta.get('handoff', {}).get('note', 'kv_handoff.py')}):", "",
                  "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]  # fmt: skip
        lines += ["| " + " | ".join(_f(h[k]) for k in keys) + " |" for h in report["handoff"]]
    if report["decode_round"]:
        keys = list(dict.fromkeys(k for r in report["decode_round"] for k in r))
        lines += ["", "Batched decode rounds (decode_rounds.py):", "", "| " + " | ".join(keys) + " |",
                  "|" + "---|" * len(keys)]  # fmt: skip
        lines += ["| " + " | ".join(_f(r.get(k, "")) for k in keys) + " |" for r in report["decode_round"]]
    for part in ("skipped", "errors"):
        if meta[part]:
            lines += ["", f"{part.capitalize()}:", ""] + [f"- {json.dumps(x) if isinstance(x, dict) else x}"
                                                           for x in meta[part][:20]]  # fmt: skip
    return lines


def ratio_lines(report: dict, meta: dict) -> list[str]:
    """The layouts against the all-in-one, and the single-request service overhead (when measured)."""
    lines: list[str] = []
    if report.get("ratios"):
        where = " (some layouts on one GPU: not a multi-GPU claim)" if meta.get("shared_gpu") else ""
        lines += ["", f"Requests/s against the all-in-one at the same context and concurrency, same run{where}:", "",
                  "| layout | workload | context | concurrency | vs all-in-one | target | met | answers equal all-in-one |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        rows = {(r["layout"], r.get("workload", "unique"), r["context_tokens"], r["concurrency"]): r
                for r in report["rows"]}  # fmt: skip
        for x in report["ratios"]:
            row = rows.get((x["layout"], x.get("workload", "unique"), x["context_tokens"], x["concurrency"]), {})  # fmt: skip
            target = f">= {x['target_min']}x" if x["target_min"] else "—"
            lines.append(f"| {x['layout']} | {x.get('workload', 'unique')} | {x['context_tokens']} | {x['concurrency']} "
                         f"| {x['vs_all_in_one']:.2f}x "
                         f"| {target} | {_f(x['met'])} | {row.get('answers_equal_all_in_one') or '—'} |")  # fmt: skip
    sims = [r for r in report["rows"] if r.get("sim_req_s") is not None]
    if sims:
        lines += ["", "Router simulator (router_sim.py on the committed H100 costs, see meta.simulator) against "
                  "the measured rows:", "", "| layout | workload | context | concurrency | measured req/s | "
                  "simulated | simulated / measured |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['layout']} | {r.get('workload', 'unique')} | {r['context_tokens']} | {r['concurrency']} "
                  f"| {r['requests_per_s']:.3g} | {r['sim_req_s']:.3g} | "
                  + (f"{r['sim_req_s'] / r['requests_per_s']:.2f} |" if r["requests_per_s"] else "— |")
                  for r in sims]  # fmt: skip
    if meta.get("targets_x4"):
        f = lambda v, fmt: "—" if v is None else format(v, fmt)  # noqa: E731
        lines += ["", "Four-GPU targets (same context and concurrency, same run):", "",
                  "| workload | context | concurrency | best / all-in-one (>= 3.6x) | best split / replicas4 (>= 0.9) "
                  "| its step p99 / unloaded (<= 2) | simulated / measured - 1 (within 10%) |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        for t in meta["targets_x4"]:
            sims = ", ".join(f"{x} {v:+.0%}" for x, v in t["sim_error"].items()) or "—"
            lines.append(f"| {t['workload']} | {t['context_tokens']} | {t['concurrency']} | {t['best']} "
                         f"{t['best_vs_all_in_one']:.2f}x ({t['best_met']}) | {t['best_split'] or '—'} "
                         f"{f(t['split_vs_replicas'], '.2f')} ({t['split_vs_replicas_met']}) | "
                         f"{f(t['split_step_p99_over_unloaded'], '.2f')} ({t['split_step_met']}) | {sims} "
                         f"({t['sim_met']}) |")  # fmt: skip
    o = report.get("overhead")
    if o:
        lines += ["", f"Single-request service overhead ({o['requests']} requests of {o['context_tokens']} tokens, "
                  "unary, one at a time; the in-process engine first, before any server):", "",
                  "| in-process median s | served (--role all) median s | overhead | target | met | answers equal |",
                  "|---|---|---|---|---|---|",
                  f"| {o['in_process']['median_s']:.3f} | {o['served']['median_s']:.3f} | {o['service_overhead']:+.1%} "
                  f"| <= {o['target_max']:.0%} | {o['met']} | {o['answers_equal_in_process']} |"]  # fmt: skip
    return lines


def plot(path: Path, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    series: dict[tuple[str, int], list[dict]] = {}
    for r in report["rows"]:
        series.setdefault((r["layout"], r["context_tokens"]), []).append(r)
    for (layout, ctx), rows in series.items():
        rows = sorted(rows, key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rows]
        for ax, key in zip(axes, ("requests_per_s", "step_p99_ms"), strict=True):
            shared = " (on 1 GPU)" if rows[0].get("shared_gpu") else ""
            ax.plot(xs, [r[key] for r in rows], marker="o", label=f"{layout}, {ctx} tok{shared}")
    for ax, title in zip(axes, ("requests / s", "step gap p99 (ms)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    if series:
        axes[0].legend(fontsize=8)
    fig.suptitle(f"pdllm serving sweep — {report['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------- merged runs
def parse_input(spec: str) -> tuple[str | None, Path]:
    """``NAME=PATH`` or ``PATH``: the run's name (None: from the file) and the file."""
    name, sep, path = spec.partition("=")
    return (name, Path(path)) if sep and re.fullmatch(r"[\w.-]+", name) else (None, Path(spec))


def cell(row: dict) -> tuple:
    return row["run"], row["layout"], row["workload"], row["context_tokens"], row["concurrency"]


def fill_sim(rows: list[dict], run: dict, costs: dict, sources: dict) -> list[dict]:
    """``sim_req_s`` for the run's split rows that lack it (``serving.simulated_req_s`` on ``costs``, with
    the run's gen length and ``--max-active``); the rows filled. ``run["meta"]["sim_costs"]`` says so."""
    meta, filled = run["meta"], []
    for r in rows:
        lay = parse_layout(r["layout"])
        if r.get("sim_req_s") is not None or not lay.split:
            continue
        flags = [*meta.get("serve_flags", []), *lay.flags]
        active = int(flags[flags.index("--max-active") + 1]) if "--max-active" in flags else 64
        r["sim_req_s"] = simulated_req_s(lay, r["context_tokens"], r["concurrency"], r["requests"],
                                         meta["gen_length"], costs, active)  # fmt: skip
        if r["sim_req_s"] is not None:
            filled.append(r)
    if filled:
        other = "" if "H100" in run["device"] else ": another GPU, so sim_req_s models H100 workers"
        before = meta.get("sim_costs", {}).get("rows", [])
        meta["sim_costs"] = {
            "rows": before + [f"{r['layout']} {r['workload']} {r['context_tokens']} c{r['concurrency']}" for r in filled],
            "filled_by": "benchmarks/serving_report.py after the run (serving.simulated_req_s)",
            "costs": f"H100 measurements (one request alone on an H100: "
                     f"{', '.join(Path(x['file']).name for x in sources.get('inputs', {}).values())}), not this "
                     f"run's; this run ran on {run['device']}{other}",
            "inputs": sources.get("inputs", {}),
        }  # fmt: skip
    return filled


def merge(inputs: list[tuple[str | None, Path]], command: str = "") -> dict:
    """The merged report of ``inputs`` (run files and merged reports, in order; a later row replaces the
    same cell), split rows' ``sim_req_s`` filled, ratios and four-GPU targets per run."""
    runs: dict[str, dict] = {}
    cells: dict[tuple, dict] = {}
    for name, path in inputs:
        data = json.loads(path.read_text())
        if "runs" in data:  # a merged report: its runs and rows as they are
            runs.update(data["runs"])
            rows = data["rows"]
        else:
            name = name or path.stem.removeprefix("serving_")
            head = {k: data[k] for k in ("device", "date", "command")}
            runs[name] = {**head, "file": path.name, "meta": data["meta"], "overhead": data.get("overhead"),
                          "decode_round": data.get("decode_round") or [], "handoff": data.get("handoff")}  # fmt: skip
            rows = [{"run": name, **r, **head} for r in data["rows"]]
        for r in rows:
            row = {**r, "workload": r.get("workload", "unique"), "hit_rate": r.get("hit_rate"),
                   "sim_req_s": r.get("sim_req_s")}  # fmt: skip
            cells[cell(row)] = row  # a later file's row takes the earlier one's place
    rows = [r for n in runs for r in cells.values() if r["run"] == n]
    costs: tuple[dict, dict] | None = None
    out_ratios = []
    for n, run in runs.items():
        mine = [r for r in rows if r["run"] == n]
        if any(r.get("sim_req_s") is None and parse_layout(r["layout"]).split for r in mine):
            costs = costs or simulator_costs()
            fill_sim(mine, run, *costs)
        out_ratios += [{"run": n, **x} for x in ratios(mine)]
        run["meta"]["targets_x4"] = targets_x4(mine)
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "command": command,
            "rows": rows, "ratios": out_ratios, "runs": runs, "meta": {"runs": list(runs), "note": MERGED_NOTE}}  # fmt: skip


def run_report(report: dict, name: str) -> dict:
    """One run of a merged report in serving.py's own schema (for ``run_lines``)."""
    run = report["runs"][name]
    return {**run, "rows": [r for r in report["rows"] if r["run"] == name],
            "ratios": [x for x in report["ratios"] if x["run"] == name]}  # fmt: skip


def summary(report: dict) -> list[str]:
    """Per run: device, date, layouts, contexts and its best requests/s."""
    lines = ["| run | device | date | layouts | contexts | best req/s |", "|---|---|---|---|---|---|"]
    for n, run in report["runs"].items():
        rows = [r for r in report["rows"] if r["run"] == n]
        if not rows:
            continue
        b = max(rows, key=lambda r: r["requests_per_s"])
        ctxs = ", ".join(f"{c // 1024}K" for c in sorted({r["context_tokens"] for r in rows}))
        lines.append(f"| {n} | {run['device']} | {run['date'][:10]} | "
                     f"{', '.join(dict.fromkeys(r['layout'] for r in rows))} | {ctxs} | "
                     f"{b['requests_per_s']:.2f} ({b['layout']}, {b['workload']}, c={b['concurrency']}) |")  # fmt: skip
    return lines


def write_merged(out: Path, name: str, report: dict) -> None:
    """The merged report: ``name``.json, .md (a summary, then a section per run) and .png under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# Serving benchmark: every current run", "", f"`{report['command']}` ({report['date']})", "",
             MERGED_NOTE, "", *summary(report)]  # fmt: skip
    for n, run in report["runs"].items():
        lines += ["", f"## {n} — {run['device']}, {run['date']}", "", f"`{run['command']}`", ""]
        notes = [run["meta"].get("note"), run.get("note")]
        if sim := run["meta"].get("sim_costs"):
            notes.append(f"sim_req_s of {', '.join(sim['rows'])} filled by {sim['filled_by']}; its costs are {sim['costs']}.")  # fmt: skip
        lines += [x for note in notes if note for x in (f"Note: {note}", "")]
        lines += run_lines(run_report(report, n))
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    plot_merged(out / f"{name}.png", report)


def plot_merged(path: Path, report: dict) -> None:
    """Requests/s against concurrency, a panel per run, a line per (layout, context, workload)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["runs"])
    cols = max(1, min(4, len(names)))
    lines = max(1, math.ceil(len(names) / cols))
    fig, axes = plt.subplots(lines, cols, figsize=(4.4 * cols, 3.6 * lines), squeeze=False)
    for ax, n in zip(axes.flat, names, strict=False):
        series: dict[tuple, list[dict]] = {}
        for r in report["rows"]:
            if r["run"] == n:
                series.setdefault((r["layout"], r["context_tokens"], r["workload"]), []).append(r)
        for (layout, ctx, workload), rows in series.items():
            rows = sorted(rows, key=lambda r: r["concurrency"])
            label = f"{layout}, {ctx // 1024}K" + ("" if workload == "unique" else f", {workload}")
            ax.plot([r["concurrency"] for r in rows], [r["requests_per_s"] for r in rows], marker="o", label=label)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set(title=f"{n}: {report['runs'][n]['device']}", xlabel="concurrency", ylabel="requests / s")
        ax.title.set_fontsize(8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("inputs", nargs="+", help="serving.py JSON files or merged reports, in order; NAME=PATH names a run")  # fmt: skip
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--name", default="serving", help="output file stem (default serving)")
    ap.add_argument("--note", action="append", default=[], help="RUN=TEXT: a note under the run's header")
    args = ap.parse_args(argv)
    command = "python -m benchmarks.serving_report " + shlex.join(sys.argv[1:] if argv is None else argv)
    report = merge([parse_input(x) for x in args.inputs], command)
    for spec in args.note:
        run, _, text = spec.partition("=")
        if run not in report["runs"]:
            ap.error(f"--note {spec!r}: no run {run!r} (runs: {', '.join(report['runs'])})")
        report["runs"][run]["note"] = text
    write_merged(args.out, args.name, report)
    print((args.out / f"{args.name}.md").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
