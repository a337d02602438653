"""The ``mixed`` case: one round of pdllm requests under mixed policies against all-dual-cache and all-none
rounds."""

from __future__ import annotations

import time

from benchmarks.decode_cases.bench import Bench, per_round, speedup
from benchmarks.decode_cases.rounds import Prompt, drop_rounds, pdllm_prompt, rounds_state
from benchmarks.harness import peak_gib
from benchmarks.shapes import sync
from pdllm.decode_service.policies import DecodePolicyConfig
from pdllm.decode_service.policy_rounds import batch_session
from pdllm.decode_service.request import StaticDecode
from pdllm.decode_service.rounds import BatchSession, decode_round
from pdllm.decode_service.sessions import SessionMaker, rounds_policy
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.static_kv import StaticKV

MIXED = ("none", "dual-cache", "sparse-dllm", "polestar", "dyllm")  # Dream shapes: FOCUS runs on SDAR only


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
        ("mixed-eager-layers", [MIXED[i % len(MIXED)] for i in range(n)]),
    ):
        where = {"policy": label, "batch": n, "context_tokens": a.pdllm_context, "gen_length": gen_len}
        if bench.left() <= 0:
            bench.skip(case, where, "time budget spent")
            continue
        # the eager rounds' layers op by op instead of replayed around the attention (the same run's baseline)
        saved = st.forward.eager.layer_graphs
        if label == "mixed-eager-layers":
            st.forward.eager.layer_graphs = None
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
        finally:
            st.forward.eager.layer_graphs = saved
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
        f"dual cache, all none (every row of every request, graphed), then policies cycling {', '.join(MIXED)} "
        "(its eager rounds' layers replayed as CUDA graphs around the attention; mixed-eager-layers: every op "
        "eager); one whole "
        "block timed after one that captures and compiles; round ms = the block's seconds / its rounds; "
        "vs dual cache = the all-dual-cache round time / this round time (same requests count; rows per round "
        "differ: each policy forwards its own rows)."
    )
