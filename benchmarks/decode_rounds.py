"""Batched decode rounds vs one request's decode step, same process, same static KV shapes.

    python benchmarks/decode_rounds.py --out benchmarks/results            # GPU: Dream-7B shapes, bf16
    python benchmarks/decode_rounds.py --smoke --out /tmp/decode_rounds    # CPU: tiny random model

Each session holds K * (C + 1) static tokens (random KV written into the decode worker's pool, as a
full-mask build would leave it), a ``--query``-token question and a ``--gen``-token response decoded in
``--gen`` steps. For each number of active sessions the whole generation runs as batched rounds
(``decode_round``): eager (op by op, split-S kernel) and CUDA-graphed (``GraphedRoundForward``; a first
generation captures the buckets, a second one is timed), with the sessions' default sampler (greedy: on
the device). ``round_ms`` = wall time of a generation / its rounds. The baseline is the in-process engine's
single-request decode step (``DecodeWorker.decode``: one session in graphed rounds), measured in the same
run: ``single_step_ms``. Writes ``decode_rounds.{json,md}``
and a profile of one eager round at 16 sessions (``decode_rounds_profile.txt``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.shapes import build_model, dream7b, sync, tiny  # noqa: E402
from pdllm.decode_service.kv_pool import DecodeKVPool, KVPoolConfig  # noqa: E402
from pdllm.decode_service.round_graphs import GraphedRoundForward  # noqa: E402
from pdllm.decode_service.rounds import BatchSession, EagerRoundForward, decode_round  # noqa: E402
from pdllm.decode_service.worker import DecodeWorker  # noqa: E402
from pdllm.shared.generation.sampler import GenerationConfig  # noqa: E402
from pdllm.shared.static_kv import StaticKV  # noqa: E402

TARGET_RATIO_AT_16 = 2.5


def static_kv(model, tokens: int, seed: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    c = model.config
    p = next(model.parameters())
    gen = torch.Generator(device=p.device).manual_seed(seed)
    shape = (c.num_layers, 2, c.num_kv_heads, tokens, c.head_dim)
    return torch.randn(shape, generator=gen, device=p.device, dtype=p.dtype)


def sessions(
    model,
    pool,
    n: int,
    static: torch.Tensor,
    query: list[int],
    gen: GenerationConfig,
    device_sampler: bool = True,
):  # type: ignore[no-untyped-def]
    out = []
    for _ in range(n):
        pages = pool.reserve(static.shape[3])
        pool.write(pages, static)
        s = static.shape[3]
        out.append(BatchSession.start(model, query, s, s, pages, gen, device_sampler=device_sampler))
    return out


def generation(
    forward, model, pool, n, static, query, gen, device, device_sampler: bool = True, keep=None
) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """Seconds and rounds for ``n`` sessions decoded together from start to end (pages returned);
    ``keep``: a list that receives the sessions."""
    active = sessions(model, pool, n, static, query, gen, device_sampler)
    if keep is not None:
        keep += active
    every = list(active)
    sync(device)
    t, rounds = time.perf_counter(), 0
    while active:
        decode_round(forward, active)
        rounds += 1
        active = [s for s in active if not s.done]
    sync(device)
    seconds = time.perf_counter() - t
    for s in every:
        pool.release(s.pages)
    return seconds, rounds


def single_step_ms(model, static, query, gen, device, graph: bool) -> float:  # type: ignore[no-untyped-def]
    """One request's decode step in the in-process engine (``DecodeWorker.decode``: the same scheduler and
    rounds, one session; graphed rounds with ``graph``), median of the last two of three runs."""
    kv = StaticKV([static], static.shape[3], contiguous=static)
    worker = DecodeWorker(model, cuda_graph=graph)
    times = []
    for _ in range(3):
        result = worker.decode(query, kv, gen)
        times.append(result.decode_seconds / result.steps * 1e3)
    return statistics.median(times[1:])


def round_check(device: torch.device) -> dict:
    """Batched rounds (split-S kernel, CUDA graphs on CUDA) == each request decoded alone by the engine:
    the CPU tests' mixed cases (K, top-B, KV modes, blocks, thresholds, seeded temperatures), fp32."""
    from pdllm.decode_service.round_graphs import GraphedRoundForward as Graphed
    from tests.decode.helpers import CASES, alone, pool_for, session
    from tests.engine.helpers import model as tiny_model

    report: dict = {"cases": 0, "mismatches": []}
    for family in ("dream", "llada"):
        m = tiny_model(family).to(device)
        want = [alone(m, case, seed) for seed, case in enumerate(CASES)]
        pool = pool_for(m)
        forward = Graphed(
            m, pool, "triton" if device.type == "cuda" else "torch", capture=device.type == "cuda"
        )
        sessions = [session(m, pool, case, seed) for seed, case in enumerate(CASES)]
        active = list(sessions)
        while active:
            decode_round(forward, active)
            active = [s for s in active if not s.done]
        for seed, (s, expected) in enumerate(zip(sessions, want, strict=True)):
            report["cases"] += 1
            if s.state.tokens.tolist() != expected:
                report["mismatches"].append({"family": family, "case": seed})
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--active", default=None, help="comma list (default 1,2,4,8,16,32,64; smoke 1,4)")
    ap.add_argument("--chunk", type=int, default=None, help="C (default 1024, smoke 64)")
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--query", type=int, default=24)
    ap.add_argument("--gen", type=int, default=None, help="gen length = steps (default 32, smoke 8)")
    ap.add_argument("--check-only", action="store_true", help="only the rounds == alone check, then exit")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    check = round_check(device)
    print(
        f"batched rounds == alone on {device.type}: {check['cases'] - len(check['mismatches'])}/{check['cases']}"
    )
    if args.check_only:
        return 0 if not check["mismatches"] else 1
    mcfg = dream7b() if cuda else tiny()
    actives = [int(x) for x in (args.active or ("1,2,4,8,16,32,64" if cuda else "1,4")).split(",")]
    chunk = args.chunk or (1024 if cuda else 64)
    gen = GenerationConfig(gen_length=args.gen or (32 if cuda else 8), steps=args.gen or (32 if cuda else 8))
    model = build_model(mcfg, device, dtype)
    tokens = args.top_k * (chunk + 1)
    static = static_kv(model, tokens, 0)
    query = [5 + i for i in range(args.query)]
    c = mcfg
    per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * static.element_size()
    pool = DecodeKVPool.for_model(model, KVPoolConfig(int(max(actives) * (tokens + 64) * per_token * 1.05)))
    kernel = "triton" if cuda else "torch"
    eager = EagerRoundForward(model, pool, kernel)
    graphed = GraphedRoundForward(model, pool, kernel, capture=cuda)
    base_graph = single_step_ms(model, static, query, gen, device, graph=cuda)
    base_eager = single_step_ms(model, static, query, gen, device, graph=False)
    rows = []
    for n in actives:
        s_e, r = generation(eager, model, pool, n, static, query, gen, device)
        generation(graphed, model, pool, n, static, query, gen, device)  # captures this n's buckets
        s_g, r_g = generation(graphed, model, pool, n, static, query, gen, device)
        row = {
            "active": n,
            "round_ms": s_g / r_g * 1e3,
            "round_ms_eager": s_e / r * 1e3,
            "single_step_ms": base_graph,
            "single_step_ms_eager": base_eager,
            "ratio": s_g / r_g * 1e3 / base_graph,
            "rows_per_round": n * (args.query + gen.gen_length),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    if 16 in actives and cuda:
        from torch.profiler import ProfilerActivity, profile

        active = sessions(model, pool, 16, static, query, gen)
        decode_round(eager, active)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                decode_round(eager, active)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
        (args.out / "decode_rounds_profile.txt").write_text(table)
    write(args, rows, device, mcfg.model_id, tokens, gen, chunk, argv, check)
    return 0


def write(args, rows, device, model_id, tokens, gen, chunk, argv, check) -> None:  # type: ignore[no-untyped-def]
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python benchmarks/decode_rounds.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "torch": torch.__version__,
        "model": model_id,
        "static_tokens": tokens,
        "chunk": chunk,
        "top_k": args.top_k,
        "query_tokens": args.query,
        "gen_length": gen.gen_length,
        "steps": gen.steps,
        "rounds_equal_alone": f"{check['cases'] - len(check['mismatches'])}/{check['cases']}",
    }
    name = "decode_rounds" if device.type == "cuda" else "decode_rounds_smoke"
    (args.out / f"{name}.json").write_text(json.dumps({**meta, "decode_round": rows}, indent=2) + "\n")
    lines = [
        "# Batched decode rounds vs one request's step",
        "",
        f"{meta['device']}, {meta['date']}, `{meta['command']}`",
        f"{model_id}, {tokens} static tokens per session (K={args.top_k}, C={chunk}), query {args.query}, "
        f"gen {gen.gen_length} / {gen.steps} steps. Target: 16 active <= {TARGET_RATIO_AT_16}x one step.",
        f"Batched rounds == each request alone (fp32 tiny models, mixed cases): {meta['rounds_equal_alone']}.",
        "",
        "| active | round ms (graphs) | round ms (eager) | single step ms (graph / eager) | round / step |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['active']} | {r['round_ms']:.2f} | {r['round_ms_eager']:.2f} | "
            f"{r['single_step_ms']:.2f} / {r['single_step_ms_eager']:.2f} | {r['ratio']:.2f}x |"
        )
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
