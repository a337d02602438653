"""Decode policies, one benchmark: each question about a policy's decode speed is a case (``--cases``).

    python benchmarks/decode_engine.py                   # one H100: the default cases, ~7.5 min
    python benchmarks/decode_engine.py --cases polestar-tpf --update    # any machine (CPU): adds its rows
    python benchmarks/decode_engine.py --cases rounds-e2e,focus-batched --focus-batches 1,16,64 --update
    python benchmarks/decode_engine.py --smoke --cases all   # CPU: tiny models, seconds (not a measurement)

Output: ``--out`` (benchmarks/results; smoke: a temp dir) / ``--name`` (decode_engine) ``.json`` + ``.md``;
``--update`` keeps the rows and notes of the cases not run now from the file already there, so cases run
in separate calls (or on separate machines) share one file without overwriting each other.

Dream-7B shapes with random bf16 weights (``shapes.py``; SDAR-8B shapes for ``focus-batched``), block 32,
one token per step (steps = gen length: the same step count for every policy, and no confidence threshold,
which random weights would make meaningless), greedy, no EOS stop; prompts of random ids: ``vanilla`` =
BOS + a ``--vanilla-context`` (1K) context + a 24-token question, every row local; ``pdllm`` = a
``--pdllm-context`` (16K) context through the engine's prefill, selection and static-KV build (C=1024, K=4,
full-mask), the question + answer local. Policies at the papers' knobs: Sparse-dLLM r = 0.5, s = 3, one-step
delay; Polestar-Cache 8 clusters, top 2, update threshold 4, int8 residuals; DyLLM and FOCUS their defaults.

Cases (default: every case but ``rounds-e2e``, ``mixed``, ``polestar-tpf`` and ``serve``):
  loop           the in-process denoising loop, batch 1 (``generate_vanilla``; pdllm: ``PrefillingEngine.
                 generate``, ``decode_attention="buffer"``), per policy none / dual-cache / sparse-dllm /
                 prefix-cache / polestar, vanilla 1K and pdllm 16K, and none / dual-cache on the whole 16K
                 prompt (what a user would run instead of pdllm). tokens/s = gen / the loop's seconds (pdllm's
                 prefill, scoring and build excluded, listed as fixed phases); warm-up: every policy's cached
                 steps (two blocks of four steps) at each shape. A vanilla ``none`` loop whose full run would
                 take more than ``--vanilla-share`` of the time left is timed over one step per block
                 (``probe``: every vanilla step is the same forward). Batch 16 is the rounds' (skipped here).
  rounds         the decode worker's batched rounds (``decode_round`` over ``GraphedRoundForward``: CUDA
                 graphs per shape bucket, split-S attention over the KV pool; Sparse-dLLM's and Polestar's
                 refresh/update rounds eager) at batch 1 and 16, same cells. Each cell runs twice with the
                 same sessions' shapes, the first capturing every graph bucket, the second timed over the
                 whole blocks the first fitted into ``--cell-s`` (2 s); tokens/s = answer tokens / seconds.
                 ``--round-check`` first checks policy sessions in graphed rounds == the reference policy
                 loop (tiny fp32 models; on a GPU a minute or two of compiles and captures).
  rounds-e2e     pdllm in the rounds, batch 1, end to end (fixed phases + gen / tokens/s) against Fast-dLLM's
                 dual cache on the whole prompt, at 8K / 16K / 32K and gen 32 / 256.
  compute-skip   DyLLM and FOCUS (their library loops) against the plain loop and the dual cache (vanilla 1K, gen 256, the loop
                 case's runs where it ran them); ``rows_frac`` = rows a policy ran through its skipping
                 layers / rows plain decoding would have. Warm-up: one block of the same configuration.
  focus-batched  FOCUS's batched fast path (``generate_focus_batched``: one packed forward per step for every
                 request) on SDAR-8B shapes at ``--focus-batches`` (1, 16; the old script also ran 64), gen
                 ``--focus-gen`` (32; it ran 64), against the same packed forward with nothing evicted and no
                 delayed cache (plain decoding: the ``vanilla`` baseline of these rows); tokens/s = batch x
                 gen / seconds, the prompts' prefill included; warm-up: one block of the same configuration.
  polestar       Polestar-Cache's step cost against the dual cache in the loop, at the paper's knobs, with
                 update threshold 0 and with exact (``none``) residuals; gen ``--polestar-gen`` (32: one
                 block; the old script's 256 makes the threshold-0 run alone ~1 min).
  polestar-tpf   tokens per forward on the shipped model (``shared/checkpoints/pdllm-needle``), on the CPU in
                 fp32 wherever the run is, as before (~1 min on a 16-core host), under
                 confidence threshold ``--threshold`` (0.9): the eval's needle (1K and 16K; block 4, gen 8)
                 and long-answer (1K; block 32) samples at five depths, none / dual-cache / polestar, vanilla
                 and pdllm: TPF = answer slots up to and including the first EOS / forwards (slots after EOS
                 are not tokens the request produced), accuracy, token agreement with no policy.

Every row has ``case``, ``policy``, ``method``, ``context_tokens``, ``gen_length``, ``batch``, ``tokens_per_s``,
``round_ms`` (seconds per step of the loop, or per round of a batch), ``forwards_per_round`` (model forwards
counted by ``harness.ForwardCounter`` / rounds: a round of many requests running one packed forward is 1; the
pdllm fixed phases and SDAR's prompt prefill are not counted), ``tpf`` (tokens one request decoded / the
forwards run while it decoded), ``speedup_vs_vanilla``, ``speedup_vs_dual_cache`` (both against rows of the
same run; None where that baseline is not in it) and ``peak_gib`` (the CUDA allocator's peak, weights, and in
the rounds the KV pool, included, with what earlier runs of the process still hold; 0 on CPU), then the
case's own columns. Runs are ordered so that a tight
``--budget-s`` drops the least needed; skipped runs are listed with their reason. ``--update`` keeps the rows
of the cases not run from an earlier file of the same name.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import pstats
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the benchmarks package importable
    sys.path.insert(0, str(ROOT))

from benchmarks.e2e_speedup import QUERY_TOKENS, random_ids  # noqa: E402
from benchmarks.harness import (  # noqa: E402
    ForwardCounter,
    Run,
    add_run_args,
    default_out,
    fmt,
    peak_gib,
    ratio,
    reset_peak,
    run_meta,
    table,
    write_report,
)
from benchmarks.shapes import dream7b, sdar8b, sync, tiny, tiny_sdar  # noqa: E402
from pdllm.decode_service import block_rounds  # noqa: E402
from pdllm.decode_service.block_rounds import block_slots, start_block_decode  # noqa: E402
from pdllm.decode_service.kv_pool import DecodeKVPool, KVPoolConfig  # noqa: E402
from pdllm.decode_service.policies import DecodePolicyConfig  # noqa: E402
from pdllm.decode_service.policies.focus import FocusConfig  # noqa: E402
from pdllm.decode_service.policies.focus_batch import FocusDecodeBatch, generate_focus_batched  # noqa: E402
from pdllm.decode_service.policy_rounds import PolicyBatchSession, batch_session  # noqa: E402
from pdllm.decode_service.request import DecodeRequest, Final, StaticDecode, Status  # noqa: E402
from pdllm.decode_service.round_graphs import GraphedRoundForward  # noqa: E402
from pdllm.decode_service.rounds import BatchSession, EagerRoundForward, decode_round  # noqa: E402
from pdllm.decode_service.scheduler import DecodeScheduler  # noqa: E402
from pdllm.decode_service.sdar_focus_rounds import sdar_focus_slots  # noqa: E402
from pdllm.decode_service.sessions import SessionMaker, rounds_policy  # noqa: E402
from pdllm.decode_service.vanilla import generate_vanilla  # noqa: E402
from pdllm.shared.app.engine import PrefillingEngine  # noqa: E402
from pdllm.shared.config import EngineConfig  # noqa: E402
from pdllm.shared.generation.sampler import GenerationConfig, GenerationResult  # noqa: E402
from pdllm.shared.static_kv import StaticKV  # noqa: E402

NAME = "decode_engine"
ROW_KEYS = ("case", "policy", "method", "context_tokens", "gen_length", "batch", "tokens_per_s", "round_ms",
            "forwards_per_round", "tpf", "speedup_vs_vanilla", "speedup_vs_dual_cache", "peak_gib")  # fmt: skip
# A cell's loop runs, most needed first.
POLICIES = ("none", "dual-cache", "sparse-dllm", "prefix-cache", "polestar")
ROUND_POLICIES = ("none", "dual-cache", "prefix-cache", "sparse-dllm", "polestar")
SHIPPED = ROOT / "shared" / "checkpoints" / "pdllm-needle"
TPF_CELLS = (("needle", 1024, "vanilla"), ("needle", 1024, "pdllm"), ("needle", 16384, "pdllm"),
             ("long-answer", 1024, "vanilla"), ("long-answer", 1024, "pdllm"))  # fmt: skip
SMOKE_TPF_CELLS = (("needle", 1024, "vanilla"), ("needle", 1024, "pdllm"), ("long-answer", 1024, "vanilla"))
LOOP_BATCH_SKIP = (
    "batch 16: the in-process loop decodes one request at a time; the decode worker's batched rounds "
    "with policies are the rounds case's"
)


@dataclass(frozen=True)
class CaseInfo:
    run: Callable[[Bench], None]
    title: str
    model: str  # which model it runs: cases of one model run together
    default: bool = True
    gpu: bool = True  # GPU shapes (without a CUDA device: the smoke sizes); False: runs anywhere


@dataclass(frozen=True)
class Policy:
    """A decode policy as a case runs it: its name and Polestar-Cache knobs."""

    name: str
    knobs: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        return self.name

    @property
    def key(self) -> str:
        return self.label + (json.dumps(dict(self.knobs), sort_keys=True) if self.knobs else "")

    def config(self) -> DecodePolicyConfig:
        return (
            DecodePolicyConfig(self.name, polestar=dict(self.knobs))
            if self.knobs
            else DecodePolicyConfig(self.name)
        )


# ---------------------------------------------------------------------------------------- bench
@dataclass
class Bench:
    """One run of the benchmark: its settings, the model in use (one at a time, its forwards counted),
    engines, prompts, and what the cases recorded."""

    args: argparse.Namespace
    run: Run
    rows: list[dict] = field(default_factory=list)
    cases: dict[str, dict] = field(default_factory=dict)
    loop_runs: dict[tuple, dict] = field(default_factory=dict)  # memo: cases share their baselines
    model_name: str | None = None
    model: Any = None
    counter: ForwardCounter | None = None
    engines: dict[str, PrefillingEngine] = field(default_factory=dict)
    shipped: Any = None  # the loaded shipped checkpoint (polestar-tpf)
    rounds: Rounds | None = None  # the rounds cases' pool and round forward, dropped after each
    full_step_s: dict[tuple[str, int], float] = field(default_factory=dict)  # loop warm-up: one full step
    overhead_s: dict[tuple[str, int], float] = field(default_factory=dict)  # pdllm prefill + build
    warmed: set[tuple] = field(default_factory=set)

    @property
    def device(self) -> torch.device:
        return self.run.device

    @property
    def block(self) -> int:
        return self.args.block

    def left(self) -> float:
        return self.run.left()

    def use(self, name: str) -> Any:
        """The model ``name`` (dream, sdar, shipped) with a forward counter installed; the previous one
        is dropped first (7B models and a KV pool do not all fit at once)."""
        if self.model_name == name:
            return self.model
        self.drop()
        t = time.perf_counter()
        if name == "shipped":
            from pdllm.shared.model.loader import load_model

            self.shipped = load_model(str(SHIPPED))  # on the CPU, fp32, wherever the run is
            self.model = self.shipped.model
        else:
            smoke = self.run.smoke
            config = {"dream": tiny() if smoke else dream7b(), "sdar": tiny_sdar() if smoke else sdar8b()}[
                name
            ]
            self.model = self.run.model(config)
        self.model_name = name
        self.counter = ForwardCounter(self.model).__enter__()
        print(
            f"[model] {name} ({self.model.config.model_id}) ready in {time.perf_counter() - t:.1f}s",
            flush=True,
        )
        return self.model

    def drop(self) -> None:
        if self.counter is not None:
            self.counter.__exit__(None, None, None)
        self.model = self.counter = self.shipped = self.model_name = self.rounds = None
        self.engines.clear()
        self.run.free()

    def engine(self, kind: str) -> PrefillingEngine:
        """The pdllm engine over the Dream model: ``loop`` decodes with ``buffer`` attention for every
        policy, ``none`` too, so that rows differ by the policy alone; ``rounds`` only prefills and builds."""
        model = self.use("dream")
        if kind not in self.engines:
            smoke = self.run.smoke
            ecfg = EngineConfig(chunk_size=64 if smoke else 1024, top_k=2 if smoke else 4)
            attention = "buffer" if kind == "loop" else None
            self.engines[kind] = PrefillingEngine(
                model, None, ecfg, decode_attention=attention, reuse_chunks=False
            )
        return self.engines[kind]

    def ids(self, n: int, seed: int) -> list[int]:
        return random_ids(n, self.model.config.vocab_size, torch.Generator().manual_seed(seed))

    def query(self) -> list[int]:
        return self.ids(QUERY_TOKENS, 1)

    def context(self, n: int) -> list[int]:
        return self.ids(n, 1000 + n)

    def whole_prompt(self, context: int) -> list[int]:
        return [self.model.config.bos_token_id, *self.context(context), *self.query()]

    def gen(self, gen: int, steps: int | None = None) -> GenerationConfig:
        return GenerationConfig(
            gen_length=gen, steps=steps or gen, block_length=self.block, stop_at_eos=False
        )

    def meta(self, case: str) -> dict:
        return self.cases[case]

    def skip(self, case: str, where: dict, reason: str) -> None:
        self.cases[case]["skipped"].append({**where, "reason": reason})
        print(f"[skip] {case} {json.dumps(where)}: {reason}", flush=True)

    def error(self, case: str, where: dict, exc: BaseException) -> None:
        self.cases[case]["errors"].append({**where, "error": f"{type(exc).__name__}: {exc}"[:400]})
        print(f"[error] {case} {json.dumps(where)}: {self.cases[case]['errors'][-1]['error']}", flush=True)

    def add(self, row: dict) -> None:
        """A result row: the common keys first (missing ones None), then the case's own."""
        full = {k: row.get(k) for k in ROW_KEYS} | {k: v for k, v in row.items() if k not in ROW_KEYS}
        self.rows.append(full)
        short = {k: v for k, v in full.items() if k != "cache"}
        print(f"[row] {json.dumps(short, default=str)}", flush=True)


def per_round(forwards: int, rounds: int) -> float | None:
    return forwards / rounds if rounds else None


def tpf_of(tokens_per_request: float, forwards: int) -> float | None:
    return tokens_per_request / forwards if forwards else None


def speedup(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None


# ---------------------------------------------------------------------------------------- the loop
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
    for policy in (Policy("none"), Policy("dual-cache"), Policy("dyllm"), Policy("focus")):
        r = measure_loop(bench, case, "vanilla", ctx, gen, policy, warm="block")
        if r is not None:
            runs[policy.label] = r
    for r in runs.values():
        row = loop_row(bench, case, r)
        row["rows_frac"] = rows_frac(r["cache"])
        bench.add(row)
    bench.meta(case)["setup"] = (
        f"vanilla {ctx}-token context + {QUERY_TOKENS}-token question, gen {gen}, block {a.block}, batch 1; "
        "the library loops (`generate_vanilla`). rows_frac: rows computed / plain."
    )


POLESTAR_RUNS = (
    Policy("none"),
    Policy("dual-cache"),
    Policy("polestar"),
    Policy("polestar", (("polestar_update_threshold", 0),)),
    Policy("polestar", (("polestar_residual_format", "none"),)),
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
        "the eager library loop (`generate_vanilla`, the loop the engine steps a Polestar request with)."
    )


# ---------------------------------------------------------------------------------------- SDAR FOCUS
def case_focus_batched(bench: Bench) -> None:
    a, case = bench.args, "focus-batched"
    model = bench.use("sdar")
    counter = bench.counter
    assert counter is not None
    rng = torch.Generator().manual_seed(1)
    plain = FocusConfig(budget=a.block, delayed_cache=False)
    for batch in a.focus_batches:
        prompts = [[model.config.bos_token_id, *random_ids(a.vanilla_context + QUERY_TOKENS, model.config.vocab_size,
                                                            rng)] for _ in range(batch)]  # fmt: skip
        base = None
        for name, focus in (("plain-batched", plain), ("focus", FocusConfig())):
            where = {"policy": name, "batch": batch, "gen_length": a.focus_gen}
            if bench.left() <= 0:
                bench.skip(case, where, "time budget spent")
                continue
            try:
                generate_focus_batched(model, prompts, bench.gen(a.block), focus)  # warm-up: one block
                gen = bench.gen(a.focus_gen)
                reset_peak(bench.device)
                sync(bench.device)
                start = time.perf_counter()
                # SDAR's prompt prefill is in the time (as before) but its forwards are not rounds'
                with counter.tally() as tally, counter.excluding(FocusDecodeBatch, "block_diffusion"):
                    results: list[GenerationResult] = generate_focus_batched(model, prompts, gen, focus)
                sync(bench.device)
                seconds = time.perf_counter() - start
            except Exception as exc:
                bench.error(case, where, exc)
                continue
            rounds = max(r.steps for r in results)
            speed = batch * a.focus_gen / seconds
            base = speed if name == "plain-batched" else base
            done = sum(r.cache["rows_forwarded"] for r in results)  # type: ignore[misc]
            total = sum(r.cache["rows_plain"] for r in results)  # type: ignore[misc]
            fpr = per_round(tally.forwards, rounds)
            bench.add({"case": case, "policy": name, "method": "vanilla", "context_tokens": a.vanilla_context,
                       "gen_length": a.focus_gen, "batch": batch, "tokens_per_s": speed,
                       "round_ms": results[0].decode_seconds / rounds * 1e3, "forwards_per_round": fpr,
                       "tpf": tpf_of(a.focus_gen, tally.forwards), "speedup_vs_vanilla": speedup(speed, base),
                       "peak_gib": peak_gib(bench.device), "model": model.config.model_id,
                       "rows_frac": done / total if total else None, "seconds": seconds,
                       "forwards": tally.forwards, "rounds": rounds})  # fmt: skip
        plain_rounds = None
        for focus in (None, FocusConfig()):
            speed = sdar_rounds_row(bench, case, model, prompts, batch, base, focus, plain_rounds)
            plain_rounds = speed if focus is None else plain_rounds
    bench.meta(case)["setup"] = (
        f"{model.config.model_id} (model block {model.config.block_size}), generation block {a.block}, prompt "
        f"{a.vanilla_context} context + {QUERY_TOKENS} question tokens, gen {a.focus_gen}, one token per step; "
        "speedup_vs_vanilla: vs plain-batched at the same batch; round_ms: the batch's stepping seconds / "
        "rounds (prefill out); forwards include SDAR's per-request record pass of each finished block. "
        "plain-rounds: plain block diffusion in the decode worker's rounds (the scheduler, graph buckets, "
        "split-S attention over the pool; a finished block's record rides in the next round); focus-rounds: "
        "FOCUS in the same rounds (eager: its selection is made inside the forward); the prompts' prefill (the "
        "builds) in the time as for the other rows."
    )


def sdar_rounds_row(bench: Bench, case: str, model: Any, prompts: list[list[int]], batch: int,
                    base: float | None, focus: FocusConfig | None = None,
                    plain_rounds: float | None = None) -> float | None:  # fmt: skip
    """Block diffusion of ``prompts`` through the decode scheduler's rounds, all submitted at once: plain, or
    under FOCUS (``focus``; ``plain_rounds``: the plain run's tokens/s, for its ratio). Its tokens/s (None:
    not run)."""
    a = bench.args
    name = "plain-rounds" if focus is None else "focus-rounds"
    where = {"policy": name, "batch": batch, "gen_length": a.focus_gen}
    if bench.left() <= 0:
        bench.skip(case, where, "time budget spent")
        return
    counter = bench.counter
    assert counter is not None
    cuda = bench.run.cuda
    gen = bench.gen(a.focus_gen)
    page = 64
    slots = block_slots(len(prompts[0]), gen)
    if focus is not None:  # FOCUS's key regions after its positions
        slots = sdar_focus_slots(slots, gen, model.config.block_size, page)
    pool = DecodeKVPool.with_pages(model, batch * (-(-slots // page) + 1), page)
    forward = GraphedRoundForward(model, pool, "triton" if cuda else "torch", capture=cuda)

    def run(g: GenerationConfig) -> tuple[float, list[DecodeRequest], int]:
        sched = DecodeScheduler(model, pool, forward, start_thread=False)
        jobs = []
        for i, prompt in enumerate(prompts):
            tensor = torch.tensor(prompt, device=bench.device)
            start = lambda t=tensor: start_block_decode(model, t, g, focus=focus)  # noqa: E731
            jobs.append(DecodeRequest(f"s{i}", start, threading.Event(), False, cache_tokens=slots))
        sync(bench.device)
        begin = time.perf_counter()
        for job in jobs:
            sched.submit(job)
        while sched.depth:
            sched.run_once()
        sync(bench.device)
        return time.perf_counter() - begin, jobs, sched.rounds

    try:
        run(bench.gen(a.block))  # warm-up: one block, every graph bucket captured
        reset_peak(bench.device)
        with counter.tally() as tally, counter.excluding(block_rounds, "prefill_blocks"):
            seconds, jobs, rounds = run(gen)
        failed = [j.request_id for j in jobs if j.status is not Status.FINISHED]
        if failed:
            raise RuntimeError(f"requests did not finish: {failed}")
    except Exception as exc:
        bench.error(case, where, exc)
        return
    speed = batch * a.focus_gen / seconds
    caches = [e.result.cache for j in jobs for e in list(j.events.queue) if isinstance(e, Final)]
    done = sum(c.get("rows_forwarded", 0) for c in caches)
    total = sum(c.get("rows_plain", 0) for c in caches)
    bench.add({"case": case, "policy": name, "method": "vanilla", "context_tokens": a.vanilla_context,
               "gen_length": a.focus_gen, "batch": batch, "tokens_per_s": speed, "round_ms": seconds / rounds * 1e3,
               "forwards_per_round": per_round(tally.forwards, rounds), "tpf": tpf_of(a.focus_gen, tally.forwards),
               "speedup_vs_vanilla": speedup(speed, base), "peak_gib": peak_gib(bench.device),
               "model": model.config.model_id, "rows_frac": done / total if total else None, "seconds": seconds,
               "forwards": tally.forwards, "rounds": rounds,
               "speedup_vs_plain_rounds": speedup(speed, plain_rounds) if focus is not None else None})  # fmt: skip
    return speed


# ---------------------------------------------------------------------------------------- Polestar TPF
def answer_slots(raw: list[int], eos_id: int | None, mask_id: int) -> int:
    """Response slots a request produced: up to and including the first EOS (slots after it are EOS fill
    or never decoded), else every decoded slot."""
    if eos_id is not None and eos_id in raw:
        return raw.index(eos_id) + 1
    return sum(t != mask_id for t in raw)


def case_polestar_tpf(bench: Bench) -> None:
    from pdllm.shared.app.eval import EvalSettings, eval_sample, exact_match
    from pdllm.shared.eval.long_answer import answer_gen_length
    from pdllm.shared.prompt import encode_prompt

    a, case = bench.args, "polestar-tpf"
    bench.use("shipped")
    loaded, counter = bench.shipped, bench.counter
    assert counter is not None
    tok, settings = loaded.tokenizer, EvalSettings()
    engines: dict[Any, PrefillingEngine] = {}
    plain: dict[tuple, list[int]] = {}
    eos, mask = loaded.config.eos_token_id, loaded.config.mask_token_id
    for task, length, method in SMOKE_TPF_CELLS if bench.run.smoke else TPF_CELLS:
        block = 4 if task == "needle" else 32
        for name in ("none", "dual-cache", "polestar"):
            where = {"task": task, "context_tokens": length, "method": method, "policy": name}
            if bench.left() <= 0:
                bench.skip(case, where, "time budget spent")
                continue
            steps = tokens = correct = same = compared = forwards = 0
            seconds = 0.0
            try:
                for i, depth in enumerate(a.tpf_depths):
                    sample = eval_sample(task, length, depth, 7000 + i, tok)
                    n = 8 if task == "needle" else answer_gen_length(tok, sample, block)
                    gen = GenerationConfig(gen_length=n, steps=n, block_length=block, threshold=a.threshold)
                    ids, policy = (
                        encode_prompt(tok, sample.context, sample.question),
                        DecodePolicyConfig(name),
                    )
                    with counter.tally() as tally:
                        if method == "vanilla":
                            prompt = ids.vanilla(loaded.config.bos_token_id)
                            result = generate_vanilla(loaded.model, prompt, gen, policy=policy)
                        else:
                            cfg = settings.engine_config(loaded, 1024, len(ids.query), n)
                            engine = engines.setdefault(cfg, PrefillingEngine(loaded.model, tok, cfg))
                            with counter.excluding(engine, "prefill", "build"):
                                result, _ = engine.generate(ids.context, ids.query, gen, decode_policy=policy)
                    steps, forwards = steps + result.steps, forwards + tally.forwards
                    tokens += answer_slots(result.raw_tokens, eos, mask)
                    seconds += result.decode_seconds
                    text = tok.decode(result.token_ids, skip_special_tokens=True)
                    correct += task == "needle" and exact_match(text, sample.answer)
                    ref = plain.setdefault((task, length, method, i), result.raw_tokens)
                    same += sum(x == y for x, y in zip(ref, result.raw_tokens, strict=True))
                    compared += len(ref)
            except Exception as exc:
                bench.error(case, where, exc)
                continue
            k = len(a.tpf_depths)
            bench.add({"case": case, "policy": name, "method": method, "context_tokens": length, "batch": 1,
                       "tokens_per_s": tokens / seconds if seconds else None,
                       "round_ms": seconds / steps * 1e3 if steps else None,
                       "forwards_per_round": per_round(forwards, steps), "tpf": tokens / steps if steps else None,
                       "peak_gib": None, "task": task, "block": block, "threshold": a.threshold, "samples": k,
                       "forwards": steps, "forwards_counted": forwards, "tokens": tokens,
                       "accuracy": correct / k if task == "needle" else None,
                       "agreement": same / compared if compared else None})  # fmt: skip
    bench.meta(case)["setup"] = (
        f"shipped model `{SHIPPED.relative_to(ROOT)}` on {bench.device.type}, threshold {a.threshold}, depths "
        f"{a.tpf_depths}; forwards = denoising steps (one forward each; forwards_per_round checks it by "
        "counting); tokens = answer slots up to and including the first EOS; TPF = tokens / forwards; "
        "agreement: raw answer slots equal to the run without a policy."
    )


# ---------------------------------------------------------------------------------------- rounds
class Prompt:
    """One cell's request: local rows (query) over a static KV tensor (None: vanilla)."""

    def __init__(self, query: list[int], static: torch.Tensor | None, query_start: int) -> None:
        self.query, self.static, self.query_start = query, static, query_start

    @property
    def kv_tokens(self) -> int:
        return 0 if self.static is None else self.static.shape[3]


def sessions(model, pool, prompt: Prompt, gen: GenerationConfig, policy: str, n: int) -> list[BatchSession]:  # type: ignore[no-untyped-def]
    """``n`` sessions under ``policy`` over ``prompt``, made as the decode worker makes them
    (``SessionMaker.pool_slots``, ``policy_rounds.batch_session``; vanilla: the prompt as local rows)."""
    cfg = None if policy == "none" else DecodePolicyConfig(policy)
    static = prompt.static is not None
    extra = SessionMaker(model, pool.page_size).pool_slots(cfg, len(prompt.query), gen, static=static)
    out: list[BatchSession] = []
    for _ in range(n):
        pages = pool.reserve(prompt.kv_tokens + extra)
        if pages is None:
            raise RuntimeError("KV pool too small for the cell")
        kv = None
        if prompt.static is not None:
            pool.write(pages, prompt.static)
            kv = StaticKV([prompt.static], prompt.query_start)
        built = StaticDecode(list(prompt.query), kv, gen, cache_policy=rounds_policy(cfg))
        out.append(batch_session(model, built, pages, pool.page_size))
    return out


def timed_run(forward, model, pool, prompt, gen, policy, n, limit_s, blocks=None, counter=None) -> dict:  # type: ignore[no-untyped-def]
    """Decode ``n`` sessions together until done or the first block boundary past ``limit_s``
    (``blocks``: exactly that many blocks); pages returned. ``counter``: the forwards of the rounds."""
    active = sessions(model, pool, prompt, gen, policy, n)
    every = list(active)
    device = pool.kv.device
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start, rounds, done_blocks, count0 = time.perf_counter(), 0, 0, counter.count if counter else 0
    while active:
        decode_round(forward, active)
        rounds += 1
        active = [s for s in active if not s.done]
        if rounds % gen.block == 0:  # one token per step: every session ends a block together
            done_blocks += 1
            if blocks is not None and done_blocks >= blocks:
                break
            if blocks is None:
                sync(device)
                if time.perf_counter() - start > limit_s:
                    break
    sync(device)
    seconds = time.perf_counter() - start
    forwards = counter.count - count0 if counter else 0
    peak = peak_gib(device)
    cache = every[0].result().cache if isinstance(every[0], PolicyBatchSession) else {}
    for s in every:
        pool.release(s.pages)
    return {"seconds": seconds, "rounds": rounds, "blocks": done_blocks, "peak_gib": peak, "cache": cache,
            "forwards": forwards}  # fmt: skip


def round_check(device: torch.device) -> str:
    """Policy sessions in graphed rounds (split-S kernel and CUDA graphs on CUDA) == the engine's reference
    policy loop, tiny fp32 models, the CPU tests' cases: "matching/total"."""
    from tests.decode.helpers import POLICY_CASES, policy_session, pool_for, reference, run_rounds
    from tests.engine.helpers import model as tiny_model

    # Polestar-Cache with an update at every cached step (the tiny cases' blocks are 2-6 tokens).
    polestar = {"polestar_clusters": 2, "polestar_top_clusters": 1, "polestar_update_threshold": 0}
    good = total = 0
    for family in ("dream", "llada"):
        m = tiny_model(family).to(device)
        for name in ("dual-cache", "prefix-cache", "sparse-dllm", "polestar"):
            policy = DecodePolicyConfig(name, polestar=polestar if name == "polestar" else {})
            want = [reference(m, case, seed, policy)[0] for seed, case in enumerate(POLICY_CASES)]
            pool = pool_for(m, pages=128)
            cuda = device.type == "cuda"
            forward = GraphedRoundForward(m, pool, "triton" if cuda else "torch", capture=cuda)
            got = [policy_session(m, pool, case, seed, policy) for seed, case in enumerate(POLICY_CASES)]
            run_rounds(forward, list(got))
            total += len(got)
            good += sum(s.state.tokens.tolist() == w for s, w in zip(got, want, strict=True))
    return f"{good}/{total}"


def pdllm_prompt(engine: PrefillingEngine, context: list[int], query: list[int], gen) -> tuple[Prompt, float]:  # type: ignore[no-untyped-def]
    """The static KV of the engine's selection, and the fixed phases' seconds (prefill + build, warm)."""
    for _ in range(2):  # the first warms kernels up
        sync(engine.device)
        t = time.perf_counter()
        sel = engine.prefill(context, query, gen)
        static = engine.build(sel, gen)
        sync(engine.device)
        fixed = time.perf_counter() - t
    return Prompt(list(sel.request.query), static.tensor(), static.query_start), fixed


class Rounds:
    """The rounds cases' KV pool and graphed round forward (made once, dropped with the model)."""

    def __init__(self, bench: Bench) -> None:
        model = bench.use("dream")
        cuda = bench.run.cuda
        budget = int(torch.cuda.mem_get_info()[0] * 0.5) if cuda else 64 * 2**20
        self.pool = DecodeKVPool.for_model(model, KVPoolConfig(budget))
        self.forward = GraphedRoundForward(model, self.pool, "triton" if cuda else "torch", capture=cuda)
        self.fixed_s: dict[int, float] = {}


def rounds_state(bench: Bench) -> Rounds:
    if bench.rounds is None:
        bench.rounds = Rounds(bench)
    return bench.rounds


def drop_rounds(bench: Bench) -> None:
    """Give the pool (half the free GPU memory) and its graphs back: later cases' peaks leave it out."""
    bench.rounds = None
    bench.run.free()


def round_cell(bench: Bench, case: str, part_rows: list[dict], method: str, context: int, gen_len: int, n: int,
               prompt: Prompt, policy: str) -> None:  # fmt: skip
    where = {"policy": policy, "method": method, "context_tokens": context, "gen_length": gen_len, "batch": n}
    if bench.left() <= 0:
        bench.skip(case, where, "time budget spent")
        return
    st, model = rounds_state(bench), bench.model
    gen = bench.gen(gen_len)
    try:
        args = (st.forward, model, st.pool, prompt, gen, policy, n, bench.args.cell_s)
        first = timed_run(*args)  # captures the buckets
        second = timed_run(*args, blocks=first["blocks"], counter=bench.counter)
    except Exception as exc:  # e.g. out of memory: recorded, the rest still runs
        bench.error(case, where, exc)
        return
    tokens = n * second["blocks"] * gen.block
    fpr = per_round(second["forwards"], second["rounds"])
    part_rows.append({"case": case, **where, "tokens_per_s": tokens / second["seconds"],
                      "round_ms": second["seconds"] / second["rounds"] * 1e3, "forwards_per_round": fpr,
                      "tpf": tpf_of(second["blocks"] * gen.block, second["forwards"]),
                      "peak_gib": second["peak_gib"], "timed_blocks": f"{second['blocks']}/{gen.num_blocks}",
                      "forwards": second["forwards"], "rounds": second["rounds"], "cache": second["cache"]})  # fmt: skip
    print(f"[done] {case} {json.dumps(where)}: {part_rows[-1]['tokens_per_s']:.1f} tok/s", flush=True)


def round_speedups(rows: list[dict]) -> None:
    speed = {(r["policy"], r["method"], r["context_tokens"], r["gen_length"], r["batch"]): r["tokens_per_s"]
             for r in rows}  # fmt: skip
    for r in rows:
        key = (r["method"], r["context_tokens"], r["gen_length"], r["batch"])
        r["speedup_vs_vanilla"] = speedup(r["tokens_per_s"], speed.get(("none", "vanilla", *key[1:])))
        r["speedup_vs_dual_cache"] = speedup(r["tokens_per_s"], speed.get(("dual-cache", *key)))


def case_rounds(bench: Bench) -> None:
    a, case = bench.args, "rounds"
    model = bench.use("dream")
    check = "not checked (--round-check)"
    if a.round_check:
        t = time.perf_counter()
        check = round_check(bench.device)
        print(f"[rounds] policy rounds == reference loop on {bench.device.type}: {check} "
              f"({time.perf_counter() - t:.0f}s)", flush=True)  # fmt: skip
    bench.meta(case)["policy_rounds_equal_reference"] = check
    st = rounds_state(bench)
    rows: list[dict] = []
    for gen_len in a.rounds_gens:
        for context, method in ((a.vanilla_context, "vanilla"), (a.pdllm_context, "pdllm")):
            if method == "vanilla":
                prompt = Prompt(bench.whole_prompt(context), None, 0)
            else:
                gen = GenerationConfig(gen_length=gen_len, steps=gen_len, block_length=a.block)
                prompt, st.fixed_s[context] = pdllm_prompt(bench.engine("rounds"), bench.context(context),
                                                           bench.query(), gen)  # fmt: skip
            for n in a.batches:
                for policy in a.rounds_policies:
                    round_cell(bench, case, rows, method, context, gen_len, n, prompt, policy)
            if a.profile and method == "pdllm":
                profile_rounds(
                    bench, prompt, GenerationConfig(gen_length=gen_len, steps=gen_len, block_length=a.block)
                )
    drop_rounds(bench)
    round_speedups(rows)
    for r in rows:
        bench.add(r)
    bench.meta(case)["pdllm_fixed_phases_s"] = dict(st.fixed_s)
    bench.meta(case)["setup"] = (
        f"{model.config.model_id}, block {a.block}, one token per step, timed blocks within --cell-s "
        f"{a.cell_s}; pdllm: C={bench.engine('rounds').config.chunk_size}, K={bench.engine('rounds').config.top_k}, "
        f"full-mask. Policy sessions in these rounds == the reference policy loop (tiny fp32 models"
        f"{', CUDA graphs' if bench.run.cuda else ''}): {check}."
    )


def profile_rounds(bench: Bench, prompt: Prompt, gen: GenerationConfig) -> None:
    """``--profile``: cached dual-cache rounds of pdllm sessions at each batch of ``--batches``: the wall time
    per round graphed, through the graph buckets' padded buffers run eagerly, and eager (op by op; both warm),
    the CUDA kernels of the two eager forms, and a cProfile of eight graphed rounds (where the host's time
    goes); written to ``<name>_profile.txt``."""
    if not bench.run.cuda:
        return
    from torch.profiler import ProfilerActivity, profile

    st, model = rounds_state(bench), bench.model
    forms = {
        "graphed": st.forward,
        "padded": GraphedRoundForward(model, st.pool, "triton", capture=False),
        "eager": EagerRoundForward(model, st.pool, "triton"),
    }
    out = []
    for n in bench.args.batches:
        active = sessions(model, st.pool, prompt, gen, bench.args.profile_policy, n)
        for _ in range(5):  # the block's refresh (DyLLM: its FullSteps); later rounds are cached steps
            decode_round(st.forward, active)
        wall, tables = {}, {}
        for name, forward in forms.items():
            for _ in range(3):  # warm: graph buckets captured, kernels compiled
                decode_round(forward, active)
            sync(bench.device)
            t = time.perf_counter()
            for _ in range(3):
                decode_round(forward, active)
            sync(bench.device)
            wall[name] = (time.perf_counter() - t) / 3 * 1e3
            if name != "graphed":
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(2):
                        decode_round(forward, active)
                    sync(bench.device)
                tables[name] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
        host = cProfile.Profile()  # the host's share of the rounds as the worker runs them
        host.enable()
        for _ in range(4):
            decode_round(st.forward, active)
        sync(bench.device)
        host.disable()
        text = io.StringIO()
        pstats.Stats(host, stream=text).sort_stats("cumulative").print_stats(20)
        times = ", ".join(f"{k} {v:.2f} ms" for k, v in wall.items())
        out.append(f"## {bench.args.profile_policy}, batch {n}: round wall time: {times}\n")
        for name, kernels in tables.items():
            out.append(f"### batch {n}: {name} forward, CUDA kernels of 2 rounds\n{kernels}")
        out.append(f"### batch {n}: cProfile of 4 rounds as the worker runs them (host)\n{text.getvalue()}")
        for s in active:
            st.pool.release(s.pages)
    path = bench.args.out / f"{bench.args.name}_profile.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out))
    print(f"[profile] {path}", flush=True)


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
    drop_rounds(bench)
    round_speedups(rows)
    e2e = []
    speed = {(r["policy"], r["method"], r["context_tokens"], r["gen_length"]): r for r in rows}
    for r in rows:
        r["fixed_phases_s"] = st.fixed_s[r["context_tokens"]] if r["method"] == "pdllm" else 0.0
        base = speed.get(("dual-cache", "vanilla", r["context_tokens"], r["gen_length"]))
        if r["method"] == "pdllm" and base:
            mine = r["fixed_phases_s"] + r["gen_length"] / r["tokens_per_s"]
            theirs = r["gen_length"] / base["tokens_per_s"]
            r["e2e_s"], r["e2e_speedup_vs_dual_cache_whole_prompt"] = mine, theirs / mine
            e2e.append({"context_tokens": r["context_tokens"], "gen_length": r["gen_length"],
                        "pdllm_policy": r["policy"], "pdllm_s": mine, "dual_cache_whole_prompt_s": theirs,
                        "speedup": theirs / mine})  # fmt: skip
        bench.add(r)
    bench.meta(case)["e2e"] = e2e
    bench.meta(case)["pdllm_fixed_phases_s"] = dict(st.fixed_s)
    bench.meta(case)["setup"] = (
        "batch 1; pdllm seconds per request = fixed phases (prefill, scoring, build; warm, once per context) "
        "+ gen / its rounds' tokens/s, against Fast-dLLM's dual cache on the whole prompt in the same rounds "
        "(its first refresh is its prefill)."
    )


# ---------------------------------------------------------------------------------------- mixed round
MIXED = ("none", "dual-cache", "sparse-dllm", "polestar", "dyllm", "focus")


def mixed_sessions(
    bench: Bench, prompt: Prompt, gen: GenerationConfig, policies: list[str]
) -> list[BatchSession]:
    """One pdllm session per entry of ``policies`` over ``prompt``'s static KV, made as the decode worker
    makes them (``SessionMaker.pool_slots``, ``policy_rounds.batch_session``)."""
    st, model = rounds_state(bench), bench.model
    maker = SessionMaker(model, st.pool.page_size)
    out = []
    for name in policies:
        cfg = None if name == "none" else DecodePolicyConfig(name)
        slots = maker.pool_slots(cfg, len(prompt.query), gen, static=True)
        pages = st.pool.reserve(prompt.kv_tokens + slots)
        if pages is None:
            raise RuntimeError("KV pool too small for the cell")
        st.pool.write(pages, prompt.static)
        built = StaticDecode(list(prompt.query), StaticKV([prompt.static], prompt.query_start), gen,
                             cache_policy=rounds_policy(cfg))  # fmt: skip
        out.append(batch_session(model, built, pages, st.pool.page_size))
    return out


def case_mixed(bench: Bench) -> None:
    """16 pdllm requests of mixed policies in the rounds against 16 dual-cache ones: forwards per round
    (1 = every policy rode in the round's one forward), round time, rows per round."""
    a, case = bench.args, "mixed"
    bench.use("dream")
    st = rounds_state(bench)
    gen_len = a.rounds_gens[0]
    gen = GenerationConfig(gen_length=gen_len, steps=gen_len, block_length=a.block)
    prompt, _ = pdllm_prompt(bench.engine("rounds"), bench.context(a.pdllm_context), bench.query(), gen)
    n = max(a.batches)
    rows_seen: list[int] = []

    def forward(packed):  # type: ignore[no-untyped-def]
        rows_seen.append(len(packed.ids))
        return st.forward(packed)

    base = None
    for label, policies in (
        ("dual-cache", ["dual-cache"] * n),
        (
            "none",
            ["none"] * n,
        ),  # every row of every request: a graphed round with more rows than the mixed one
        ("mixed", [MIXED[i % len(MIXED)] for i in range(n)]),
    ):
        where = {"policy": label, "batch": n, "context_tokens": a.pdllm_context, "gen_length": gen_len}
        if bench.left() <= 0:
            bench.skip(case, where, "time budget spent")
            continue
        try:
            for _ in range(2):  # the first block captures graph buckets and compiles; the second is timed
                active = mixed_sessions(bench, prompt, gen, policies)
                every = list(active)
                rows_seen.clear()
                sync(bench.device)
                start, count0 = time.perf_counter(), bench.counter.count
                for _ in range(a.block):  # one token per step: a whole block
                    decode_round(forward, active)
                    active = [s for s in active if not s.done]
                sync(bench.device)
                seconds = time.perf_counter() - start
                forwards = bench.counter.count - count0
                for s in every:
                    st.pool.release(s.pages)
        except Exception as exc:
            bench.error(case, where, exc)
            continue
        round_ms = seconds / a.block * 1e3
        base = round_ms if label == "dual-cache" else base
        bench.add({"case": case, **where, "method": "pdllm", "tokens_per_s": n * a.block / seconds,
                   "round_ms": round_ms, "forwards_per_round": per_round(forwards, a.block), "tpf": 1.0,
                   "speedup_vs_vanilla": None, "speedup_vs_dual_cache": speedup(base, round_ms) if base else None,
                   "peak_gib": peak_gib(bench.device), "rows_per_round": sum(rows_seen) / len(rows_seen),
                   "ms_per_1k_rows": round_ms / (sum(rows_seen) / len(rows_seen)) * 1e3,
                   "policies": ",".join(policies), "forwards": forwards, "rounds": a.block})  # fmt: skip
    drop_rounds(bench)
    bench.meta(case)["setup"] = (
        f"pdllm {a.pdllm_context} context, gen {gen_len}, block {a.block}, one token per step; {n} requests: all "
        f"dual cache, all none (every row of every request, graphed), then policies cycling {', '.join(MIXED)}; one whole "
        "block timed after one that captures and compiles; round ms = the block's seconds / its rounds; "
        "vs dual cache = the all-dual-cache round time / this round time (same requests count; rows per round "
        "differ: each policy forwards its own rows)."
    )


# ---------------------------------------------------------------------------------------- serving
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


CASES: dict[str, CaseInfo] = {
    "loop": CaseInfo(case_loop, "the in-process denoising loop per policy, batch 1", "dream"),
    "rounds": CaseInfo(
        case_rounds,
        "the decode worker's batched rounds per policy, batch 1 and 16",
        "dream",
    ),
    "compute-skip": CaseInfo(
        case_compute_skip,
        "DyLLM and FOCUS vs the plain loop and the dual cache, batch 1",
        "dream",
    ),
    "polestar": CaseInfo(case_polestar, "Polestar-Cache's step cost vs the dual cache, its knobs", "dream"),
    "rounds-e2e": CaseInfo(
        case_rounds_e2e,
        "pdllm in the rounds end to end vs dual cache on the whole prompt",
        "dream",
        default=False,
    ),
    "focus-batched": CaseInfo(
        case_focus_batched,
        "FOCUS's batched path vs plain batched decoding (SDAR shapes)",
        "sdar",
    ),
    "mixed": CaseInfo(
        case_mixed,
        "one round of mixed policies vs an all-dual-cache round (16 pdllm requests)",
        "dream",
        default=False,
    ),
    "serve": CaseInfo(
        case_serve,
        "serving under each decode policy (all-in-one, from serving.py files)",
        "none",
        default=False,
        gpu=False,
    ),
    "polestar-tpf": CaseInfo(
        case_polestar_tpf,
        "tokens per forward under a confidence threshold, shipped model (CPU)",
        "shipped",
        default=False,
        gpu=False,
    ),
}


# ---------------------------------------------------------------------------------------- report
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
        lines += case_table(case, rows)
        if case == "loop":
            lines += whole_prompt(rows)
        if case == "rounds-e2e" and info.get("e2e"):
            lines += [
                "",
                "pdllm (fixed phases + loop) vs Fast-dLLM dual cache on the whole prompt, batch 1:",
                "",
            ]
            lines += table(["context", "gen", "pdllm policy", "pdllm s", "dual cache (whole prompt) s", "speedup"],
                           [[str(e["context_tokens"]), str(e["gen_length"]), e["pdllm_policy"], fmt(e["pdllm_s"]),
                             fmt(e["dual_cache_whole_prompt_s"]), ratio(e["speedup"])] for e in info["e2e"]])  # fmt: skip
        for name in ("skipped", "errors"):
            if info.get(name):
                lines += ["", f"{name.capitalize()} ({len(info[name])}):", ""]
                lines += [f"- {json.dumps(x)}" for x in info[name]]
    return "\n".join(lines) + "\n"


def _common(r: dict) -> list[str]:
    return [fmt(r["tokens_per_s"], ".1f"), fmt(r["round_ms"]), fmt(r["forwards_per_round"]), fmt(r["tpf"]),
            ratio(r["speedup_vs_vanilla"]), ratio(r["speedup_vs_dual_cache"])]  # fmt: skip


COMMON = ["tokens/s", "round ms", "fwd/round", "TPF", "vs vanilla", "vs dual cache"]


def case_table(case: str, rows: list[dict]) -> list[str]:
    if not rows:
        return ["(no rows)"]
    if case == "polestar-tpf":
        return table(["task", "context", "method", "policy", "forwards", "tokens", "TPF", "fwd/round", "accuracy",
                      "agreement"],
                     [[r["task"], str(r["context_tokens"]), r["method"], r["policy"], str(r["forwards"]),
                       str(r["tokens"]), fmt(r["tpf"]), fmt(r["forwards_per_round"]),
                       "—" if r["accuracy"] is None else f"{100 * r['accuracy']:.0f}%",
                       f"{100 * r['agreement']:.1f}%"] for r in rows])  # fmt: skip
    if case == "focus-batched":
        return table(["model", "policy", "batch", "gen", *COMMON[:4], "vs plain batched", "vs plain rounds",
                      "rows computed / plain", "peak GiB"],
                     [[r["model"], r["policy"], str(r["batch"]), str(r["gen_length"]), *_common(r)[:4],
                       ratio(r["speedup_vs_vanilla"]), ratio(r.get("speedup_vs_plain_rounds")), fmt(r["rows_frac"]),
                       fmt(r["peak_gib"])] for r in rows])  # fmt: skip
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
        return table(["method", "context", "gen", "batch", "policy", *COMMON, "timed blocks", "peak GiB"],
                     [[r["method"], str(r["context_tokens"]), str(r["gen_length"]), str(r["batch"]), r["policy"],
                       *_common(r), r["timed_blocks"], fmt(r["peak_gib"])] for r in rows])  # fmt: skip
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


def _case(row: dict) -> str:
    """The case a row belongs to (``serve:<policy>`` rows: ``serve``)."""
    return row["case"].split(":")[0]


def write(bench: Bench, meta: dict, kept: dict) -> None:
    """The report: this run's cases, after the kept ones of an earlier file (``--update``)."""
    rows = [r for r in kept.get("rows", []) if _case(r) not in bench.cases] + bench.rows
    cases = {c: m for c, m in kept.get("cases", {}).items() if c not in bench.cases} | bench.cases
    order = [c for c in CASES if c in cases]
    report = {"device": meta["device"], "meta": meta, "cases": {c: cases[c] for c in order},
              "rows": sorted(rows, key=lambda r: order.index(_case(r)))}  # fmt: skip
    write_report(bench.args.out, bench.args.name, report, markdown(report))


# ---------------------------------------------------------------------------------------- main
def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, budget_s=450.0)
    ap.add_argument("--cases", default=None,
                    help=f"comma list of {', '.join(CASES)}, or all (default: all but rounds-e2e and polestar-tpf)")  # fmt: skip
    ap.add_argument(
        "--update", action="store_true", help="keep the other cases' rows of an existing <out>/<name>.json"
    )
    ap.add_argument("--block", type=int, default=None, help="block length (default 32; smoke 8)")
    ap.add_argument("--vanilla-context", type=int, default=None, help="default 1024 (smoke 48)")
    ap.add_argument("--pdllm-context", type=int, default=None, help="default 16384 (smoke 256)")
    ap.add_argument("--loop-gens", default=None, help="loop: gen lengths (default 256; smoke 16)")
    ap.add_argument("--vanilla-share", type=float, default=0.25,
                    help="loop: time a vanilla none loop by a probe when its full run would take more than this "
                    "share of the time left")  # fmt: skip
    ap.add_argument("--rounds-gens", default=None, help="rounds: gen lengths (default 256; smoke 16)")
    ap.add_argument("--batches", default="1,16", help="rounds: batch sizes")
    ap.add_argument("--rounds-policies", default=",".join(ROUND_POLICIES), help="rounds: policies")
    ap.add_argument(
        "--cell-s", type=float, default=None, help="rounds: timed seconds per cell, whole blocks (2)"
    )
    ap.add_argument(
        "--profile-policy", default="dual-cache", help="rounds --profile: the sessions' decode policy"
    )
    ap.add_argument("--profile", action="store_true",
                    help="rounds (CUDA): a kernel profile of cached dual-cache pdllm rounds at each batch")  # fmt: skip
    ap.add_argument(
        "--round-check",
        action="store_true",
        help="rounds: first check policy sessions in graphed rounds == the reference loop (tiny models; "
        "on a GPU a minute of Triton compiles and graph captures)",
    )
    ap.add_argument("--e2e-contexts", default=None, help="rounds-e2e: contexts (default 8192,16384,32768)")
    ap.add_argument("--e2e-gens", default=None, help="rounds-e2e: gen lengths (default 32,256; smoke 16)")
    ap.add_argument(
        "--skip-gen", type=int, default=None, help="compute-skip: gen length (default 256; smoke 16)"
    )
    ap.add_argument(
        "--focus-batches", default=None, help="focus-batched: batch sizes (default 1,16; smoke 1,3)"
    )
    ap.add_argument(
        "--focus-gen", type=int, default=None, help="focus-batched: gen length (default 32; smoke 16)"
    )
    ap.add_argument(
        "--polestar-gen", type=int, default=None, help="polestar: gen length (default 32; smoke 16)"
    )
    ap.add_argument("--threshold", type=float, default=0.9, help="polestar-tpf: confidence threshold")
    ap.add_argument(
        "--tpf-depths", default=None, help="polestar-tpf: needle depths (default 0,0.25,0.5,0.75,1)"
    )
    ap.add_argument("--serving-files", nargs="*", default=[],
                    help="serve: serving.py JSON files, one per decode policy (`--serve-flags '--decode-policy P'`)")  # fmt: skip
    args = ap.parse_args(argv)
    names = [c.strip() for c in (args.cases or "").split(",") if c.strip()]
    if not names:
        names = [c for c, info in CASES.items() if info.default]
    elif names == ["all"]:  # every measurement (``serve`` reads serving.py's files)
        names = [c for c in CASES if c != "serve"]
    if unknown := [c for c in names if c not in CASES]:
        ap.error(f"unknown cases {unknown}; choose from {list(CASES)} or all")
    args.cases = [c for c in CASES if c in names]  # one model's cases together
    args.needs_gpu = any(CASES[c].gpu for c in args.cases)
    smoke = args.smoke or (args.needs_gpu and not torch.cuda.is_available())
    pick = lambda value, gpu, cpu: value if value is not None else (cpu if smoke else gpu)  # noqa: E731
    args.name = args.name or NAME
    args.out = args.out or default_out(smoke, NAME)
    args.block = pick(args.block, 32, 8)
    args.vanilla_context = pick(args.vanilla_context, 1024, 48)
    args.pdllm_context = pick(args.pdllm_context, 16384, 256)
    args.loop_gens = ints(pick(args.loop_gens, "256", "16"))
    args.rounds_gens = ints(pick(args.rounds_gens, "256", "16"))
    args.batches = ints(args.batches)
    args.rounds_policies = [p for p in args.rounds_policies.split(",") if p]
    args.cell_s = pick(args.cell_s, 2.0, 0.05)
    args.e2e_contexts = ints(pick(args.e2e_contexts, "8192,16384,32768", "128,256"))
    args.e2e_gens = ints(pick(args.e2e_gens, "32,256", "16"))
    args.skip_gen = pick(args.skip_gen, 256, 16)
    args.focus_batches = ints(pick(args.focus_batches, "1,16", "1,3"))
    args.focus_gen = pick(args.focus_gen, 32, 16)
    args.polestar_gen = pick(args.polestar_gen, 32, 16)
    args.tpf_depths = [float(x) for x in pick(args.tpf_depths, "0,0.25,0.5,0.75,1", "0.5").split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    run = Run.from_args(args, args.needs_gpu)
    bench = Bench(args, run)
    meta = run_meta("decode_engine.py", argv, run) | {"cases_run": args.cases, "query_tokens": QUERY_TOKENS}
    path = args.out / f"{args.name}.json"
    kept = json.loads(path.read_text()) if args.update and path.is_file() else {}
    print(f"[{NAME}] {run.device_name()}, cases {args.cases}, budget {run.budget_s:.0f}s", flush=True)
    for case in args.cases:
        info = CASES[case]
        bench.cases[case] = {"title": info.title, "device": meta["device"],
                             "date": meta["date"], "command": meta["command"], "skipped": [], "errors": []}  # fmt: skip
        t = time.perf_counter()
        if bench.left() <= 0:
            bench.skip(case, {"case": case}, "time budget spent before the case")
        else:
            try:
                info.run(bench)
            except Exception as exc:  # a case that breaks is reported; the others still run
                bench.error(case, {"phase": "case"}, exc)
        bench.cases[case]["elapsed_s"] = time.perf_counter() - t
        print(
            f"[{NAME}] {case} done in {bench.cases[case]['elapsed_s']:.0f}s ({bench.left():.0f}s left)",
            flush=True,
        )
        write(
            bench, meta | {"elapsed_s": run.elapsed()}, kept
        )  # after every case: a cut-short run keeps its rows
    bench.drop()
    print(f"[{NAME}] done after {run.elapsed():.0f}s: {len(bench.rows)} rows -> {args.out / args.name}.{{json,md}}",
          flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
