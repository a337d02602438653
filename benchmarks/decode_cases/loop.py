"""The in-process denoising loop, batch 1: the ``loop``, ``compute-skip`` and ``polestar`` cases and the
runs they share (measured once per run, memoised on the bench)."""

from __future__ import annotations

import json
import time
from typing import Any

from benchmarks.decode_cases.bench import Bench, Policy, per_round, speedup
from benchmarks.e2e_speedup import QUERY_TOKENS
from benchmarks.harness import peak_gib, reset_peak
from benchmarks.shapes import sync
from tests.reference.vanilla import generate_vanilla

# A cell's loop runs, most needed first.
POLICIES = ("none", "dual-cache", "sparse-dllm", "prefix-cache", "polestar")
LOOP_BATCH_SKIP = (
    "batch 16: the in-process loop decodes one request at a time; the decode worker's batched rounds "
    "with policies are the rounds case's"
)


def loop_run(
    bench: Bench,
    method: str,
    context: int,
    gen: int,
    policy: Policy,
    probe: bool = False,
    steps: int | None = None,
) -> dict:
    """One in-process generation, timed; ``probe``: one step per block, the loop extrapolated to ``gen``
    steps; ``steps``: that many steps instead of one per token (warm-ups)."""
    model = bench.use("dream")
    counter = bench.counter
    assert counter is not None
    steps = gen // bench.block if probe else steps or gen
    cfg = bench.gen(gen, steps)
    config = policy.config()
    extra: dict[str, Any] = {}
    reset_peak(bench.device)
    sync(bench.device)
    t = time.perf_counter()
    phases: dict[str, float] = {}
    with counter.tally() as tally:
        if method == "vanilla":
            prompt = bench.whole_prompt(context)
            result = generate_vanilla(model, prompt, cfg, policy=config)
        else:
            engine = bench.engine("loop")
            with counter.excluding(engine, "prefill", "build"):  # the fixed phases' forwards
                result, trace = engine.generate(
                    bench.context(context), bench.query(), cfg, decode_policy=config
                )
            phases = {k: v for k, v in trace.to_dict()["timings"].items() if k != "decode"}
    sync(bench.device)
    wall = time.perf_counter() - t
    loop = result.decode_seconds * (gen / result.steps if probe else 1.0)
    return {"policy": policy.label, "knobs": dict(policy.knobs) or None, "method": method,
            "context_tokens": context, "gen_length": gen, "loop_s": loop, "wall_s": wall, "steps": result.steps,
            "forwards": tally.forwards, "round_ms": result.decode_seconds / result.steps * 1e3,
            "phases_s": phases, "timing": f"probe: {result.steps} steps, one per block" if probe else "full",
            "peak_gib": peak_gib(bench.device), "cache": dict(result.cache or {}), **extra,
            "_tokens": result.raw_tokens}  # fmt: skip


def loop_key(method: str, context: int, gen: int, policy: Policy) -> tuple:
    return (method, context, gen, policy.key)


def local_rows(method: str, context: int, gen: int) -> int:
    return (1 + context if method == "vanilla" else 0) + QUERY_TOKENS + gen


def warm_shape(bench: Bench, method: str, context: int, policies: tuple[Policy, ...]) -> None:
    """Kernels and allocator warm at this shape (two blocks of four steps: every policy's cached steps
    run); then a plain step's time and pdllm's fixed phases seed the estimates that keep runs inside the
    budget."""
    for policy in policies:
        loop_run(bench, method, context, 2 * bench.block, policy, steps=8)
        bench.warmed.add((method, context, policy.key))
    r = loop_run(bench, method, context, 2 * bench.block, Policy("none"), probe=True)
    bench.full_step_s[method, context] = r["loop_s"] / (2 * bench.block)
    bench.overhead_s[method, context] = sum(r["phases_s"].values())
    print(f"[warm] {method}@{context}: full step {bench.full_step_s[method, context] * 1e3:.1f} ms, fixed "
          f"phases {bench.overhead_s[method, context]:.2f}s ({bench.left():.0f}s left)", flush=True)  # fmt: skip


def estimate(bench: Bench, method: str, context: int, gen: int, policy: Policy, probe: bool) -> float:
    """Seconds the run will take: from the same policy at a shorter gen if measured (scaled by steps and
    rows), else as if every step were a full one (an upper bound for the caching policies)."""
    fixed = bench.overhead_s[method, context]
    rows = local_rows(method, context, gen)
    for (m, c, g, k), r in reversed(bench.loop_runs.items()):
        if (m, c, k) == (method, context, policy.key) and r["timing"] == "full" and g < gen and not probe:
            return fixed + r["loop_s"] * gen / g * rows / local_rows(method, context, g)
    step = bench.full_step_s[method, context] * rows / local_rows(method, context, 2 * bench.block)
    return fixed + step * (gen // bench.block if probe else gen)


def measure_loop(bench: Bench, case: str, method: str, context: int, gen: int, policy: Policy,
                 warm: str = "shape", probe_ok: bool = False) -> dict | None:  # fmt: skip
    """A loop run for ``case``, from the memo when another case measured the same configuration (full
    timing) in this run; else warmed (``shape``: :func:`warm_shape`'s; ``block``: one block of this
    configuration, one token per step), checked against the budget and run. None when skipped or failed."""
    key = loop_key(method, context, gen, policy)
    where = {
        "policy": policy.label,
        "method": method,
        "context_tokens": context,
        "gen_length": gen,
        "batch": 1,
    }
    if policy.knobs:
        where["knobs"] = dict(policy.knobs)
    known = bench.loop_runs.get(key)
    if known is not None and (known["timing"] == "full" or probe_ok):
        return known
    try:
        if (method, context) not in bench.full_step_s:
            if bench.left() < 0.05 * bench.run.budget_s:  # a warm-up costs several full steps: none left
                bench.skip(case, where, f"time budget: {max(bench.left(), 0):.0f}s left, no time to warm up")
                return None
            warm_shape(bench, method, context, (Policy("none"),) if warm == "block" else (policy,))
        probe = False
        est = estimate(bench, method, context, gen, policy, probe)
        vanilla_none = policy.key == "none" and method == "vanilla"
        if probe_ok and vanilla_none and est > bench.args.vanilla_share * bench.left():
            probe, est = True, estimate(bench, method, context, gen, policy, True)
        if est > bench.left():
            bench.skip(case, where, f"time budget: ~{est:.0f}s estimated, {max(bench.left(), 0):.0f}s left")
            return None
        if (method, context, policy.key) not in bench.warmed:
            if warm == "block":
                loop_run(bench, method, context, bench.block, policy)
            else:
                loop_run(bench, method, context, 2 * bench.block, policy, steps=8)
            bench.warmed.add((method, context, policy.key))
        print(f"[run] {case}: {json.dumps(where)}{' (probe)' if probe else ''}: ~{est:.0f}s "
              f"({bench.left():.0f}s left)", flush=True)  # fmt: skip
        r = loop_run(bench, method, context, gen, policy, probe)
    except Exception as exc:  # e.g. out of memory: recorded, the rest still runs
        bench.error(case, where, exc)
        return None
    r["measured_in"] = case
    bench.loop_runs[key] = r
    return r


def loop_row(bench: Bench, case: str, r: dict) -> dict:
    """A loop run's row: tokens/s against vanilla (``none``, method vanilla, same context and gen, probes
    included) and against the dual cache of the same method, context and gen."""
    method, context, gen = r["method"], r["context_tokens"], r["gen_length"]
    speed = gen / r["loop_s"]
    van = next((x for x in bench.loop_runs.values() if (x["policy"], x["knobs"], x["method"], x["context_tokens"],
                x["gen_length"]) == ("none", None, "vanilla", context, gen)), None)  # fmt: skip
    dual = bench.loop_runs.get((method, context, gen, "dual-cache"))
    fpr = per_round(r["forwards"], r["steps"])
    row = {"case": case, "policy": r["policy"], "method": method, "context_tokens": context, "gen_length": gen,
           "batch": 1, "tokens_per_s": speed, "round_ms": r["round_ms"], "forwards_per_round": fpr,
           "tpf": 1 / fpr if fpr else None,  # one token per step
           "speedup_vs_vanilla": speedup(speed, gen / van["loop_s"] if van else None),
           "speedup_vs_dual_cache": speedup(speed, gen / dual["loop_s"] if dual else None),
           "peak_gib": r["peak_gib"], "timing": r["timing"], "loop_s": r["loop_s"], "wall_s": r["wall_s"],
           "fixed_phases_s": sum(r["phases_s"].values()), "steps": r["steps"], "forwards": r["forwards"],
           "cache": r["cache"]}  # fmt: skip
    if r["knobs"]:
        row["knobs"] = r["knobs"]
    if r.get("measured_in") != case:
        row["measured_in"] = r.get("measured_in")
    return row


def rows_frac(cache: dict) -> float | None:
    """Rows a compute-skipping policy ran through its skipping layers / rows plain decoding would have."""
    counters = {**cache, **cache.get("counters", {})} if cache else {}
    total = counters.get("rows_total") or counters.get("rows_plain")
    done = counters.get("rows_forwarded")
    return done / total if total and done is not None else None


# ---------------------------------------------------------------------------------------- loop cases
def case_loop(bench: Bench) -> None:
    a, case = bench.args, "loop"
    vctx, pctx = a.vanilla_context, a.pdllm_context
    policies = tuple(Policy(p) for p in POLICIES)
    cells = []
    for gen in a.loop_gens:
        cells += [("vanilla", vctx, gen, policies), ("pdllm", pctx, gen, policies),
                  ("vanilla", pctx, gen, (Policy("none"), Policy("dual-cache")))]  # fmt: skip
    done = []
    for method, context, gen, pols in cells:
        if (method, context) not in bench.full_step_s and bench.left() >= 0.05 * bench.run.budget_s:
            try:
                warm_shape(bench, method, context, pols)
            except Exception as exc:
                bench.error(case, {"method": method, "context_tokens": context, "phase": "warm-up"}, exc)
                continue
        for policy in pols:
            r = measure_loop(bench, case, method, context, gen, policy, probe_ok=True)
            if r is not None:
                done.append(r)
    for r in done:
        bench.add(loop_row(bench, case, r))
    bench.meta(case)["skipped"].append({"batch": 16, "cells": "every cell", "reason": LOOP_BATCH_SKIP})
    bench.meta(case)["setup"] = (
        f"batch 1, block {a.block}, steps = gen; pdllm: C={bench.engine('loop').config.chunk_size}, "
        f"K={bench.engine('loop').config.top_k}, full-mask, eager `buffer` decode attention for every policy. "
        "tokens/s = gen / denoising-loop seconds (pdllm's fixed phases excluded, listed)."
    )


def case_compute_skip(bench: Bench) -> None:
    a, case = bench.args, "compute-skip"
    ctx, gen = a.vanilla_context, a.skip_gen
    runs: dict[str, dict] = {}
    for policy in (Policy("none"), Policy("dual-cache"), Policy("dyllm")):  # FOCUS: SDAR only (focus-batched)
        r = measure_loop(bench, case, "vanilla", ctx, gen, policy, warm="block")
        if r is not None:
            runs[policy.label] = r
    for r in runs.values():
        row = loop_row(bench, case, r)
        row["rows_frac"] = rows_frac(r["cache"])
        bench.add(row)
    bench.meta(case)["setup"] = (
        f"vanilla {ctx}-token context + {QUERY_TOKENS}-token question, gen {gen}, block {a.block}, batch 1; "
        "the reference loops (`generate_vanilla`, tests/reference). rows_frac: rows computed / plain."
    )


POLESTAR_RUNS = (
    Policy("none"),
    Policy("dual-cache"),
    Policy("polestar"),
    Policy("polestar", (("polestar_update_threshold", 0),)),
    Policy("polestar", (("polestar_residual_format", "none"),)),
    Policy("polestar", (("polestar_recompute", "per-layer"),)),
)


def case_polestar(bench: Bench) -> None:
    a, case = bench.args, "polestar"
    ctx, gen = a.vanilla_context, a.polestar_gen
    runs = [measure_loop(bench, case, "vanilla", ctx, gen, policy, warm="block") for policy in POLESTAR_RUNS]
    for r in runs:  # rows after every run: each row's baselines are in the memo by then
        if r is None:
            continue
        row = loop_row(bench, case, r)
        row["updates"] = r["cache"].get("updates")
        row["rows_recomputed"] = r["cache"].get("rows_recomputed")
        bench.add(row)
    bench.meta(case)["setup"] = (
        f"vanilla {ctx}-token context + {QUERY_TOKENS}-token question, gen {gen}, block {a.block}, batch 1, "
        "the eager reference loop (`generate_vanilla`, tests/reference, which the rounds are held to)."
    )
