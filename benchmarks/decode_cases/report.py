"""The decode_engine report: the JSON rows and the markdown, one section per case."""

from __future__ import annotations

import json

from benchmarks.decode_cases.bench import Bench
from benchmarks.harness import fmt, ratio, table, write_report


def base_case(case: str) -> str:
    """The case a stored case key runs (``rounds+replayed``, ``rounds+32k``: ``rounds``)."""
    return case.split("+")[0]


def markdown(report: dict) -> str:
    meta = report["meta"]
    smoke = " (CPU SMOKE: tiny models, not a measurement)" if meta["smoke"] else ""
    lines = [f"# Decode policies: speed, forwards and tokens per forward per policy{smoke}", "",
             f"{meta['device']}, {meta['date']}, `{meta['command']}` (commit {meta['commit']})", "",
             "Columns: `round ms` = seconds per step (loop) or per round (batch); `fwd/round` = model forwards "
             "per round (a packed round of many requests = 1); `TPF` = tokens one request decoded per forward. "
             "Speedups are against rows of the same run."]  # fmt: skip
    for case, info in report["cases"].items():
        rows = [r for r in report["rows"] if _case(r) == case]
        lines += ["", f"## {case}: {info['title']}", "",
                  f"{info.get('device', meta['device'])}, {info.get('date', meta['date'])}, "
                  f"{info.get('elapsed_s', 0):.0f} s. {info.get('setup', '')}", ""]  # fmt: skip
        lines += case_table(base_case(case), rows)
        if base_case(case) == "loop":
            lines += whole_prompt(rows)
        if base_case(case) == "rounds-e2e" and info.get("e2e"):
            lines += ["", "pdllm (fixed phases + rounds) vs Fast-dLLM's dual cache on the whole prompt and vanilla "
                      "decoding (one token per step, no cache: its step timed over the steps listed, times gen), "
                      "batch 1:", ""]  # fmt: skip
            lines += table(["context", "gen", "pdllm policy", "pdllm s", "dual cache (whole prompt) s", "speedup",
                            "vanilla s (steps timed)", "vs vanilla"],
                           [[str(e["context_tokens"]), str(e["gen_length"]), e["pdllm_policy"], fmt(e["pdllm_s"]),
                             fmt(e["dual_cache_whole_prompt_s"]), ratio(e["speedup"]),
                             f"{fmt(e.get('vanilla_s'))} ({e.get('vanilla_steps_timed', '—')})",
                             ratio(e.get("speedup_vs_vanilla"))] for e in info["e2e"]])  # fmt: skip
        for name in ("skipped", "errors"):
            if info.get(name):
                lines += ["", f"{name.capitalize()} ({len(info[name])}):", ""]
                lines += [f"- {json.dumps(x)}" for x in info[name]]
    return "\n".join(lines) + "\n"


def _replayed(r: dict) -> str:
    """A row's pace: one token per step, or a replayed schedule and its recorded TPF; where the policy has
    replayed work, each forced fraction -> as measured, or ``own work`` (nothing recorded to force)."""
    if not r.get("replayed"):
        return "no"
    out = f"yes ({fmt(r.get('recorded_tpf'))})"
    if "sparsity" not in r:
        return out
    forced, measured = r.get("replayed_fractions"), r.get("measured_fractions") or {}
    if not forced:
        return f"{out}; own work"
    return (
        out
        + "; "
        + ", ".join(f"{k} {fmt(v, '.3f')} -> {fmt(measured.get(k), '.3f')}" for k, v in forced.items())
    )


def _kv_mib(r: dict) -> str:
    """A rounds row's pool bytes per request (``cache_bytes``: static KV + policy cache), its static share."""
    if r.get("cache_bytes") is None:
        return "—"
    return f"{r['cache_bytes'] / 2**20:.2f} ({r['static_kv_bytes'] / 2**20:.2f})"


def _common(r: dict) -> list[str]:
    return [fmt(r["tokens_per_s"], ".1f"), fmt(r["round_ms"]), fmt(r["forwards_per_round"]), fmt(r["tpf"]),
            ratio(r["speedup_vs_vanilla"]), ratio(r["speedup_vs_dual_cache"])]  # fmt: skip


COMMON = ["tokens/s", "round ms", "fwd/round", "TPF", "vs vanilla", "vs dual cache"]


def case_table(case: str, rows: list[dict]) -> list[str]:
    if not rows:
        return ["(no rows)"]
    if case == "polestar-tpf":
        return table(["task", "context", "method", "policy", "forwards", "tokens", "TPF", "fwd/round", "accuracy",
                      "agreement", "rows recomputed"],
                     [[r["task"], str(r["context_tokens"]), r["method"], r["policy"], str(r["forwards"]),
                       str(r["tokens"]), fmt(r["tpf"]), fmt(r["forwards_per_round"]),
                       "—" if r["accuracy"] is None else f"{100 * r['accuracy']:.0f}%",
                       f"{100 * r['agreement']:.1f}%",
                       "—" if r.get("recomputed_frac") is None else f"{100 * r['recomputed_frac']:.1f}%"]
                      for r in rows])  # fmt: skip
    if case == "focus-batched":
        return table(["model", "policy", "batch", "gen", *COMMON[:4], "vs plain batched", "vs plain rounds",
                      "rows computed / plain", "peak GiB", "replayed (recorded TPF)"],
                     [[r["model"], r["policy"], str(r["batch"]), str(r["gen_length"]), *_common(r)[:4],
                       ratio(r["speedup_vs_vanilla"]), ratio(r.get("speedup_vs_plain_rounds")), fmt(r["rows_frac"]),
                       fmt(r["peak_gib"]), _replayed(r)] for r in rows])  # fmt: skip
    if case == "serve":
        return table(["policy", "concurrency x context", "requests", "failed", "req/s", "vs none", "step p50 ms",
                      "step p99 ms", "unloaded step ms", "p99 / unloaded", "file", "vs file"],
                     [[r["policy"], f"{r['concurrency']} x {r['context_tokens']}", str(r["requests"]),
                       str(r["failed"]), fmt(r["requests_per_s"]), ratio(r["vs_none"]), fmt(r["step_p50_ms"]),
                       fmt(r["step_p99_ms"]), fmt(r["unloaded_step_ms"]), ratio(r["p99_over_unloaded"]), r["file"],
                       r["none_file"] or "—"]
                      for r in rows])  # fmt: skip
    if case == "mixed":
        return table(["policies", "batch", "round ms", "fwd/round", "rows/round", "ms per 1K rows", "dual-cache round / this",
                      "peak GiB"],
                     [[r["policy"], str(r["batch"]), fmt(r["round_ms"]), fmt(r["forwards_per_round"]),
                       fmt(r["rows_per_round"]), fmt(r.get("ms_per_1k_rows")), ratio(r["speedup_vs_dual_cache"]),
                       fmt(r["peak_gib"])]
                      for r in rows])  # fmt: skip
    if case in ("rounds", "rounds-e2e"):
        return table(["method", "context", "gen", "batch", "policy", *COMMON, "timed blocks", "peak GiB",
                      "KV MiB / request (static)", "replayed (recorded TPF)"],
                     [[r["method"], str(r["context_tokens"]), str(r["gen_length"]), str(r["batch"]), r["policy"],
                       *_common(r), r["timed_blocks"], fmt(r["peak_gib"]), _kv_mib(r), _replayed(r)]
                      for r in rows])  # fmt: skip
    head = ["method", "context", "gen", "policy", *COMMON, "peak GiB", "timing", "fixed phases s",
            "refreshes / forwards (policy's)"]  # fmt: skip
    extra_head = {
        "compute-skip": ["rows computed / plain"],
        "polestar": ["knobs", "updates", "rows recomputed"],
    }
    out = []
    for r in rows:
        c = r.get("cache") or {}
        counts = f"{c['refreshes']} / {c['forwards']}" if "refreshes" in c else "—"
        cells = [r["method"], str(r["context_tokens"]), str(r["gen_length"]), r["policy"], *_common(r),
                 fmt(r["peak_gib"]), r["timing"], fmt(r["fixed_phases_s"]), counts]  # fmt: skip
        if case == "compute-skip":
            cells.append(fmt(r.get("rows_frac")))
        if case == "polestar":
            knobs = json.dumps(r["knobs"]) if r.get("knobs") else "—"
            cells += [knobs, fmt(r.get("updates")), fmt(r.get("rows_recomputed"))]
        out.append(cells)
    lines = table(head + extra_head.get(case, []), out)
    shared: dict[str, list[str]] = {}
    for r in rows:
        if r.get("measured_in"):
            shared.setdefault(r["measured_in"], []).append(r["policy"])
    for other, policies in shared.items():
        lines += [
            "",
            f"Rows {', '.join(policies)}: the runs of case `{other}` (same configuration, same run).",
        ]
    return lines


def whole_prompt(rows: list[dict]) -> list[str]:
    """pdllm against what a user would run instead: Fast-dLLM's dual cache on the whole prompt (vanilla
    method), same context and gen: the loop's ratio and the end-to-end one (pdllm's fixed phases in)."""
    dual = {(r["context_tokens"], r["gen_length"]): r for r in rows
            if (r["method"], r["policy"]) == ("vanilla", "dual-cache")}  # fmt: skip
    out = []
    for r in rows:
        base = dual.get((r["context_tokens"], r["gen_length"]))
        if r["method"] == "pdllm" and base is not None:
            out.append([str(r["context_tokens"]), str(r["gen_length"]), r["policy"],
                        ratio(base["loop_s"] / r["loop_s"]), ratio(base["wall_s"] / r["wall_s"])])  # fmt: skip
    if not out:
        return []
    head = ["", "pdllm vs Fast-dLLM dual cache on the whole prompt (`--method vanilla --decode-policy "
            "dual-cache`), same context and gen:", ""]  # fmt: skip
    return head + table(["context", "gen", "pdllm policy", "loop speedup", "end-to-end speedup"], out)


def _keyed(row: dict, suffix: str) -> dict:
    """The row under its stored case key (``serve:<policy>`` keeps its policy after the key)."""
    case, sep, rest = row["case"].partition(":")
    return row | {"case": case + suffix + sep + rest}


def _case(row: dict) -> str:
    """The case a row belongs to (``serve:<policy>`` rows: ``serve``)."""
    return row["case"].split(":")[0]


def write(bench: Bench, meta: dict, kept: dict, case_order: list[str]) -> None:
    """The report: this run's cases, after the kept ones of an earlier file (``--update``), in
    ``case_order``."""
    tag = bench.args.tag or ("replayed" if bench.replay is not None else "")
    suffix = f"+{tag}" if tag else ""
    mine = {c + suffix: m for c, m in bench.cases.items()}
    rows = [r for r in kept.get("rows", []) if _case(r) not in mine] + [_keyed(r, suffix) for r in bench.rows]
    cases = {c: m for c, m in kept.get("cases", {}).items() if c not in mine} | mine
    order = sorted(cases, key=lambda c: (case_order.index(base_case(c)), c != base_case(c), c))
    report = {"device": meta["device"], "meta": meta, "cases": {c: cases[c] for c in order},
              "rows": sorted(rows, key=lambda r: order.index(_case(r)))}  # fmt: skip
    write_report(bench.args.out, bench.args.name, report, markdown(report))
