"""Host-side vs device-side unmasking in one run: one request's graphed decode step and batched rounds.

    python benchmarks/decode_sampler.py --out benchmarks/results            # GPU: Dream-7B shapes, bf16
    python benchmarks/decode_sampler.py --smoke --out /tmp/decode_sampler   # CPU: tiny random model

For each generation setting (``--settings``: one block, blocks of 8 with EOS checks at block ends, a
threshold read back every step) it measures, old and new interleaved ``--repeats`` times (median):

- ``single_step_ms``: ms per step of one request decoded by ``decode(..., cuda_graph=True)`` over the
  split-S kernel (through a ``GraphCache``, as the engine's worker does), with the host-side sampler
  (``device_sampler=False``: logits of the masked rows to the host, ``DenoiseState`` there, tokens
  back) and the device-side one (``GraphedStep.denoise``).
- ``round_ms``: ms per round of ``--active`` sessions decoded together through ``GraphedRoundForward``,
  ``BatchSession.start(device_sampler=False / True)``.

Old and new must give the same tokens (reported). Before timing, the device path is checked against
the host path on tiny fp32 models (single request: several block / threshold / EOS settings; rounds: the
CPU tests' mixed cases) on this device, CUDA graphs included. Writes ``decode_sampler.{json,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.decode_rounds import generation, round_check, static_kv  # noqa: E402
from benchmarks.shapes import build_model, dream7b, tiny  # noqa: E402
from pdllm.decode_service.decode import StaticPolicy, decode  # noqa: E402
from pdllm.decode_service.graphs import GraphCache  # noqa: E402
from pdllm.decode_service.kv_pool import DecodeKVPool, KVPoolConfig  # noqa: E402
from pdllm.decode_service.round_graphs import GraphedRoundForward  # noqa: E402
from pdllm.shared.generation.sampler import GenerationConfig  # noqa: E402
from pdllm.shared.static_kv import StaticKV  # noqa: E402

SETTINGS = {
    "one-block": {},
    "blocks-of-8": {"block_length": 8},
    "threshold-0.9": {"threshold": 0.9},
}


def single_check(device: torch.device) -> dict:
    """One request, device sampler == host sampler (same graphed forward), tiny fp32 models."""
    from tests.decode.helpers import CASES, eos_model, static_decode
    from tests.engine.helpers import model as tiny_model

    gens = [
        GenerationConfig(gen_length=12, steps=12),
        GenerationConfig(gen_length=12, steps=6, block_length=4),
        GenerationConfig(gen_length=10, steps=3),
        GenerationConfig(gen_length=12, steps=8, block_length=6),
        GenerationConfig(gen_length=12, steps=12, block_length=6, threshold=0.3),
    ]
    cases = [dataclasses.replace(c, gen=g) for c in CASES if c.gen.temperature == 0 for g in gens]
    mode = "buffer"  # the attention backend is not what is checked here
    report: dict = {"cases": 0, "mismatches": []}
    for family in ("dream", "llada"):
        for planted in (False, True):
            m = (eos_model(family) if planted else tiny_model(family)).to(device)
            for seed, case in enumerate(cases):
                built = static_decode(m, case, seed)
                q, kv, gen = built.query, built.static, case.gen
                out = [
                    decode(m, q, kv, gen, StaticPolicy(mode), cuda_graph=True, device_sampler=d)
                    for d in (False, True)
                ]
                report["cases"] += 1
                if (out[0].raw_tokens, out[0].steps) != (out[1].raw_tokens, out[1].steps):
                    report["mismatches"].append({"family": family, "eos": planted, "case": seed})
    return report


def single(
    model, static, query, gen, device, device_sampler: bool, cache: GraphCache
) -> tuple[float, list[int]]:  # type: ignore[no-untyped-def]
    """ms per step and tokens of one request, through a graph cache (as the engine's worker runs it)."""
    kv = StaticKV([static], static.shape[3], contiguous=static)
    mode = "triton" if device.type == "cuda" else "buffer"
    policy = StaticPolicy(mode)
    result = decode(
        model, query, kv, gen, policy, cuda_graph=True, graph_cache=cache, device_sampler=device_sampler
    )
    return result.decode_seconds / result.steps * 1e3, result.raw_tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--active", default=None, help="comma list of round sizes (default 1,16; smoke 4)")
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma list of {list(SETTINGS)}")
    ap.add_argument("--chunk", type=int, default=None, help="C (default 1024, smoke 64)")
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--query", type=int, default=24)
    ap.add_argument("--gen", type=int, default=None, help="gen length = steps (default 32, smoke 8)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per path (default 5, smoke 1)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    checks = {"single": single_check(device), "rounds": round_check(device)}
    for name, c in checks.items():
        print(f"{name} check on {device.type}: {c['cases'] - len(c['mismatches'])}/{c['cases']}")
    mcfg = dream7b() if cuda else tiny()
    actives = [int(x) for x in (args.active or ("1,16" if cuda else "4")).split(",")]
    chunk = args.chunk or (1024 if cuda else 64)
    n_gen = args.gen or (32 if cuda else 8)
    repeats = args.repeats or (5 if cuda else 1)
    model = build_model(mcfg, device, dtype)
    tokens = args.top_k * (chunk + 1)
    static = static_kv(model, tokens, 0)
    query = [5 + i for i in range(args.query)]
    c = mcfg
    per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * static.element_size()
    pool = DecodeKVPool.for_model(model, KVPoolConfig(int(max(actives) * (tokens + 64) * per_token * 1.05)))
    kernel = "triton" if cuda else "torch"
    graphed = GraphedRoundForward(model, pool, kernel, capture=cuda)
    cache = GraphCache()
    rows = []
    for name in args.settings.split(","):
        gen = GenerationConfig(gen_length=n_gen, steps=n_gen, **SETTINGS[name])
        row: dict = {"setting": name}
        times: dict[bool, list[float]] = {False: [], True: []}
        tokens_of: dict[bool, list[int]] = {}
        for _ in range(repeats + 1):  # the first run of each captures its graphs
            for device_sampler in (False, True):
                ms, out = single(model, static, query, gen, device, device_sampler, cache)
                times[device_sampler].append(ms)
                tokens_of[device_sampler] = out
        row["single_step_ms_host"] = statistics.median(times[False][1:] or times[False])
        row["single_step_ms_device"] = statistics.median(times[True][1:] or times[True])
        row["single_equal"] = tokens_of[False] == tokens_of[True]
        for n in actives:
            per: dict[bool, list[float]] = {False: [], True: []}
            kept: dict[bool, list] = {False: [], True: []}
            for i in range(repeats + 1):
                for device_sampler in (False, True):
                    keep: list = []
                    sec, r = generation(
                        graphed, model, pool, n, static, query, gen, device, device_sampler, keep
                    )
                    if i:
                        per[device_sampler].append(sec / r * 1e3)
                    kept[device_sampler] = keep
            row[f"round_ms_host@{n}"] = statistics.median(per[False] or [float("nan")])
            row[f"round_ms_device@{n}"] = statistics.median(per[True] or [float("nan")])
            row[f"rounds_equal@{n}"] = all(
                a.result().raw_tokens == b.result().raw_tokens
                for a, b in zip(kept[False], kept[True], strict=True)
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
    write(args, rows, device, mcfg.model_id, tokens, n_gen, chunk, actives, argv, checks, repeats)
    ok = all(not c["mismatches"] for c in checks.values())
    ok = ok and all(v for r in rows for k, v in r.items() if k.startswith(("single_equal", "rounds_equal")))
    return 0 if ok else 1


def write(args, rows, device, model_id, tokens, n_gen, chunk, actives, argv, checks, repeats) -> None:  # type: ignore[no-untyped-def]
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python benchmarks/decode_sampler.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "torch": torch.__version__,
        "model": model_id,
        "static_tokens": tokens,
        "chunk": chunk,
        "top_k": args.top_k,
        "query_tokens": args.query,
        "gen_length": n_gen,
        "steps": n_gen,
        "repeats": repeats,
        "checks": {k: f"{c['cases'] - len(c['mismatches'])}/{c['cases']}" for k, c in checks.items()},
        "mismatches": {k: c["mismatches"] for k, c in checks.items()},
    }
    name = "decode_sampler" if device.type == "cuda" else "decode_sampler_smoke"
    (args.out / f"{name}.json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    lines = [
        "# Decode step: host-side vs device-side unmasking",
        "",
        f"{meta['device']}, {meta['date']}, torch {meta['torch']}, `{meta['command']}`",
        f"{model_id}, {tokens} static tokens per request (K={args.top_k}, C={chunk}), query {args.query}, "
        f"gen {n_gen} / {n_gen} steps; median of {repeats} runs, old and new interleaved.",
        "Checks on this device, tiny fp32 models, CUDA graphs: one request, device sampler == host sampler "
        f"{meta['checks']['single']}; batched rounds (device sessions, seeded sampled ones on the host) == "
        f"each request alone on the host sampler {meta['checks']['rounds']}.",
        "",
        "| setting | step ms host / device | equal | "
        + " | ".join(f"round ms @{n} host / device | equal" for n in actives)
        + " |",
        "|---|---|---|" + "---|---|" * len(actives),
    ]
    for r in rows:
        cells = [
            r["setting"],
            f"{r['single_step_ms_host']:.2f} / {r['single_step_ms_device']:.2f}",
            "yes" if r["single_equal"] else "NO",
        ]
        for n in actives:
            cells += [
                f"{r[f'round_ms_host@{n}']:.2f} / {r[f'round_ms_device@{n}']:.2f}",
                "yes" if r[f"rounds_equal@{n}"] else "NO",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
