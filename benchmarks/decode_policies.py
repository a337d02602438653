"""Decode policies' speed: tokens/s of the denoising loop per policy, vs vanilla and vs dual cache, same run.

    python benchmarks/decode_policies.py --out benchmarks/results            # GPU: Dream-7B shapes, bf16
    python benchmarks/decode_policies.py --smoke --out /tmp/decode_policies  # CPU: tiny model, seconds

Model: Dream-7B shapes with random bf16 weights (``shapes.py``). Cells, in this order so that a tight
``--budget-s`` drops the least important ones: a 1K-token context with ``--method vanilla`` (prompt = BOS +
context + 24-token question, every local row in the policy's hands) and a 16K context with pdllm selection
(C=1024, K=4, full-mask: the policy sees the question + response, the chunk KV is static), gen 256 then
1,024, block 32, one token per step (steps = gen length: the same step count for every policy, and no
confidence threshold, which random weights would make meaningless), greedy, no EOS stop. Per cell: ``none``
(the plain loop), ``prefix-cache``, ``dual-cache``, ``sparse-dllm`` (the paper's r = 0.5, s = 3, one-step
delay) and ``polestar`` (the paper's 8 clusters, top 2, update threshold 4; int8 residuals). At 16K,
vanilla (``none``, the ``speedup_vs_vanilla`` baseline) and Fast-dLLM's dual cache on the whole prompt also
run. ``tokens_per_s`` = gen length / the denoising loop's seconds (pdllm's prefill,
scoring and KV build are policy-independent and excluded; they are in ``meta.runs``); ``peak_gib`` = the
CUDA allocator's peak during the run, weights included. Every pdllm run decodes eagerly with the ``buffer``
attention (the policy loop cannot use the split-S kernel or CUDA graphs), ``none`` too, so that rows
differ by the policy alone. Batch 16 is not run: the policy loop decodes one request at a time; the decode
worker's batched rounds with policies are measured by ``decode_policy_rounds.py``. The cells are recorded
as skipped. A vanilla ``none`` run whose full loop does not fit the budget is timed over one step
per block instead (``probe``: every vanilla step is the same forward, so its loop = steps x that step).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the benchmarks package importable
    sys.path.insert(0, str(ROOT))

from benchmarks.e2e_speedup import QUERY_TOKENS, random_ids  # noqa: E402
from benchmarks.shapes import build_model, dream7b, sync, tiny  # noqa: E402
from pdllm.shared.app.engine import PrefillingEngine  # noqa: E402
from pdllm.shared.config import EngineConfig  # noqa: E402
from pdllm.shared.generation.policies import DecodePolicyConfig  # noqa: E402
from pdllm.shared.generation.sampler import GenerationConfig  # noqa: E402
from pdllm.shared.generation.vanilla import generate_vanilla  # noqa: E402
from pdllm.shared.model.transformer import DiffusionLM  # noqa: E402

# A cell's runs, most needed first.
POLICIES = ("none", "dual-cache", "sparse-dllm", "prefix-cache", "polestar")
ROW_KEYS = ("policy", "method", "context_tokens", "gen_length", "batch", "tokens_per_s",
            "speedup_vs_vanilla", "speedup_vs_dual_cache", "peak_gib")  # fmt: skip
BATCH_SKIP = (
    "batch 16: the policy loop (policies.runner.PolicyLogits) decodes one request; the batched decode "
    "rounds with policies are measured by benchmarks/decode_policy_rounds.py"
)


@dataclass(frozen=True)
class Cell:
    method: str
    context: int
    gen: int
    policies: tuple[str, ...]


@dataclass
class Bench:
    args: argparse.Namespace
    model: DiffusionLM
    device: torch.device
    engine: PrefillingEngine
    query: list[int]
    contexts: dict[int, list[int]]
    block: int
    started: float = field(default_factory=time.perf_counter)
    runs: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    full_step_s: dict[tuple[str, int], float] = field(default_factory=dict)  # warm-up: one full step
    overhead_s: dict[tuple[str, int], float] = field(default_factory=dict)  # pdllm prefill + build

    def left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.started)

    def local_rows(self, method: str, context: int, gen: int) -> int:
        return (1 + context if method == "vanilla" else 0) + QUERY_TOKENS + gen

    def run(
        self, method: str, context: int, gen: int, policy: str, probe: bool = False, steps: int | None = None
    ) -> dict:
        """One generation, timed; ``probe``: one step per block, the loop extrapolated to ``gen`` steps;
        ``steps``: that many steps instead of one per token (warm-ups)."""
        steps = gen // self.block if probe else steps or gen
        cfg = GenerationConfig(gen_length=gen, steps=steps, block_length=self.block, stop_at_eos=False)
        config = DecodePolicyConfig(policy)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        sync(self.device)
        t = time.perf_counter()
        phases: dict[str, float] = {}
        if method == "vanilla":
            prompt = [self.model.config.bos_token_id, *self.contexts[context], *self.query]
            result = generate_vanilla(self.model, prompt, cfg, policy=config)
        else:
            result, trace = self.engine.generate(
                self.contexts[context], self.query, cfg, decode_policy=config
            )
            phases = {k: v for k, v in trace.to_dict()["timings"].items() if k != "decode"}
        sync(self.device)
        wall = time.perf_counter() - t
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else 0
        loop = result.decode_seconds * (gen / result.steps if probe else 1.0)
        return {"policy": policy, "method": method, "context_tokens": context, "gen_length": gen,
                "loop_s": loop, "wall_s": wall, "steps": result.steps, "phases_s": phases,
                "timing": f"probe: {result.steps} steps, one per block" if probe else "full",
                "peak_gib": peak / 2**30, "cache": result.cache}  # fmt: skip

    def warm(self, method: str, context: int, policies: tuple[str, ...]) -> None:
        """Kernels and allocator warm at this shape (two blocks of four steps: every policy's cached steps
        run); then a plain step's time and pdllm's fixed phases seed the estimates that keep runs inside
        the budget."""
        for policy in policies:
            self.run(method, context, 2 * self.block, policy, steps=8)
        r = self.run(method, context, 2 * self.block, "none", probe=True)
        self.full_step_s[method, context] = r["loop_s"] / (2 * self.block)
        self.overhead_s[method, context] = sum(r["phases_s"].values())
        print(f"[warm] {method}@{context}: full step {self.full_step_s[method, context] * 1e3:.1f} ms, "
              f"fixed phases {self.overhead_s[method, context]:.2f}s ({self.left():.0f}s left)", flush=True)  # fmt: skip

    def estimate(self, method: str, context: int, gen: int, policy: str, probe: bool) -> float:
        """Seconds the run will take: from the same policy at a shorter gen if measured (scaled by steps
        and rows), else as if every step were a full one (an upper bound for every policy)."""
        fixed = self.overhead_s[method, context]
        rows = self.local_rows(method, context, gen)
        for r in reversed(self.runs):
            same = (r["method"], r["context_tokens"], r["policy"]) == (method, context, policy)
            if same and r["timing"] == "full" and r["gen_length"] < gen and not probe:
                scale = gen / r["gen_length"] * rows / self.local_rows(method, context, r["gen_length"])
                return fixed + r["loop_s"] * scale
        step = self.full_step_s[method, context] * rows / self.local_rows(method, context, 2 * self.block)
        return fixed + step * (gen // self.block if probe else gen)


def cells(args: argparse.Namespace) -> list[Cell]:
    out: list[Cell] = []
    for gen in args.gens:
        out.append(Cell("vanilla", args.vanilla_context, gen, POLICIES))
        out.append(Cell("pdllm", args.pdllm_context, gen, POLICIES))
        # Vanilla and Fast-dLLM on the whole long prompt: what a user would run instead of pdllm.
        out.append(Cell("vanilla", args.pdllm_context, gen, ("none", "dual-cache")))
    return out


def run_cell(bench: Bench, cell: Cell) -> None:
    key = (cell.method, cell.context)
    if key not in bench.full_step_s:
        if bench.left() < 0.05 * bench.args.budget_s:  # a warm-up costs several full steps: none left
            reason = f"time budget: {max(bench.left(), 0):.0f}s left of --budget-s, no time to warm up"
            bench.skipped += [{**_where(cell, p), "batch": 1, "reason": reason} for p in cell.policies]
            print(f"[skip] {cell.method}@{cell.context} gen {cell.gen}: {reason}", flush=True)
            return
        bench.warm(*key, cell.policies)
    for policy in cell.policies:
        name = f"{policy} {cell.method}@{cell.context} gen {cell.gen}"
        probe = False
        est = bench.estimate(cell.method, cell.context, cell.gen, policy, probe)
        if policy == "none" and cell.method == "vanilla" and est > bench.args.vanilla_share * bench.left():
            probe, est = True, bench.estimate(cell.method, cell.context, cell.gen, policy, True)
        if est > bench.left():
            reason = f"time budget: ~{est:.0f}s estimated, {max(bench.left(), 0):.0f}s left of --budget-s"
            bench.skipped.append({**_where(cell, policy), "batch": 1, "reason": reason})
            print(f"[skip] {name}: {reason}", flush=True)
            continue
        print(
            f"[run] {name}{' (probe)' if probe else ''}: ~{est:.0f}s ({bench.left():.0f}s left)", flush=True
        )
        try:
            r = bench.run(cell.method, cell.context, cell.gen, policy, probe)
        except Exception as exc:  # e.g. out of memory: recorded, the rest still runs
            bench.errors.append({**_where(cell, policy), "error": f"{type(exc).__name__}: {exc}"[:400]})
            print(f"[error] {name}: {bench.errors[-1]['error']}", flush=True)
            continue
        bench.runs.append(r)
        print(f"[done] {name}: {cell.gen / r['loop_s']:.1f} tok/s, loop {r['loop_s']:.2f}s, "
              f"peak {r['peak_gib']:.2f} GiB, {json.dumps(r['cache'])}", flush=True)  # fmt: skip


def _where(cell: Cell, policy: str) -> dict:
    return {"policy": policy, "method": cell.method, "context_tokens": cell.context, "gen_length": cell.gen}


def rows_of(runs: list[dict]) -> list[dict]:
    """The result rows: each run's tokens/s against vanilla (``none``, method vanilla) and against the
    dual cache of the same method, context and gen (None where that run is missing)."""
    speed = {(r["policy"], r["method"], r["context_tokens"], r["gen_length"]): r["gen_length"] / r["loop_s"]
             for r in runs}  # fmt: skip
    rows = []
    for r in runs:
        key = (r["policy"], r["method"], r["context_tokens"], r["gen_length"])
        vanilla = speed.get(("none", "vanilla", *key[2:]))
        dual = speed.get(("dual-cache", *key[1:]))
        rows.append({"policy": r["policy"], "method": r["method"], "context_tokens": r["context_tokens"],
                     "gen_length": r["gen_length"], "batch": 1, "tokens_per_s": speed[key],
                     "speedup_vs_vanilla": speed[key] / vanilla if vanilla else None,
                     "speedup_vs_dual_cache": speed[key] / dual if dual else None,
                     "peak_gib": r["peak_gib"]})  # fmt: skip
    return rows


def write(bench: Bench, meta: dict) -> None:
    out: Path = bench.args.out
    out.mkdir(parents=True, exist_ok=True)
    rows = rows_of(bench.runs)
    skipped = [*bench.skipped, {"batch": 16, "cells": "every cell", "reason": BATCH_SKIP}]
    meta = {**meta, "runs": bench.runs, "skipped": skipped, "errors": bench.errors,
            "elapsed_s": time.perf_counter() - bench.started}  # fmt: skip
    report = {"device": meta["device"], "rows": rows, "meta": meta}
    (out / "decode_policies.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "decode_policies.md").write_text(markdown(report))
    plot(out / "decode_policies.png", report)


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}x"


def markdown(report: dict) -> str:
    meta = report["meta"]
    smoke = " (CPU SMOKE: tiny model, not a measurement)" if meta["smoke"] else ""
    lines = [f"# Decode policies: tokens/s per policy{smoke}", "", f"{meta['device']}, {meta['date']}, "
             f"`{meta['command']}`", "", meta["setup"], "",
             "| method | context | gen | policy | tokens/s | vs vanilla | vs dual cache | peak GiB | timing "
             "| fixed phases s | refreshes / forwards | cache MiB |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row, run in zip(report["rows"], meta["runs"], strict=True):
        cache = run["cache"]
        counts = f"{cache['refreshes']} / {cache['forwards']}" if cache else "—"
        mib = f"{cache['cache_bytes'] / 2**20:.1f}" if cache else "—"
        lines.append(
            f"| {row['method']} | {row['context_tokens']} | {row['gen_length']} | {row['policy']} "
            f"| {row['tokens_per_s']:.1f} | {_x(row['speedup_vs_vanilla'])} | {_x(row['speedup_vs_dual_cache'])} "
            f"| {row['peak_gib']:.2f} | {run['timing']} | {sum(run['phases_s'].values()):.2f} | {counts} | {mib} |"
        )
    lines += whole_prompt(meta["runs"])
    for name in ("skipped", "errors"):
        if meta[name]:
            lines += ["", f"{name.capitalize()} ({len(meta[name])}):", ""]
            lines += [f"- {json.dumps(x)}" for x in meta[name]]
    return "\n".join(lines) + "\n"


def whole_prompt(runs: list[dict]) -> list[str]:
    """pdllm against what a user would run instead: Fast-dLLM's dual cache on the whole prompt (vanilla
    method), same context and gen: the loop's ratio and the end-to-end one (pdllm's fixed phases in)."""
    dual = {(r["context_tokens"], r["gen_length"]): r for r in runs
            if (r["method"], r["policy"]) == ("vanilla", "dual-cache")}  # fmt: skip
    out = []
    for r in runs:
        base = dual.get((r["context_tokens"], r["gen_length"]))
        if r["method"] == "pdllm" and base is not None:
            out.append(f"| {r['context_tokens']} | {r['gen_length']} | {r['policy']} "
                       f"| {base['loop_s'] / r['loop_s']:.2f}x | {base['wall_s'] / r['wall_s']:.2f}x |")  # fmt: skip
    if not out:
        return []
    head = ["", "pdllm vs Fast-dLLM dual cache on the whole prompt (`--method vanilla --decode-policy "
            "dual-cache`), same context and gen:", "",
            "| context | gen | pdllm policy | loop speedup | end-to-end speedup |", "|---|---|---|---|---|"]  # fmt: skip
    return head + out


def plot(path: Path, report: dict) -> None:
    try:
        import matplotlib
    except ImportError:
        print("[decode_policies] matplotlib not installed: no plot", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, dict[str, dict]] = {}
    for r in report["rows"]:
        groups.setdefault(f"{r['method']} {r['context_tokens']}\ngen {r['gen_length']}", {})[r["policy"]] = r
    policies = [p for p in POLICIES if any(p in g for g in groups.values())]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / max(len(policies), 1)
    for i, policy in enumerate(policies):
        xs = [j + i * width for j, g in enumerate(groups.values()) if policy in g]
        rows = [g[policy] for g in groups.values() if policy in g]
        for ax, key in zip(axes, ("tokens_per_s", "peak_gib"), strict=True):
            ax.bar(xs, [r[key] for r in rows], width, label=policy)
    for ax, title in zip(axes, ("tokens / s (log)", "peak GiB"), strict=True):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], list(groups), fontsize=7)
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_yscale("log")
    if policies:
        axes[0].legend(fontsize=8)
    fig.suptitle(f"decode policies, batch 1 — {report['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, tiny shapes: seconds")
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/results (smoke: a temp dir)")
    ap.add_argument("--gens", default=None, help="comma list of gen lengths (default 256,1024; smoke 16,32)")
    ap.add_argument("--block", type=int, default=None, help="block length (default 32; smoke 8)")
    ap.add_argument("--vanilla-context", type=int, default=None, help="default 1024 (smoke 48)")
    ap.add_argument("--pdllm-context", type=int, default=None, help="default 16384 (smoke 384)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip runs that would end after this")
    ap.add_argument("--vanilla-share", type=float, default=0.25,
                    help="time a vanilla none loop by a probe when its full run would take more than this "
                    "share of the time left")  # fmt: skip
    args = ap.parse_args(argv)
    smoke = args.smoke or not torch.cuda.is_available()
    args.out = args.out or Path("/tmp/decode_policies_smoke" if smoke else "benchmarks/results")
    args.gens = [int(x) for x in (args.gens or ("16,32" if smoke else "256,1024")).split(",")]
    args.block = args.block or (8 if smoke else 32)
    args.vanilla_context = args.vanilla_context or (48 if smoke else 1024)
    args.pdllm_context = args.pdllm_context or (384 if smoke else 16384)
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    mcfg = tiny() if smoke else dream7b()
    started = time.perf_counter()
    model = build_model(mcfg, device, dtype)
    ecfg = EngineConfig(chunk_size=64 if smoke else 1024, top_k=2 if smoke else 4)
    engine = PrefillingEngine(model, None, ecfg, decode_attention="buffer", reuse_chunks=False)
    rng = torch.Generator().manual_seed(0)
    query = random_ids(QUERY_TOKENS, mcfg.vocab_size, rng)
    contexts = {n: random_ids(n, mcfg.vocab_size, rng) for n in {args.vanilla_context, args.pdllm_context}}
    bench = Bench(args, model, device, engine, query, contexts, args.block, started)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"[decode_policies] {name}, {mcfg.model_id} ready after {time.perf_counter() - started:.0f}s; "
          f"budget {args.budget_s:.0f}s", flush=True)  # fmt: skip
    meta = {
        "device": name, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python benchmarks/decode_policies.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "smoke": smoke, "torch": torch.__version__, "model": mcfg.model_id, "dtype": str(dtype),
        "block": args.block, "query_tokens": QUERY_TOKENS, "engine": asdict(ecfg), "budget_s": args.budget_s,
        "sparse_dllm": dict(zip(("retention", "pool_kernel", "delay_steps"),
                                DecodePolicyConfig("sparse-dllm").sparse(), strict=True)),
        "setup": f"{mcfg.model_id}, {dtype}, block {args.block}, steps = gen length (one token per step), "
                 f"greedy, batch 1; pdllm: C={ecfg.chunk_size}, K={ecfg.top_k}, {ecfg.kv_mode}, eager "
                 "`buffer` decode attention for every policy; sparse-dllm: r=0.5, s=3, delay 1; polestar: 8 clusters, "
                 "top 2, update threshold 4, int8. tokens/s = "
                 "gen / denoising-loop seconds (pdllm's fixed phases excluded, listed). peak GiB: CUDA "
                 "allocator peak, weights included (0 on CPU).",
    }  # fmt: skip
    for cell in cells(args):
        run_cell(bench, cell)
        write(bench, meta)  # after every cell: a run cut short still leaves its results
    print(f"[decode_policies] done after {time.perf_counter() - started:.0f}s: {len(bench.runs)} runs, "
          f"{len(bench.skipped)} skipped, {len(bench.errors)} errors -> {args.out}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
