"""Which prefill:decode worker ratio an 8-GPU node should run, from committed measurements, checked by a
discrete-event simulation of the router (``router_sim.py``).

    python benchmarks/prefill_decode_ratio.py --out benchmarks/results

CPU only, deterministic (seeded): reads committed results and writes ``prefill_decode_ratio.{json,md,png}``
(the PNG when matplotlib is installed). Costs per request, one GPU per worker (Dream-7B shapes, C=1024,
K=4, gen 32 / 32 steps): prefill + scoring and the decode-KV build alone on a GPU (``e2e_speedup.json``;
at 16K the chunk batch is already 16K tokens, so batching requests on a prefill worker adds little); the
batched round time vs active sessions (``decode_rounds.json``, linear between the measured points); the
K=4 handoff (``kv_handoff.json``, CUDA IPC: the workers of one node share a host). The decode round does not
depend on the context length (every session holds the K selected chunks) while the prefill grows with it:
that is what moves the ratio. The merged ``serving.json`` (``serving_report.py``) gives, by run, the
measured 1 prefill + 1 decode GPU layout that checks the simulator (``SERVING_RUNS["check"]``: the two-GPU
16K run) and the all-in-one baseline (``SERVING_RUNS["baseline"]``: the one-GPU H100 sweep; 8 independent
one-GPU servers).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(ROOT))

from benchmarks.router_sim import RoundCurve, SimConfig, simulate  # noqa: E402

GPUS = 8
CONTEXTS = (16384, 32768)  # the context lengths studied (the serving sweeps' lengths)
RESULTS = Path(__file__).resolve().parent / "results"
SERVING_RUNS = {"baseline": "x1", "check": "x2"}  # runs of the merged serving.json read here


# ------------------------------------------------------------------------------------------ inputs
@dataclass(frozen=True)
class Costs:
    context_tokens: int
    prefill_s: float  # prefill + scoring of one request
    build_s: float  # its decode-KV build (K=4 -> 4,100 static tokens)
    handoff_s: float  # pulling the built KV from the prefill worker
    steps: int  # rounds per request
    rounds: RoundCurve


def load_inputs(results: Path) -> tuple[dict[int, Costs], dict]:
    """Per-context costs from the committed files, and where every number came from."""
    e2e = json.loads((results / "e2e_speedup.json").read_text())
    rounds = json.loads((results / "decode_rounds.json").read_text())
    handoff = json.loads((results / "kv_handoff.json").read_text())
    curve = RoundCurve(
        tuple(r["active"] for r in rounds["decode_round"]),
        tuple(r["round_ms"] / 1e3 for r in rounds["decode_round"]),
    )
    ipc = [h for h in handoff["handoff"] if h["transport"] == "pdllm-cuda-ipc" and h["tokens"] == 4100]
    costs = {
        r["context_length"]: Costs(
            r["context_length"],
            r["prefill_s"],
            r["phases_s"]["build"],
            ipc[0]["ms"] / 1e3,
            e2e["meta"]["generation"]["steps"],
            curve,
        )
        for r in e2e["rows"]
        if r["context_length"] in CONTEXTS
    }
    sources = {
        "prefill_s, build_s (per request, alone on the GPU)": _source("e2e_speedup.json", e2e["meta"]),
        "round time vs active sessions (CUDA graphs)": _source("decode_rounds.json", rounds),
        "handoff_s (K=4 decode KV, 4,100 tokens, CUDA IPC)": _source(
            "kv_handoff.json", handoff["meta"], "sender and receiver processes shared one H100"
        ),
    }
    return costs, sources


def serving_run(results: Path, run: str) -> tuple[list[dict], dict]:
    """One run of the merged ``serving.json``: its rows and where they came from."""
    merged = json.loads((results / "serving.json").read_text())
    return [r for r in merged["rows"] if r["run"] == run], _source(
        "serving.json", merged["runs"][run], f"run {run}"
    )


def _source(name: str, meta: dict, note: str = "") -> dict:
    out = {"file": f"benchmarks/results/{name}", "device": meta["device"], "date": meta["date"]}
    out["command"] = meta["command"]
    if note:
        out["note"] = note
    return out


# ---------------------------------------------------------------------------------------- analytic
def capacities(c: Costs, placement: str, max_active: int = 64) -> tuple[float, float, int]:
    """(prefill req/s per GPU, decode req/s per GPU, active sessions at the decode optimum). A decode GPU's
    time per request is its share of ``steps`` rounds (``steps * round(n) / n``) plus, building there, the
    build; the best ``n`` within ``max_active`` is its capacity."""
    on_prefill = placement == "prefill"
    prefill = 1.0 / (c.prefill_s + (c.build_s if on_prefill else 0.0))
    per_request = {
        n: c.steps * c.rounds(n) / n + (0.0 if on_prefill else c.build_s) for n in range(1, max_active + 1)
    }
    best = min(per_request, key=per_request.__getitem__)
    return prefill, 1.0 / per_request[best], best


def ratio_table(c: Costs, placement: str) -> list[dict]:
    mu_p, mu_d, _ = capacities(c, placement)
    rows = []
    for p in range(1, GPUS):
        d = GPUS - p
        rows.append({"prefill": p, "decode": d, "capacity_req_s": min(p * mu_p, d * mu_d),
                     "bound": "prefill" if p * mu_p < d * mu_d else "decode"})  # fmt: skip
    return rows


# -------------------------------------------------------------------------------------- simulation
# ------------------------------------------------------------------------------------------ report
PLACEMENTS = ("decode", "prefill")
NOTES = """How far to trust it: the costs are one request alone on an H100 and the simulator adds no gRPC, router
or host overhead; against the one measured disaggregated layout (1 prefill + 1 decode GPU, table at the
end, measured on 2x H200 with these H100 costs) it is {low:.0%} to {high:.0%} optimistic on throughput. The decode curve was
measured at 4,100 static tokens per session (K=4) up to 64 sessions (`--max-active`); 64 sessions of K=4
decode KV take 15 GB of pool. The handoff time is CUDA IPC between two processes on one H100; between two
GPUs of a node it is a peer-to-peer copy, not yet measured (NCCL across hosts: not measured either). One
decode worker is a single point of failure for decoding: 6:2 with the build on the prefill side keeps two
at the capacity shown in the tables."""
LOADS = (0.4, 0.6, 0.75, 0.85, 0.95)  # arrival rates, as fractions of the best layout's capacity


def _config(c: Costs, p: int, placement: str, **kw: float) -> SimConfig:
    return SimConfig(p, GPUS - p, c.prefill_s, c.build_s, c.handoff_s, c.steps, c.rounds, placement, **kw)  # type: ignore[arg-type]


def study(c: Costs, seed: int, requests: int = SimConfig.requests) -> dict:
    """Analytic capacities per ratio and placement, the simulated saturation (Poisson at 1.5x the best
    capacity) and latency at ``LOADS`` of the best capacity, for every ratio."""
    tables = {pl: ratio_table(c, pl) for pl in PLACEMENTS}
    best_cap = max(r["capacity_req_s"] for rows in tables.values() for r in rows)
    rows = []
    for pl in PLACEMENTS:
        mu_p, mu_d, n_best = capacities(c, pl)
        for r in tables[pl]:
            sat = simulate(
                _config(
                    c,
                    r["prefill"],
                    pl,
                    rate=1.5 * best_cap,
                    seed=seed,
                    requests=requests,
                    warmup=requests // 10,
                )
            )
            row = {**r, "build_on": pl, "prefill_req_s_per_gpu": mu_p, "decode_req_s_per_gpu": mu_d,
                   "decode_best_active": n_best, "sim_saturated_req_s": sat["throughput_req_s"], "loads": []}  # fmt: skip
            for load in LOADS:
                rate = load * best_cap
                sim = simulate(
                    _config(
                        c, r["prefill"], pl, rate=rate, seed=seed, requests=requests, warmup=requests // 10
                    )
                )
                sim.update(rate_req_s=rate, stable=sim["throughput_req_s"] >= 0.97 * rate)
                row["loads"].append(sim)
            rows.append(row)
    return {"context_tokens": c.context_tokens, "costs": {k: v for k, v in asdict(c).items() if k != "rounds"},
            "round_ms_by_active": {a: t * 1e3 for a, t in zip(c.rounds.active, c.rounds.seconds, strict=True)},
            "best_capacity_req_s": best_cap, "ratios": rows}  # fmt: skip


def validate(costs: dict[int, Costs], results: Path, seed: int) -> list[dict]:
    """The simulator against a measured layout: 1 prefill + 1 decode GPU (build on decode), bursts of c
    requests as serving.py sends them (``serving.json``'s two-GPU 16K run: 2x H200; the costs are H100 ones)."""
    rows, source = serving_run(results, SERVING_RUNS["check"])
    out = []
    for row in rows:
        if (
            row["layout"] != "1p1d-build-on-decode"
            or row["context_tokens"] not in costs
            or row["concurrency"] < 4
        ):
            continue
        c, n = costs[row["context_tokens"]], row["requests"]
        cfg = SimConfig(1, 1, c.prefill_s, c.build_s, c.handoff_s, c.steps, c.rounds, "decode",
                        concurrency=n, requests=n, warmup=0, seed=seed)  # fmt: skip
        sim = simulate(cfg)
        out.append({"layout": row["layout"], "concurrency": row["concurrency"], "context_tokens": c.context_tokens,
                    "measured_req_s": row["requests_per_s"], "sim_req_s": sim["throughput_req_s"],
                    "measured_ttft_p50_s": row["ttft_p50_s"], "sim_ttft_p50_s": sim["ttft_p50_s"],
                    "source": source})  # fmt: skip
    return out


def all_in_one(results: Path) -> tuple[dict[int, dict], dict]:
    """Per context, the best measured one-GPU all-in-one throughput (``serving.json``'s one-GPU H100 sweep):
    the baseline of a node run as 8 independent servers."""
    rows, source = serving_run(results, SERVING_RUNS["baseline"])
    best: dict[int, dict] = {}
    for row in rows:
        if row["layout"] == "all-in-one" and row["requests_per_s"] > best.get(row["context_tokens"], {}).get(
            "requests_per_s", 0.0
        ):
            best[row["context_tokens"]] = row
    return best, source


def choose(studies: list[dict], baseline: dict[int, dict]) -> dict:
    """Per context: the split with the most capacity, and the best one with the build on the prefill side
    (its decode steps never wait for a build). The latter is chosen unless it gives up more than 5%."""
    picks = {}
    for s in studies:
        top = max(s["ratios"], key=lambda r: (r["capacity_req_s"], r["decode"]))
        pre = max((r for r in s["ratios"] if r["build_on"] == "prefill"), key=lambda r: r["capacity_req_s"])
        pick = pre if pre["capacity_req_s"] >= 0.95 * top["capacity_req_s"] else top
        aio = baseline.get(s["context_tokens"])
        picks[str(s["context_tokens"])] = {
            "chosen": _name(pick), "chosen_req_s": pick["capacity_req_s"],
            "chosen_split": {k: pick[k] for k in ("prefill", "decode", "build_on")},
            "decode_load_at_capacity": pick["capacity_req_s"] / (pick["decode"] * pick["decode_req_s_per_gpu"]),
            "most_capacity": _name(top), "most_capacity_req_s": top["capacity_req_s"],
            "at_95pct": {_name(r): {k: r["loads"][-1][k] for k in ("latency_p99_s", "step_p99_ms", "stable")}
                         for r in (pick, top)},
            "all_in_one_x8_req_s": GPUS * aio["requests_per_s"] if aio else None,
        }  # fmt: skip
    return picks


def _name(r: dict) -> str:
    return f"{r['prefill']}:{r['decode']} build-on-{r['build_on']}"


def write(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_decode_ratio.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"# Prefill:decode ratio for an {GPUS}-GPU node (simulated from measured costs, {report['date']})", "",
             f"`{report['command']}` (CPU only, seed {report['seed']}; {report['requests']} Poisson requests per run, "
             f"the first {report['warmup']} left out).", "", "Inputs (committed measurements):", ""]  # fmt: skip
    lines += [f"- {what}: `{s['file']}`, {s['device']}, {s['date']}" + (f" ({s['note']})" if "note" in s else "")
              for what, s in report["sources"].items()]  # fmt: skip
    chosen = {c["chosen"] for c in report["choice"].values()}
    lines += ["", "## Choice", ""]
    if len(chosen) == 1:
        split = next(iter(report["choice"].values()))["chosen_split"]
        lines += [f"An {GPUS}-GPU node should run **{split['prefill']} prefill : {split['decode']} decode** "
                  f"workers (one GPU each), the decode KV built on the {split['build_on']} side (router "
                  f"`--build-on {split['build_on']}`):", ""]  # fmt: skip
    for ctx, c in report["choice"].items():
        a, b = c["at_95pct"][c["chosen"]], c["at_95pct"][c["most_capacity"]]
        most = (
            "the most any split gives"
            if a is b
            else f"the most any split gives is {c['most_capacity_req_s']:.2f} ({c['most_capacity']})"
        )
        lines.append(
            f"- {int(ctx) // 1024}K: {c['chosen']}, {c['chosen_req_s']:.2f} req/s (decode GPUs at "
            f"{c['decode_load_at_capacity']:.0%} of their capacity then), {most}. At 95% of "
            f"{c['most_capacity_req_s']:.2f} req/s: request p99 {a['latency_p99_s']:.2f} s, step p99 "
            f"{a['step_p99_ms']:.0f} ms"
            + ("" if a is b else f" ({c['most_capacity']}: {b['latency_p99_s']:.2f} s, {b['step_p99_ms']:.0f} ms)")
            + (f". Eight one-GPU all-in-one servers: {c['all_in_one_x8_req_s']:.2f} req/s (measured x 8)."
               if c["all_in_one_x8_req_s"] else ". No one-GPU all-in-one measurement at this length in serving.json.")
        )  # fmt: skip
    off = [v["sim_req_s"] / v["measured_req_s"] - 1 for v in report["validation"]] or [float("nan")]
    lines += ["", NOTES.format(low=min(off), high=max(off))]
    for s in report["studies"]:
        c = s["costs"]
        lines += ["", f"## {s['context_tokens'] // 1024}K context", "",
                  f"Per request: prefill+score {c['prefill_s']:.3f} s, decode-KV build {c['build_s']:.3f} s, "
                  f"{c['steps']} rounds, handoff {c['handoff_s'] * 1e3:.2f} ms. Per GPU: prefill "
                  f"{s['ratios'][0]['prefill_req_s_per_gpu']:.2f} req/s (build on decode) / "
                  f"{s['ratios'][-1]['prefill_req_s_per_gpu']:.2f} (build on prefill); decode "
                  f"{s['ratios'][0]['decode_req_s_per_gpu']:.2f} / {s['ratios'][-1]['decode_req_s_per_gpu']:.2f} req/s "
                  f"(at {s['ratios'][-1]['decode_best_active']} active sessions).", "",
                  "| P:D | build on | capacity req/s (bound) | simulated at saturation | "
                  + " | ".join(f"p99 latency s / step p99 ms at {x:.0%}" for x in LOADS) + " |",
                  "|" + "---|" * (4 + len(LOADS))]  # fmt: skip
        for r in s["ratios"]:
            cells = [f"{x['latency_p99_s']:.2f} / {x['step_p99_ms']:.0f}" if x["stable"] else "overloaded"
                     for x in r["loads"]]  # fmt: skip
            lines.append(f"| {r['prefill']}:{r['decode']} | {r['build_on']} | {r['capacity_req_s']:.2f} ({r['bound']}) | "
                         f"{r['sim_saturated_req_s']:.2f} | " + " | ".join(cells) + " |")  # fmt: skip
        lines.append(
            f"\nLoads are fractions of {s['best_capacity_req_s']:.2f} req/s, the best layout's capacity; step p99 is"
            " the gap between a session's rounds (a round, plus a build run beside it when the decode side builds)."
        )
    lines += ["", "## Simulator vs a measured layout", "", "| layout | conc | measured req/s | simulated | "
              "measured TTFT p50 s | simulated |", "|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {v['layout']} | {v['concurrency']} | {v['measured_req_s']:.2f} | {v['sim_req_s']:.2f} | "
              f"{v['measured_ttft_p50_s']:.2f} | {v['sim_ttft_p50_s']:.2f} |" for v in report["validation"]]  # fmt: skip
    (out / "prefill_decode_ratio.md").write_text("\n".join(lines) + "\n")
    plot(out / "prefill_decode_ratio.png", report)


def plot(path: Path, report: dict) -> None:
    try:
        import matplotlib
    except ImportError:
        print("[prefill_decode_ratio] matplotlib not installed: no plot", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    studies = report["studies"]
    fig, axes = plt.subplots(2, len(studies), figsize=(5.5 * len(studies), 8), squeeze=False)
    for col, s in enumerate(studies):
        top, bottom = axes[0][col], axes[1][col]
        for pl, color in zip(PLACEMENTS, ("tab:blue", "tab:orange"), strict=True):
            rows = [r for r in s["ratios"] if r["build_on"] == pl]
            xs = [r["prefill"] for r in rows]
            top.plot(xs, [r["capacity_req_s"] for r in rows], color=color, label=f"analytic, build on {pl}")
            top.plot(
                xs,
                [r["sim_saturated_req_s"] for r in rows],
                "o",
                color=color,
                label=f"simulated, build on {pl}",
            )
            for r in rows:
                if r["prefill"] >= GPUS - 3:
                    pts = [x for x in r["loads"] if x["stable"]]
                    bottom.plot([x["rate_req_s"] for x in pts], [x["latency_p99_s"] for x in pts], marker=".",
                                label=f"{r['prefill']}:{r['decode']} build on {pl}")  # fmt: skip
        top.set(
            title=f"{s['context_tokens'] // 1024}K: node capacity",
            xlabel="prefill GPUs (of 8)",
            ylabel="req/s",
        )
        bottom.set(title="request latency p99 (stable runs)", xlabel="arrivals req/s", ylabel="s")
        for ax in (top, bottom):
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=RESULTS, help="where the committed measurements are")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--requests", type=int, default=SimConfig.requests, help="per simulated run (a tenth warm-up)"
    )
    args = p.parse_args(argv)
    costs, sources = load_inputs(args.results)
    baseline, sources["all-in-one baseline (best measured req/s, x 8)"] = all_in_one(args.results)
    sources["simulator check (1 prefill + 1 decode GPU, measured)"] = serving_run(
        args.results, SERVING_RUNS["check"]
    )[1]
    studies = [study(costs[ctx], args.seed, args.requests) for ctx in sorted(costs)]
    report = {"date": datetime.date.today().isoformat(), "seed": args.seed, "gpus": GPUS,
              "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
              "requests": args.requests, "warmup": args.requests // 10, "sources": sources,
              "studies": studies, "choice": choose(studies, baseline), "validation": validate(costs, args.results, args.seed)}  # fmt: skip
    write(args.out, report)
    print((args.out / "prefill_decode_ratio.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
