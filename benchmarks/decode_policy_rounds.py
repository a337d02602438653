"""Decode policies in the batched rounds: tokens/s per policy at batch 1 and 16, vs vanilla and dual cache.

    python benchmarks/decode_policy_rounds.py --out benchmarks/results            # GPU: Dream-7B shapes
    python benchmarks/decode_policy_rounds.py --smoke --out /tmp/policy_rounds    # CPU: tiny, seconds

The decode worker's fast path (``decode_service/policy_rounds.py``): sessions decoded together in batched
rounds, CUDA-graphed per shape bucket, split-S attention over the KV pool. Dream-7B shapes with random bf16
weights; block 32, one token per step, greedy, no EOS stop.

- ``vanilla`` cells: the whole prompt (BOS + context + a 24-token question) is the session's local rows
  over no static KV: plain steps forward all of it; Fast-dLLM's caches keep its K/V in the pool.
- ``pdllm`` cells: the engine's prefill + selection + build (C=1024, K=4, full-mask) of the context gives
  the static KV (written into the pool once per session); the local rows are the question + answer.
- Policies at their defaults: Sparse-dLLM's r = 0.5, s = 3, one-step delay; Polestar-Cache's 8 clusters,
  top 2, update threshold 4, int8 residuals (``polestar_rounds.py``: its refresh and update rounds run
  eagerly, its other cached steps replay like the dual cache's).

Timing: each cell runs twice with the same sessions' shapes, the first capturing every graph bucket, the
second timed; a run stops at the first block boundary past ``--cell-s`` seconds (blocks of one policy cost
the same, except the prefix cache's, which shrink: then its rate is a lower bound) and tokens/s = answer
tokens decoded / seconds. ``e2e`` rows add pdllm's fixed phases (prefill, scoring, build; measured once per
context) to its loop: seconds per request = fixed + gen / tokens/s, against Fast-dLLM's dual cache on the
whole prompt (whose first refresh is its prefill). Peak memory: the allocator's peak during the timed run,
weights and pool included.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.e2e_speedup import QUERY_TOKENS, random_ids  # noqa: E402
from benchmarks.shapes import build_model, dream7b, sync, tiny  # noqa: E402
from pdllm.decode_service.kv_pool import DecodeKVPool, KVPoolConfig  # noqa: E402
from pdllm.decode_service.policy_rounds import PolicyBatchSession, cache_slots, session_kind  # noqa: E402
from pdllm.decode_service.round_graphs import GraphedRoundForward  # noqa: E402
from pdllm.decode_service.rounds import BatchSession, decode_round  # noqa: E402
from pdllm.shared.app.engine import PrefillingEngine  # noqa: E402
from pdllm.shared.config import EngineConfig  # noqa: E402
from pdllm.shared.generation.policies import DecodePolicyConfig, make_policy  # noqa: E402
from pdllm.shared.generation.sampler import GenerationConfig  # noqa: E402

POLICIES = "none,dual-cache,prefix-cache,sparse-dllm,polestar"


class Prompt:
    """One cell's request: local rows (query) over a static KV tensor (None: vanilla)."""

    def __init__(self, query: list[int], static: torch.Tensor | None, query_start: int) -> None:
        self.query, self.static, self.query_start = query, static, query_start

    @property
    def kv_tokens(self) -> int:
        return 0 if self.static is None else self.static.shape[3]


def sessions(model, pool, prompt: Prompt, gen: GenerationConfig, policy: str, n: int) -> list[BatchSession]:  # type: ignore[no-untyped-def]
    out: list[BatchSession] = []
    cache_policy = make_policy(DecodePolicyConfig(policy))
    extra = cache_slots(len(prompt.query), gen) if cache_policy is not None else 0
    for _ in range(n):
        pages = pool.reserve(prompt.kv_tokens + extra)
        if pages is None:
            raise RuntimeError("KV pool too small for the cell")
        if prompt.static is not None:
            pool.write(pages, prompt.static)
        args = (model, prompt.query, prompt.query_start, prompt.kv_tokens, pages, gen)
        if cache_policy is None:
            out.append(BatchSession.start(*args))
        else:
            out.append(session_kind(policy).start_policy(*args, cache_policy, pool.page_size))
    return out


def timed_run(forward, model, pool, prompt, gen, policy, n, limit_s, blocks=None) -> dict:  # type: ignore[no-untyped-def]
    """Decode ``n`` sessions together until done or the first block boundary past ``limit_s``
    (``blocks``: exactly that many blocks); pages returned."""
    active = sessions(model, pool, prompt, gen, policy, n)
    every = list(active)
    device = pool.kv.device
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start, rounds, done_blocks = time.perf_counter(), 0, 0
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
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    cache = every[0].result().cache if isinstance(every[0], PolicyBatchSession) else {}
    for s in every:
        pool.release(s.pages)
    return {"seconds": seconds, "rounds": rounds, "blocks": done_blocks, "peak_gib": peak, "cache": cache}


def run_cell(args, forward, model, pool, prompt, gen, policy, n) -> dict:  # type: ignore[no-untyped-def]
    first = timed_run(forward, model, pool, prompt, gen, policy, n, args.cell_s)  # captures the buckets
    second = timed_run(forward, model, pool, prompt, gen, policy, n, args.cell_s, blocks=first["blocks"])
    tokens = n * second["blocks"] * gen.block
    return {
        "tokens_per_s": tokens / second["seconds"],
        "timed_blocks": f"{second['blocks']}/{gen.num_blocks}",
        "round_ms": second["seconds"] / second["rounds"] * 1e3,
        "peak_gib": second["peak_gib"],
        "cache": second["cache"],
    }


def round_check(device: torch.device) -> str:
    """Policy sessions in graphed rounds (split-S kernel and CUDA graphs on CUDA) == the engine's reference
    policy loop, tiny fp32 models, the CPU tests' cases: "matching/total"."""
    from pdllm.decode_service.round_graphs import GraphedRoundForward as Graphed
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
            forward = Graphed(m, pool, "triton" if cuda else "torch", capture=cuda)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--gens", default="256,1024")
    ap.add_argument("--policies", default=POLICIES, help="grid policies, comma-separated")
    ap.add_argument("--e2e-contexts", default="8192,16384,32768", help="'' skips the end-to-end rows")
    ap.add_argument("--e2e-gens", default="32,256")
    ap.add_argument("--cell-s", type=float, default=6.0, help="timed seconds per cell (whole blocks)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="cells past it are skipped")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    check = round_check(device)
    print(f"policy rounds == reference loop on {device.type}: {check}", flush=True)
    mcfg = dream7b() if cuda else tiny()
    model = build_model(mcfg, device, dtype)
    block = 32 if cuda else 8
    small, long_ctx = (1024, 16384) if cuda else (64, 256)
    chunk, top_k = (1024, 4) if cuda else (32, 2)
    engine = PrefillingEngine(model, None, EngineConfig(chunk_size=chunk, top_k=top_k), reuse_chunks=False)
    rng = torch.Generator().manual_seed(0)
    vocab = mcfg.vocab_size
    question = random_ids(QUERY_TOKENS if cuda else 6, vocab, rng)
    budget = int(torch.cuda.mem_get_info()[0] * 0.5) if cuda else 64 * 2**20
    pool = DecodeKVPool.for_model(model, KVPoolConfig(budget))
    forward = GraphedRoundForward(model, pool, "triton" if cuda else "torch", capture=cuda)
    started = time.perf_counter()
    rows, skipped, fixed_s = [], [], {}
    batches = [int(x) for x in args.batches.split(",")]
    gens = [int(x) for x in args.gens.split(",")] if cuda else [16, 32]

    def cell(part: str, method: str, context: int, gen_len: int, n: int, prompt: Prompt, policy: str) -> None:
        where = {
            "part": part,
            "policy": policy,
            "method": method,
            "context_tokens": context,
            "gen_length": gen_len,
            "batch": n,
        }
        if time.perf_counter() - started > args.budget_s:
            skipped.append({**where, "reason": "--budget-s spent"})
            return
        gen = GenerationConfig(gen_length=gen_len, steps=gen_len, block_length=block, stop_at_eos=False)
        try:
            r = run_cell(args, forward, model, pool, prompt, gen, policy, n)
        except Exception as exc:  # e.g. out of memory: recorded, the rest still runs
            skipped.append({**where, "reason": f"{type(exc).__name__}: {exc}"[:300]})
            print(f"[error] {where}: {skipped[-1]['reason']}", flush=True)
            return
        rows.append({**where, **r})
        print(f"[done] {json.dumps(rows[-1])}", flush=True)

    def grid(gen_len: int) -> None:
        for context, method in ((small, "vanilla"), (long_ctx, "pdllm")):
            ctx_ids = random_ids(context, vocab, rng)
            if method == "vanilla":
                prompt = Prompt([mcfg.bos_token_id, *ctx_ids, *question], None, 0)
            else:
                gen = GenerationConfig(gen_length=gen_len, steps=gen_len, block_length=block)
                prompt, fixed_s[context] = pdllm_prompt(engine, ctx_ids, question, gen)
            for n in batches:
                for policy in args.policies.split(","):
                    cell("grid", method, context, gen_len, n, prompt, policy)

    def end_to_end(context: int) -> None:
        ctx_ids = random_ids(context, vocab, rng)
        gen0 = GenerationConfig(gen_length=32, steps=32, block_length=block)
        prompt, fixed_s[context] = pdllm_prompt(engine, ctx_ids, question, gen0)
        whole = Prompt([mcfg.bos_token_id, *ctx_ids, *question], None, 0)
        for gen_len in [int(x) for x in args.e2e_gens.split(",")] if cuda else [16]:
            for policy in ("none", "dual-cache"):
                cell("e2e", "pdllm", context, gen_len, 1, prompt, policy)
            cell("e2e", "vanilla", context, gen_len, 1, whole, "dual-cache")

    # Most needed first: a tight --budget-s drops the last ones.
    grid(gens[0])
    for context in [int(x) for x in args.e2e_contexts.split(",") if x] if cuda else [128, 256]:
        end_to_end(context)
    for gen_len in gens[1:]:
        grid(gen_len)
    e2e: list[dict] = []
    speed = {(r["part"], r["policy"], r["method"], r["context_tokens"], r["gen_length"], r["batch"]): r
             for r in rows}  # fmt: skip
    for r in rows:
        key = (r["method"], r["context_tokens"], r["gen_length"], r["batch"])
        van = speed.get((r["part"], "none", "vanilla", *key[1:]))
        dual = speed.get((r["part"], "dual-cache", *key))
        r["speedup_vs_vanilla"] = r["tokens_per_s"] / van["tokens_per_s"] if van else None
        r["speedup_vs_dual_cache"] = r["tokens_per_s"] / dual["tokens_per_s"] if dual else None
        if r["part"] == "e2e" and r["method"] == "pdllm":
            base = speed.get(("e2e", "dual-cache", "vanilla", r["context_tokens"], r["gen_length"], 1))
            if base:
                mine = fixed_s[r["context_tokens"]] + r["gen_length"] / r["tokens_per_s"]
                theirs = r["gen_length"] / base["tokens_per_s"]
                e2e.append({"context_tokens": r["context_tokens"], "gen_length": r["gen_length"],
                            "pdllm_policy": r["policy"], "pdllm_s": mine, "dual_cache_whole_prompt_s": theirs,
                            "speedup": theirs / mine})  # fmt: skip
    write(args, device, mcfg.model_id, rows, skipped, e2e, fixed_s, argv, check)
    return 0


def write(args, device, model_id, rows, skipped, e2e, fixed_s, argv, check) -> None:  # type: ignore[no-untyped-def]
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python benchmarks/decode_policy_rounds.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "torch": torch.__version__,
        "model": model_id,
        "pdllm_fixed_phases_s": fixed_s,
        "policy_rounds_equal_reference": check,
    }
    name = "decode_policy_rounds" if device.type == "cuda" else "decode_policy_rounds_smoke"
    doc = {**meta, "rows": rows, "e2e": e2e, "skipped": skipped}
    (args.out / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    fmt = lambda x: "—" if x is None else f"{x:.2f}x"  # noqa: E731
    lines = [
        "# Decode policies in the batched rounds (the decode worker's fast path)",
        "",
        f"{meta['device']}, {meta['date']}, `{meta['command']}`",
        f"{model_id}, one token per step, greedy, full-mask pdllm (block, C, K: 32, 1024, 4 on the GPU; "
        "`--smoke` shrinks them). Same run for every row.",
        f"Policy sessions in these rounds == the reference policy loop (tiny fp32 models, CUDA graphs): {check}.",
        "",
        "| method | context | gen | batch | policy | tokens/s | vs vanilla | vs dual cache | round ms | timed blocks | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in [r for r in rows if r["part"] == "grid"]:
        lines.append(
            f"| {r['method']} | {r['context_tokens']} | {r['gen_length']} | {r['batch']} | {r['policy']} | "
            f"{r['tokens_per_s']:.1f} | {fmt(r['speedup_vs_vanilla'])} | {fmt(r['speedup_vs_dual_cache'])} | "
            f"{r['round_ms']:.2f} | {r['timed_blocks']} | {r['peak_gib']:.2f} |"
        )
    lines += ["", "pdllm (fixed phases + loop) vs Fast-dLLM dual cache on the whole prompt, batch 1:", "",
              "| context | gen | pdllm policy | pdllm s | dual cache (whole prompt) s | speedup |", "|---|---|---|---|---|---|"]  # fmt: skip
    for e in e2e:
        lines.append(
            f"| {e['context_tokens']} | {e['gen_length']} | {e['pdllm_policy']} | {e['pdllm_s']:.2f} | "
            f"{e['dual_cache_whole_prompt_s']:.2f} | {e['speedup']:.2f}x |"
        )
    if skipped:
        lines += ["", "Skipped:", ""] + [f"- {json.dumps(s)}" for s in skipped]
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
