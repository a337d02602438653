"""The decode worker's batched rounds: the ``rounds`` case, ``--profile``, and the sessions, pool and timed
runs it shares with ``rounds-e2e`` (``rounds_e2e.py``) and ``mixed``."""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import time
from dataclasses import replace

import torch

from benchmarks.decode_cases.bench import Bench, per_round, speedup, tpf_of
from benchmarks.decode_cases.replay import replayed_tokens
from benchmarks.harness import peak_gib
from benchmarks.shapes import sync
from pdllm.decode_service.kv_pool import DecodeKVPool, KVPoolConfig
from pdllm.decode_service.policies import DecodePolicyConfig
from pdllm.decode_service.policy_rounds import batch_session
from pdllm.decode_service.request import StaticDecode
from pdllm.decode_service.round_graphs import GraphedRoundForward
from pdllm.decode_service.rounds import BatchSession, EagerRoundForward, decode_round
from pdllm.decode_service.sessions import SessionMaker, rounds_policy
from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.decode_policy_settings import KNOB_GROUPS
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.static_kv import StaticKV

ROUND_POLICIES = ("none", "dual-cache", "prefix-cache", "sparse-dllm", "polestar")


class Prompt:
    """One cell's request: local rows (query) over a static KV tensor (None: vanilla)."""

    def __init__(self, query: list[int], static: torch.Tensor | None, query_start: int) -> None:
        self.query, self.static, self.query_start = query, static, query_start

    @property
    def kv_tokens(self) -> int:
        return 0 if self.static is None else self.static.shape[3]


def policy_knobs(policy: str, knobs: dict[str, object]) -> dict[str, object]:
    """The ``--policy-knobs`` settings that belong to ``policy`` (the settings' own knob groups;
    ``cache_refresh_steps``: every caching policy)."""
    own = KNOB_GROUPS.get(policy, ())
    return {k: v for k, v in knobs.items() if k in own or (k == "cache_refresh_steps" and policy != "none")}


def sessions(model, pool, prompt: Prompt, gen: GenerationConfig, policy: str, n: int,  # type: ignore[no-untyped-def]
             gens: list[GenerationConfig] | None = None, knobs: dict[str, float] | None = None,
             settings: dict[str, object] | None = None) -> list[BatchSession]:  # fmt: skip
    """``n`` sessions under ``policy`` over ``prompt``, made as the decode worker makes them
    (``SessionMaker.pool_slots``, ``policy_rounds.batch_session``; vanilla: the prompt as local rows).
    ``gens``: each session's own settings (a replayed schedule each), else ``gen`` for all; ``knobs``: the
    policy's ``replay_*`` fields (``Replay.knobs``: its recorded work forced); ``settings``: its own knobs
    (``--policy-knobs``; none: the papers')."""
    cfg = None if policy == "none" else DecodePolicyConfig(policy, **policy_knobs(policy, settings or {}))
    run_as = rounds_policy(cfg)
    if knobs and run_as is not None:
        run_as = replace(run_as, **knobs)
    static = prompt.static is not None
    extra = SessionMaker(model, pool.page_size).pool_slots(cfg, len(prompt.query), gen, static=static)
    out: list[BatchSession] = []
    for i in range(n):
        need = prompt.kv_tokens + extra
        pages = pool.reserve(need) if need else []  # as the scheduler: no pages for nothing to hold
        if pages is None:
            raise RuntimeError("KV pool too small for the cell")
        kv = None
        if prompt.static is not None:
            pool.write(pages, prompt.static)
            kv = StaticKV([prompt.static], prompt.query_start)
        own = gen if gens is None else gens[i]
        built = StaticDecode(list(prompt.query), kv, own, cache_policy=run_as)
        out.append(batch_session(model, built, pages, pool.page_size))
    return out


def timed_run(forward, model, pool, prompt, gen, policy, n, limit_s, blocks=None, counter=None, gens=None, knobs=None, settings=None) -> dict:  # type: ignore[no-untyped-def]  # fmt: skip
    """Decode ``n`` sessions together until done or the first block boundary past ``limit_s``
    (``blocks``: exactly that many blocks); pages returned. ``counter``: the forwards of the rounds.
    ``gens``: the sessions' replayed schedules (``replay.py``); a "block" is then ``gen.block`` rounds;
    ``knobs``: the policy's replayed work (:func:`sessions`). ``caches``: every session's counters."""
    active = sessions(model, pool, prompt, gen, policy, n, gens, knobs, settings)
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
        # one token per step: every session ends a block together (replayed: only a check of the time)
        if rounds % gen.block == 0:
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
    caches = [s.result().cache for s in every]  # read after the timing; plain sessions: {}
    cache = caches[0]
    # One request's pool pages (static KV + its policy's cache), reserved for what it keeps: the bytes
    # the pool's budget charges it, its peak and its size after eviction alike.
    held = len(every[0].pages) * pool.page_bytes
    static = prompt.kv_tokens * (pool.page_bytes // pool.page_size)
    for s in every:
        pool.release(s.pages)
    return {"seconds": seconds, "rounds": rounds, "blocks": done_blocks, "peak_gib": peak, "cache": cache,
            "caches": caches, "forwards": forwards, "cache_bytes": held, "static_kv_bytes": static}  # fmt: skip


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
    replay = bench.replay
    gens = None if replay is None else replay.gens(gen, n)
    knobs = None if replay is None else replay.knobs(policy)  # its recorded work, where recorded
    try:
        args = (st.forward, model, st.pool, prompt, gen, policy, n, bench.args.cell_s)
        own_knobs = policy_knobs(policy, bench.args.policy_knobs)
        first = timed_run(*args, gens=gens, knobs=knobs, settings=own_knobs)  # captures the buckets
        second = timed_run(*args, blocks=first["blocks"], counter=bench.counter, gens=gens, knobs=knobs,
                           settings=own_knobs)  # fmt: skip
    except Exception as exc:  # e.g. out of memory: recorded, the rest still runs
        bench.error(case, where, exc)
        return
    tokens = n * second["blocks"] * gen.block
    timed = f"{second['blocks']}/{gen.num_blocks}"
    own: dict = {"replayed": False} | ({"policy_knobs": own_knobs} if own_knobs else {})
    if replay is not None:
        tokens = replayed_tokens([g.schedule for g in gens or [] if g.schedule], second["rounds"])
        timed, own = f"{second['rounds']} rounds", own | replay.columns(gen, n)
        own |= replay.sparsity(policy, second["caches"], model.config.num_layers)
    fpr = per_round(second["forwards"], second["rounds"])
    part_rows.append({"case": case, **where, "tokens_per_s": tokens / second["seconds"],
                      "round_ms": second["seconds"] / second["rounds"] * 1e3, "forwards_per_round": fpr,
                      "tpf": tpf_of(tokens / n, second["forwards"]),
                      "peak_gib": second["peak_gib"], "cache_bytes": second["cache_bytes"],
                      "static_kv_bytes": second["static_kv_bytes"], "timed_blocks": timed,
                      "forwards": second["forwards"], "rounds": second["rounds"], "cache": second["cache"], **own})  # fmt: skip
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
    pace = "one token per step" if bench.replay is None else "replayed schedules"
    bench.meta(case)["setup"] = (
        f"{model.config.model_id}, block {a.block}, {pace}, timed blocks within --cell-s "
        f"{a.cell_s}; pdllm: C={bench.engine('rounds').config.chunk_size}, K={bench.engine('rounds').config.top_k}, "
        f"full-mask. Policy sessions in these rounds == the reference policy loop (tiny fp32 models"
        f"{', CUDA graphs' if bench.run.cuda else ''}): {check}."
    ) + ("" if bench.replay is None else " " + bench.replay.note())


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
