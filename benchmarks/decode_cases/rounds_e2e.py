"""The ``rounds-e2e`` case: pdllm in the rounds end to end, against Fast-dLLM's dual cache on the whole prompt
and against vanilla decoding, batch 1."""

from __future__ import annotations

import json
import time

from benchmarks.decode_cases.bench import Bench
from benchmarks.decode_cases.rounds import (
    Prompt,
    drop_rounds,
    pdllm_prompt,
    round_cell,
    round_speedups,
    rounds_state,
    sessions,
)
from benchmarks.harness import peak_gib
from benchmarks.shapes import sync
from pdllm.decode_service.rounds import decode_round
from pdllm.shared.generation.sampler import GenerationConfig


def vanilla_steps(bench: Bench, case: str, rows: list[dict], context: int, gen_len: int, whole: Prompt,
                  steps: int) -> None:  # fmt: skip
    """The papers' baseline: one token per step, no cache, each step a forward over the whole prompt and
    answer; every step costs the same, so ``steps`` of them are timed (after two warm-up steps that
    capture the graph) and the gen length is charged at that pace. Never replayed."""
    where = {
        "policy": "none",
        "method": "vanilla",
        "context_tokens": context,
        "gen_length": gen_len,
        "batch": 1,
    }
    if bench.left() <= 0:
        bench.skip(case, where, "time budget spent")
        return
    st, gen = rounds_state(bench), bench.gen(gen_len)
    steps = max(1, min(steps, gen_len - 2))
    try:
        active = sessions(bench.model, st.pool, whole, gen, "none", 1)
        device = st.pool.kv.device
        for _ in range(2):
            decode_round(st.forward, active)
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            decode_round(st.forward, active)
        sync(device)
        step_s = (time.perf_counter() - start) / steps
        for s in active:
            st.pool.release(s.pages)
    except Exception as exc:  # e.g. out of memory: recorded, the rest still runs
        bench.error(case, where, exc)
        return
    rows.append({"case": case, **where, "tokens_per_s": 1.0 / step_s, "round_ms": step_s * 1e3,
                 "forwards_per_round": 1.0, "tpf": 1.0, "peak_gib": peak_gib(device), "cache_bytes": 0,
                 "static_kv_bytes": 0, "timed_blocks": f"{steps} steps (x gen)", "forwards": steps,
                 "rounds": steps, "cache": {}, "replayed": False})  # fmt: skip
    print(f"[done] {case} {json.dumps(where)}: {step_s * 1e3:.1f} ms a step", flush=True)


def case_rounds_e2e(bench: Bench) -> None:
    a, case = bench.args, "rounds-e2e"
    bench.use("dream")
    st = rounds_state(bench)
    rows: list[dict] = []
    for context in a.e2e_contexts:
        ctx_ids = bench.context(context)
        gen0 = GenerationConfig(gen_length=32, steps=32, block_length=a.block)
        try:
            prompt, st.fixed_s[context] = pdllm_prompt(bench.engine("rounds"), ctx_ids, bench.query(), gen0)
        except Exception as exc:
            bench.error(case, {"context_tokens": context, "phase": "prefill"}, exc)
            continue
        whole = Prompt(bench.whole_prompt(context), None, 0)
        for gen_len in a.e2e_gens:
            for policy in ("none", "dual-cache"):
                round_cell(bench, case, rows, "pdllm", context, gen_len, 1, prompt, policy)
            round_cell(bench, case, rows, "vanilla", context, gen_len, 1, whole, "dual-cache")
            if a.e2e_vanilla_steps > 0:
                vanilla_steps(bench, case, rows, context, gen_len, whole, a.e2e_vanilla_steps)
    drop_rounds(bench)
    round_speedups(rows)
    e2e = []
    speed = {(r["policy"], r["method"], r["context_tokens"], r["gen_length"]): r for r in rows}
    for r in rows:
        r["fixed_phases_s"] = st.fixed_s[r["context_tokens"]] if r["method"] == "pdllm" else 0.0
        base = speed.get(("dual-cache", "vanilla", r["context_tokens"], r["gen_length"]))
        plain = speed.get(("none", "vanilla", r["context_tokens"], r["gen_length"]))
        if r["method"] == "pdllm" and base:
            mine = r["fixed_phases_s"] + r["gen_length"] / r["tokens_per_s"]
            theirs = r["gen_length"] / base["tokens_per_s"]
            r["e2e_s"], r["e2e_speedup_vs_dual_cache_whole_prompt"] = mine, theirs / mine
            slow = r["gen_length"] / plain["tokens_per_s"] if plain else None
            # end to end, not the rounds' tokens/s: the fixed phases count against pdllm
            r["speedup_vs_vanilla"] = slow / mine if slow else None
            e2e.append({"context_tokens": r["context_tokens"], "gen_length": r["gen_length"],
                        "pdllm_policy": r["policy"], "pdllm_s": mine, "dual_cache_whole_prompt_s": theirs,
                        "speedup": theirs / mine, "vanilla_s": slow, "speedup_vs_vanilla": r["speedup_vs_vanilla"],
                        "vanilla_steps_timed": plain["rounds"] if plain else None})  # fmt: skip
        bench.add(r)
    bench.meta(case)["e2e"] = e2e
    bench.meta(case)["pdllm_fixed_phases_s"] = dict(st.fixed_s)
    bench.meta(case)["setup"] = (
        "batch 1; pdllm seconds per request = fixed phases (prefill, scoring, build; warm, once per context) "
        "+ gen / its rounds' tokens/s, against Fast-dLLM's dual cache on the whole prompt in the same rounds "
        "(its first refresh is its prefill), and vanilla decoding (one token per step, no cache: every step a "
        f"forward over the whole prompt and answer, {a.e2e_vanilla_steps} steps timed after two warm-up steps, "
        "times gen; its row's tokens/s = 1 / step). pdllm rows' speedup_vs_vanilla is end to end."
    ) + ("" if bench.replay is None else " " + bench.replay.note())
