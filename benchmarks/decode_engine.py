"""Decode policies, one benchmark: each question about a policy's decode speed is a case (``--cases``).

    python benchmarks/decode_engine.py                   # one H100: the default cases, ~7.5 min
    python benchmarks/decode_engine.py --cases polestar-tpf --update    # any machine (CPU): adds its rows
    python benchmarks/decode_engine.py --cases rounds-e2e,focus-batched --focus-batches 1,16,64 --update
    python benchmarks/decode_engine.py --smoke --cases all   # CPU: tiny models, seconds (not a measurement)

Output: ``--out`` (benchmarks/results; smoke: a temp dir) / ``--name`` (decode_engine) ``.json`` + ``.md``;
``--update`` keeps the rows and notes of the cases not run now from the file already there, so cases run
in separate calls (or on separate machines) share one file without overwriting each other. A run with
``--schedule`` stores its cases as ``<case>+replayed`` (``rounds+replayed``), beside the one-token-per-step ones;
``--tag T`` stores them as ``<case>+T`` (another configuration of a case kept beside the default one).

Dream-7B shapes with random bf16 weights (``shapes.py``; SDAR-8B shapes for ``focus-batched``), block 32,
one token per step (steps = gen length: the same step count for every policy, and no confidence threshold,
which random weights would make meaningless), greedy, no EOS stop; prompts of random ids: ``vanilla`` =
BOS + a ``--vanilla-context`` (1K) context + a 24-token question, every row local; ``pdllm`` = a
``--pdllm-context`` (16K) context through the engine's prefill, selection and static-KV build (C=1024, K=4,
full-mask), the question + answer local. Policies at the papers' knobs: Sparse-dLLM r = 0.5, s = 3, one-step
delay; Polestar-Cache 8 clusters, top 2, update threshold 4, int8 residuals; DyLLM and FOCUS their defaults
(FOCUS runs on SDAR only: ``focus-batched``); ``--policy-knobs sparse_delay_steps=0,polestar_recompute=per-layer``
runs other settings in the rounds cases, each to the policy that owns it (those rows carry ``policy_knobs``).

Cases (default: every case but ``rounds-e2e``, ``mixed``, ``polestar-tpf`` and ``serve``):
  loop           the in-process denoising loop, batch 1 (vanilla: ``tests/reference/vanilla.py``; pdllm:
                 ``PrefillingEngine.generate``), per policy none / dual-cache /
                 sparse-dllm / prefix-cache / polestar, vanilla 1K and pdllm 16K, and none / dual-cache on the whole 16K
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
                 dual cache on the whole prompt, at 8K / 16K / 32K and gen 32 / 256, and against vanilla
                 decoding (one token per step, no cache; ``--e2e-vanilla-steps`` steps timed, times gen).

``--schedule FILE`` (a ``pdllm eval --record-schedule`` file; ``--schedule-select method=pdllm,threshold=0.9``
keeps some of its samples): the rounds, rounds-e2e and focus-batched requests unmask the recorded counts per
step, the most confident masked positions (``decode_cases/replay.py``: request i replays sample i mod N,
fitted to the cell's gen and blocks in pieces of the recorded block length; focus-batched: the same schedule
for request i in its plain and FOCUS runs), so speed is measured at a recorded TPF. Their rows carry
``replayed: true``, ``recorded_tpf`` (the eval's TPF of the samples replayed) and ``schedule_tpf`` (tokens
per step as replayed), the rounds' also ``timed_blocks`` as the rounds timed; ``tpf`` and tokens/s count
the tokens the replayed steps unmasked. Without it, rows carry ``replayed: false``. The policies' work is
replayed too where the file records it (``schedule.policy_fractions``, the selected samples' mean): FOCUS
(focus-batched) keeps the top ``ceil(f x block rows)`` masked
rows by its importance delta (plus its AR-context, placeholder and context rows), DyLLM makes the
``ceil(f x queried rows)`` most drifted rows salient at each layer of a SparseStep (f: ``ffn_frac``),
Polestar-Cache recomputes ``ceil(r)`` rows per layer at each update and updates at the recorded rate per
forward; scores and kernels stay the policy's, only the counts are forced (the ``replay_*`` config fields).
Those rows carry ``replayed_fractions`` (what was forced; None: the file records none for the policy, which
then makes its own choices, ``sparsity`` saying so) beside ``measured_fractions`` (the same fractions of the
run's counters). Measured and forced differ where the policy's other rules decide: FOCUS's frozen rows and
added rows, DyLLM's FullSteps and rows not queried, Polestar's refreshes (no update) and short runs.
  compute-skip   DyLLM (its reference loop) against the plain loop and the dual cache (vanilla 1K, gen 256, the loop
                 case's runs where it ran them); ``rows_frac`` = rows a policy ran through its skipping
                 layers / rows plain decoding would have. Warm-up: one block of the same configuration.
  focus-batched  FOCUS in the decode worker's rounds (``focus-rounds``: the scheduler, every request
                 submitted at once) against plain block diffusion in the same rounds (``plain-rounds``), on
                 SDAR-8B shapes at ``--focus-batches`` (1, 16), gen ``--focus-gen`` (32); tokens/s = batch x
                 gen / seconds, the prompts' builds included; warm-up: one block of the same configuration;
                 ``rows_frac``: FOCUS's rows past layer 1 / plain's.
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
case's own columns (rounds and rounds-e2e: ``cache_bytes``, the KV pool pages one request holds, static KV
plus its policy's cache, and ``static_kv_bytes``, the static KV's share). Runs are ordered so that a tight
``--budget-s`` drops the least needed; skipped runs are listed with their reason. ``--update`` keeps the rows
of the cases not run from an earlier file of the same name.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the benchmarks package importable
    sys.path.insert(0, str(ROOT))

# ROW_KEYS (the tests'), Prompt and sessions (polestar_round_profile.py's) are re-exported from here
from benchmarks.decode_cases.bench import ROW_KEYS, Bench, CaseInfo  # noqa: E402, F401
from benchmarks.decode_cases.focus_batched import case_focus_batched  # noqa: E402
from benchmarks.decode_cases.loop import case_compute_skip, case_loop, case_polestar  # noqa: E402
from benchmarks.decode_cases.mixed import case_mixed  # noqa: E402
from benchmarks.decode_cases.polestar_tpf import case_polestar_tpf  # noqa: E402
from benchmarks.decode_cases.replay import Replay  # noqa: E402
from benchmarks.decode_cases.report import write  # noqa: E402
from benchmarks.decode_cases.rounds import ROUND_POLICIES, Prompt, case_rounds, sessions  # noqa: E402, F401
from benchmarks.decode_cases.rounds_e2e import case_rounds_e2e  # noqa: E402
from benchmarks.decode_cases.serve import case_serve  # noqa: E402
from benchmarks.e2e_speedup import QUERY_TOKENS  # noqa: E402
from benchmarks.harness import Run, add_run_args, default_out, run_meta  # noqa: E402
from pdllm.shared.decode_policy_settings import KNOB_GROUPS  # noqa: E402

NAME = "decode_engine"


CASES: dict[str, CaseInfo] = {
    "loop": CaseInfo(case_loop, "the in-process denoising loop per policy, batch 1", "dream"),
    "rounds": CaseInfo(
        case_rounds,
        "the decode worker's batched rounds per policy, batch 1 and 16",
        "dream",
    ),
    "compute-skip": CaseInfo(
        case_compute_skip,
        "DyLLM vs the plain loop and the dual cache, batch 1",
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
    ap.add_argument("--schedule", type=Path, default=None,
                    help="rounds, rounds-e2e, focus-batched: requests replay the unmask counts of this `pdllm eval --record-schedule` "
                    "file (rows labelled replayed) instead of one token per step, and FOCUS / DyLLM / Polestar the "
                    "work fractions it records")  # fmt: skip
    ap.add_argument("--schedule-select", default=None,
                    help="--schedule: only its samples with these key=value fields, e.g. method=pdllm,threshold=0.9")  # fmt: skip
    ap.add_argument("--e2e-contexts", default=None, help="rounds-e2e: contexts (default 8192,16384,32768)")
    ap.add_argument("--policy-knobs", default="", type=_knobs,
                    help="rounds: policy settings instead of the papers', e.g. sparse_delay_steps=0,"
                         "polestar_recompute=per-layer (each applies to the policy that owns it, KNOB_GROUPS)")  # fmt: skip
    ap.add_argument("--tag", default=None,
                    help="store this run's cases as <case>+TAG (default: +replayed with --schedule, else none)")  # fmt: skip
    ap.add_argument("--e2e-gens", default=None, help="rounds-e2e: gen lengths (default 32,256; smoke 16)")
    ap.add_argument("--e2e-vanilla-steps", type=int, default=16,
                    help="rounds-e2e: vanilla steps timed (one token per step, no cache; 0: no vanilla row)")  # fmt: skip
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


def _knobs(text: str) -> dict[str, object]:
    """``a=1,b=x`` -> {"a": 1, "b": "x"}: numbers as numbers (the decode-policy settings validate them)."""
    pairs = [p.split("=", 1) for p in text.split(",") if p.strip()]
    if any(len(p) != 2 or not p[0].strip() for p in pairs):
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE[,NAME=VALUE...], got {text!r}")
    known = {"cache_refresh_steps", *(k for group in KNOB_GROUPS.values() for k in group)}
    out: dict[str, object] = {}
    for k, v in pairs:
        if k.strip() not in known:  # a name no policy owns would be dropped without a word
            raise argparse.ArgumentTypeError(f"{k.strip()!r} is no policy knob; known: {sorted(known)}")
        try:
            out[k.strip()] = json.loads(v.strip())
        except ValueError:
            out[k.strip()] = v.strip()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    run = Run.from_args(args, args.needs_gpu)
    bench = Bench(args, run)
    if args.schedule is not None:
        bench.replay = Replay.load(args.schedule, args.schedule_select)
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
            bench, meta | {"elapsed_s": run.elapsed()}, kept, list(CASES)
        )  # after every case: a cut-short run keeps its rows
    bench.drop()
    print(f"[{NAME}] done after {run.elapsed():.0f}s: {len(bench.rows)} rows -> {args.out / args.name}.{{json,md}}",
          flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
