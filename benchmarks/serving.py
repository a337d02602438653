"""Serving benchmark: requests/s, TTFT and step gaps of real `pdllm serve` layouts under load, and the
service's overhead over the in-process engine.

    # GPU (Dream-7B shapes, random bf16 weights):
    python benchmarks/serving.py --out benchmarks/results --serve-flags=--cuda-graph
    python benchmarks/serving.py --layouts all-in-one,replicas,1p1d-build-on-decode \\
        --decode-round-json benchmarks/results/decode_rounds.json --out benchmarks/results
    # all-in-one vs split prefill/decode processes and the single-request service overhead, one call:
    python benchmarks/serving.py --layouts all-in-one,1p1d-build-on-decode --share-gpu --context-tokens 16384 \\
        --concurrency 16 --warm-burst 2 --single-repeats 3 --out $OUT
    # CPU smoke (tiny random model, 1 thread per process; says nothing about GPUs):
    python benchmarks/serving.py --smoke --out /tmp/serving

Model: Dream-7B shapes (``benchmarks.shapes.dream7b``) with random weights, written once as a checkpoint
(``--ckpt-dir``, default under /tmp; reused when its marker matches) with the shipped tokenizer (ids < 4096 <
the model's vocabulary) and a ``pdllm.json`` giving the engine settings (C=1024, K=4, fixed chunks; smoke:
C=256, K=3). Prompts: seeded needle documents of ``--context-tokens`` tokens from the evaluation haystack
(``shared/eval/tasks.py``) and their question; every request has its own document, so no chunk KV is shared
within a server.

Layouts (processes started once per layout, reused for all its cells, killed at the end or on error):
  all-in-one            one ``serve --role all`` on GPU 0 (gpus=1).
  replicas              ``--role all`` keeps its prefill/decode workers on private loopback ports that it
                        never prints, so a router cannot reach them: replicas are two ``--role prefill`` +
                        two ``--role decode`` processes (prefill_i and decode_i share GPU i) behind one
                        ``--role router`` (gpus=2).
  1p1d-build-on-decode  router + one ``--role prefill`` on GPU 0 + one ``--role decode`` on GPU 1; the
                        prefill worker sends chunk handles, the decode worker builds their KV (gpus=2).
  1p1d-build-on-prefill the same processes; the prefill worker builds the decode KV and hands it off
                        (NCCL, GPU 0 -> GPU 1), the decode worker only decodes (gpus=2).
  1p1d-auto             the same; the router picks the side per request (``--build-on auto``).
2-GPU layouts are skipped (meta.skipped) when fewer than 2 GPUs are visible, unless ``--share-gpu`` puts
every process on GPU 0 (on CPU: every process on the CPU).

Workloads (``--workloads``): ``unique``, every request its own document (no chunk KV shared within a server);
``reuse``, ``--documents`` D distinct documents (64) and requests drawn Zipf(``--zipf``, 1.0) over their
ranks, each with its own question (chunks repeat, queries never do): the first reuse cell's warm-up reads
every document twice (the default ``--kv-write-policy second-sight`` stores a document whole from its second
request on), each cell then measures ``--reuse-requests`` (max(4 c, 32)) requests. Every row has
``workload`` and ``hit_rate`` (chunks whose KV came from a tier / chunks looked up, from the traces).

Cells: for each layout, each ``--context-tokens``, each workload and each ``--concurrency`` c. Every request streams
(GenerateStream, gen_length = steps). Per (layout, context): one warm-up request, then one request alone
(``unloaded_step_ms``). Per cell: a warm-up burst of ``--warm-burst`` (default c) simultaneous streams on
their own documents (CUDA-graph bucket captures and Triton compiles stay out of the numbers), then
``requests`` = max(c, 4) streams with at most c in flight (a thread pool of c workers). Every layout gets the
same documents in the same order.
  requests_per_s    finished requests / cell wall (first send -> last final event).
  gen_tokens_per_s  gen_length * finished / cell wall.
  ttft_p50/p99_s    send -> first streamed event, over the cell's finished requests.
  step_p50/p99_ms   gaps between consecutive partial events of a stream (one decode round each), pooled
                    over all streams of the cell. p99 is nearest-rank (the max for < 100 gaps).
  unloaded_step_ms  step-gap p50 of one request alone on that layout and context.
  peak_gib          max over the cell's final responses of ``trace.peak_memory_bytes`` / 2**30 (CUDA max
                    allocated of the worker; on CPU an RSS delta, may be 0).
  failed            requests that errored or were still running at the budget (errors in meta.errors).
Per-row diagnostics (JSON only): ``kv_sources``, ``handoff_s_p50``, ``build_s_p50`` (where each request's
decode KV came from), ``decode_step_ms_worker`` (the decode workers' own mean step over the cell, from their
``pdllm_decode_step_seconds`` metric), ``latency_p50_s`` / ``latency_max_s`` (send -> final event), and
``answers_equal_all_in_one`` (how many answers equal the all-in-one's for the same documents, same run; with
batched bf16 rounds a request's logits depend on its round-mates, so random weights may flip tokens).
``ratios``: each layout's requests/s over the all-in-one's at the same context and concurrency, same run
(target >= 1.7x for the 1p1d layouts, a two-GPU claim).

Service overhead (``--single-repeats N``; needs the all-in-one layout): before any server starts, the engine
``pdllm serve`` builds, called in process (same store and settings, tokenization included, decoding with a
CUDA graph on CUDA as the served rounds do), answers N single requests after one warm-up; then ``serve
--role all`` answers the same N documents, unary, one at a time. overhead = median served / median in
process - 1 (target <= 10%); whether the answers are equal.

A cell whose estimate ((warm + requests) x the unloaded request's wall time) would overrun ``--budget-s``
is skipped (meta.skipped). ``decode_round`` copies the list of ``--decode-round-json`` (decode_rounds.py).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import json
import math
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make benchmarks and tests importable
    sys.path.insert(0, str(ROOT))

from benchmarks.shapes import build_model, dream7b, sync, tiny  # noqa: E402
from pdllm.shared.app import serve  # noqa: E402
from pdllm.shared.generation.sampler import GenerationConfig  # noqa: E402
from pdllm.shared.model.config import ModelConfig  # noqa: E402
from pdllm.shared.model.loader import DTYPES, load_tokenizer, save_checkpoint  # noqa: E402
from pdllm.shared.prompt import encode_prompt  # noqa: E402
from pdllm.shared.rpc.client import PdllmClient  # noqa: E402
from tests.services.cluster import ServeProcess  # noqa: E402

LAYOUT_GPUS = {
    "all-in-one": 1,
    "replicas": 2,
    "1p1d-build-on-decode": 2,
    "1p1d-build-on-prefill": 2,
    "1p1d-auto": 2,
}
BUILD_ON = {"1p1d-build-on-prefill": "prefill", "1p1d-auto": "auto"}  # others: the decode worker builds
ROW_KEYS = ("layout", "workload", "gpus", "concurrency", "context_tokens", "requests", "failed", "requests_per_s",
            "gen_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "step_p50_ms", "step_p99_ms", "unloaded_step_ms",
            "peak_gib", "hit_rate")  # fmt: skip
ROW_DEFAULTS = {"workload": "unique", "hit_rate": "—"}  # rows merged from runs before these keys existed
# Per-row diagnostics kept in the JSON, not in the table (rows merged from older runs lack them): where
# each request's decode KV came from (``trace.kv_source``) and its median handoff and build seconds; the
# decode workers' own step; request latency; answers against the all-in-one's.
DIAG_KEYS = ("kv_sources", "handoff_s_p50", "build_s_p50", "decode_step_ms_worker", "latency_p50_s",
             "latency_max_s", "answers_equal_all_in_one")  # fmt: skip
MIN_REQUESTS = 4
WORKLOADS = ("unique", "reuse")
SHIPPED = ROOT / "shared" / "checkpoints" / "pdllm-needle"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TARGET_SPLIT_RATIO = 1.7  # split prefill/decode (two GPUs) vs the all-in-one, requests/s
TARGET_OVERHEAD = 0.10  # served vs in-process engine, one request


def smoke_config() -> ModelConfig:
    """The tiny shapes with the shipped tokenizer's vocabulary and special ids."""
    return tiny().replace(
        vocab_size=4096, mask_token_id=3, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        model_id="tiny-serving",
    )  # fmt: skip


# ---------------------------------------------------------------------------------------- checkpoint
def write_checkpoint(mcfg: ModelConfig, out: Path, device: torch.device, dtype: str, engine: dict) -> dict:
    """Random-weight checkpoint + shipped tokenizer + pdllm.json; reused when the marker matches."""
    marker = out / "bench_checkpoint.json"
    want = {"model": mcfg.to_hf_dict(), "dtype": dtype, "engine": engine}
    if marker.is_file() and json.loads(marker.read_text()) == want:
        return {"reused": True, "seconds": 0.0, "bytes": _dir_bytes(out)}
    if out.exists():
        shutil.rmtree(out)
    t = time.perf_counter()
    model = build_model(mcfg, device, DTYPES[dtype])
    save_checkpoint(model, out)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    for name in TOKENIZER_FILES:
        shutil.copy(SHIPPED / name, out / name)
    (out / "pdllm.json").write_text(json.dumps({"engine": engine}, indent=1) + "\n")
    marker.write_text(json.dumps(want))
    return {"reused": False, "seconds": time.perf_counter() - t, "bytes": _dir_bytes(out)}


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def documents(tokenizer, tokens: int, count: int, seed: int = 0) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    """``count`` distinct seeded needle documents of ~``tokens`` tokens with their questions."""
    from pdllm.shared.eval.tasks import eval_factory

    factory = eval_factory(tokenizer)
    docs = []
    for i in range(count):
        s = factory.make_sample("needle", tokens, round((i * 37 % 100) / 100, 2), seed + i)
        docs.append((s.context, s.question))
    return docs


def reuse_requests(docs: list[tuple[str, str]], n: int, exponent: float, seed: int) -> list[tuple[str, str]]:
    """``n`` requests over ``docs``, document of rank k drawn with probability ~ 1 / k**exponent (seeded),
    each with its own question (the document's question, numbered): chunks repeat, queries never do."""
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** exponent for k in range(len(docs))]
    picks = rng.choices(range(len(docs)), weights=weights, k=n)
    return [(docs[d][0], f"{docs[d][1]} ({i + 1})") for i, d in enumerate(picks)]


# ---------------------------------------------------------------------------------------- helpers
class Clock:
    def __init__(self, budget_s: float) -> None:
        self.started = time.perf_counter()
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def fits(self, estimate_s: float) -> bool:
        return self.left() > estimate_s


def wait_routable(address: str, doc: tuple[str, str], gen: int, clock: Clock, limit_s: float) -> float:
    """Send the warm-up request until the router has healthy workers; returns its wall time."""
    deadline = time.perf_counter() + min(limit_s, max(clock.left(), 1.0))
    last: Exception | None = None
    with PdllmClient(address) as client:
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            try:
                client.generate(*doc, gen_length=gen, steps=gen, timeout_s=max(deadline - t, 1.0))
                return time.perf_counter() - t
            except Exception as exc:  # UNAVAILABLE until the first health check passes
                last = exc
                time.sleep(0.5)
    raise RuntimeError(f"{address}: no answer to the warm-up request: {last}")


def start_all(procs: list[ServeProcess], timeout_s: float) -> None:
    """Start the processes in parallel (each start blocks until its ready line)."""
    with ThreadPoolExecutor(len(procs)) as pool:
        for f in [pool.submit(p.start, timeout_s) for p in procs]:
            f.result()


def decode_steps(procs: list[ServeProcess]) -> tuple[float, float]:
    """Seconds and count of the decode steps the processes' decode workers ran so far (their metric)."""
    workers = [p for p in procs if p.role in ("all", "decode")]
    try:
        return (sum(p.metric("pdllm_decode_step_seconds_sum") for p in workers),
                sum(p.metric("pdllm_decode_step_seconds_count") for p in workers))  # fmt: skip
    except OSError:  # a scrape that fails leaves the diagnostic out (nan), not the cell
        return 0.0, 0.0


# ---------------------------------------------------------------------------------------- service overhead
def single_requests(address: str, docs: list[tuple[str, str]], gen: int, clock: Clock) -> dict:
    """``docs`` one at a time, unary: seconds, answers and the server's phase timings of each."""
    seconds, answers, traces = [], [], []
    with PdllmClient(address) as client:
        for context, question in docs:
            t = time.perf_counter()
            r = client.generate(
                context, question, gen_length=gen, steps=gen, timeout_s=max(clock.left(), 5.0)
            )
            seconds.append(time.perf_counter() - t)
            answers.append(list(r.token_ids))
            tm = r.trace.timings
            traces.append({k: getattr(tm, k) for k in ("queue_s", "prefill_s", "score_s", "build_s", "decode_s",
                                                        "ttft_s", "total_s")})  # fmt: skip
    return {"seconds": seconds, "median_s": statistics.median(seconds), "answers": answers, "timings": traces}


def in_process(ckpt: Path, device: str, dtype: str, docs: list[tuple[str, str]], warm: tuple[str, str],
               gen: int, serve_flags: list[str]) -> dict:  # fmt: skip
    """The engine ``pdllm serve`` builds, called directly (tokenization included), decoding with a CUDA
    graph on CUDA as the served decode worker's rounds do; one warm-up request, then ``docs``."""
    from pdllm.shared.app.engine import PrefillingEngine

    t = time.perf_counter()
    engine, loaded = serve._engine(serve.build_parser().parse_args(["--model", str(ckpt), "--device", device,
                                                                    "--dtype", dtype, *serve_flags]))  # fmt: skip
    if device.startswith("cuda") and "--no-cuda-graph" not in serve_flags:
        engine = PrefillingEngine(loaded.model, loaded.tokenizer, engine.config, store=engine.store,
                                  cuda_graph=True)  # fmt: skip
    load_s = time.perf_counter() - t
    try:
        with torch.inference_mode():
            _engine_run(engine, loaded.tokenizer, *warm, gen)
            runs = [_engine_run(engine, loaded.tokenizer, *d, gen) for d in docs]
    finally:
        del engine, loaded
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    seconds = [r[0] for r in runs]
    return {"load_s": load_s, "seconds": seconds, "median_s": statistics.median(seconds),
            "answers": [r[1] for r in runs], "timings": [r[2] for r in runs]}  # fmt: skip


def _engine_run(engine, tokenizer, context: str, question: str, gen: int) -> tuple[float, list[int], dict]:  # type: ignore[no-untyped-def]
    sync(engine.device)
    t = time.perf_counter()
    ids = encode_prompt(tokenizer, context, question)
    result, trace = engine.generate(ids.context, ids.query, GenerationConfig(gen_length=gen, steps=gen))
    sync(engine.device)
    return time.perf_counter() - t, result.token_ids, dict(trace.timings)


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q=0.5 gives the median); nan when empty."""
    if not values:
        return float("nan")
    if q == 0.5:
        return statistics.median(values)
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def stream_one(address: str, doc: tuple[str, str], gen: int, timeout_s: float) -> dict:
    """One streamed request: send/first/last stamps, partial-to-partial gaps, peak memory; never raises."""
    start = time.perf_counter()
    try:
        with PdllmClient(address, timeout_s=timeout_s) as client:
            stamps, final = [], None
            for event in client.generate_stream(*doc, gen_length=gen, steps=gen):
                stamps.append(time.perf_counter())
                if event.HasField("final"):
                    final = event.final
        if final is None:
            raise RuntimeError("stream ended without a final message")
        partials = stamps[:-1]
        return {"ok": True, "start": start, "end": stamps[-1], "ttft_s": stamps[0] - start,
                "gaps_s": [b - a for a, b in zip(partials, partials[1:], strict=False)],
                "peak_bytes": final.trace.peak_memory_bytes, "cache_hits": final.trace.cache_hits,
                "cache_misses": final.trace.cache_misses,
                "kv_source": final.trace.kv_source, "handoff_s": final.trace.timings.handoff_s,
                "build_s": final.trace.timings.build_s, "answer": list(final.token_ids)}  # fmt: skip
    except Exception as exc:  # every failure is a finding: counted, reported in meta.errors
        return {"ok": False, "start": start, "error": f"{type(exc).__name__}: {exc}"[:300]}


def burst(address: str, docs: list[tuple[str, str]], gen: int, in_flight: int, clock: Clock) -> dict:
    """``docs`` as streams, at most ``in_flight`` at once; wall = first send -> last final event."""
    timeout = max(clock.left(), 5.0)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, in_flight)) as pool:
        futures = [pool.submit(stream_one, address, d, gen, timeout) for d in docs]
        results = [f.result() for f in futures]
    ok = [r for r in results if r["ok"]]
    wall = (max(r["end"] for r in ok) if ok else time.perf_counter()) - t0
    return {
        "results": results,
        "ok": ok,
        "wall_s": wall,
        "errors": [r["error"] for r in results if not r["ok"]],
    }


def cell_row(layout: str, gpus: int, conc: int, ctx: int, gen: int, b: dict, unloaded_ms: float,
             worker_step_ms: float = float("nan"), reference: list | None = None,
             workload: str = "unique") -> dict:  # fmt: skip
    """The cell's row; ``reference``: the all-in-one's answers to the same documents (None: not compared)."""
    ok, n = b["ok"], len(b["results"])
    looked_up = sum(r.get("cache_hits", 0) + r.get("cache_misses", 0) for r in ok)
    gaps = [g for r in ok for g in r["gaps_s"]]
    ttft = [r["ttft_s"] for r in ok]
    latency = [r["end"] - r["start"] for r in ok]
    answers = [r.get("answer") for r in b["results"]]
    same = None
    if reference is not None:
        agree = sum(a is not None and a == r for a, r in zip(answers, reference, strict=True))
        same = f"{agree}/{len(reference)}"
    return {"layout": layout, "workload": workload, "gpus": gpus, "concurrency": conc, "context_tokens": ctx,
            "requests": n,
            "failed": n - len(ok), "requests_per_s": len(ok) / b["wall_s"],
            "gen_tokens_per_s": gen * len(ok) / b["wall_s"], "ttft_p50_s": pct(ttft, 0.5),
            "ttft_p99_s": pct(ttft, 0.99), "step_p50_ms": pct(gaps, 0.5) * 1e3,
            "step_p99_ms": pct(gaps, 0.99) * 1e3, "unloaded_step_ms": unloaded_ms,
            "peak_gib": max((r["peak_bytes"] for r in ok), default=float("nan")) / 2**30,
            "hit_rate": sum(r.get("cache_hits", 0) for r in ok) / looked_up if looked_up else 0.0,
            # where each request's decode KV came from (built on decode, pulled, a failed pull rebuilt)
            "kv_sources": dict(collections.Counter(r.get("kv_source", "") for r in ok)),
            "handoff_s_p50": pct([r.get("handoff_s", 0.0) for r in ok], 0.5),
            "build_s_p50": pct([r.get("build_s", 0.0) for r in ok], 0.5), "decode_step_ms_worker": worker_step_ms,
            "latency_p50_s": pct(latency, 0.5), "latency_max_s": max(latency, default=float("nan")),
            "answers_equal_all_in_one": same}  # fmt: skip


def start_layout(
    layout: str, model_args: list[str], router_args: list[str], env, procs: list, clock: Clock
) -> str:  # type: ignore[no-untyped-def]
    """Start ``layout``'s processes (appended to ``procs`` first, so the caller kills them); its address."""
    limit = min(max(clock.left(), 10.0), 600.0)
    if layout == "all-in-one":
        procs.append(ServeProcess("all", model_args, env=env("0")))
        start_all(procs[-1:], limit)
        return procs[-1].address
    gpus = ("0", "1") if layout == "replicas" else ("0",)  # replicas: no handoff (a pair may share a GPU)
    pre = [ServeProcess("prefill", model_args, env=env(g)) for g in gpus]
    dec = [ServeProcess("decode", model_args, env=env(g)) for g in (gpus if layout == "replicas" else ("1",))]
    procs += pre + dec
    start_all(pre + dec, limit)
    addrs = lambda ps: ",".join(p.address for p in ps)  # noqa: E731
    router = ServeProcess("router", [*router_args, "--prefill-workers", addrs(pre), "--decode-workers",
                                     addrs(dec), "--build-on", BUILD_ON.get(layout, "decode")], env=env(""))  # fmt: skip
    procs.append(router)
    start_all([router], min(limit, 120.0))
    return router.address


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default="all-in-one", help="comma list of " + ", ".join(LAYOUT_GPUS))
    ap.add_argument("--concurrency", default=None, help="comma list; default 1,4,16,64 (smoke 1,4)")
    ap.add_argument("--context-tokens", default=None, help="comma list; default 16384,32768 (smoke 2048)")
    ap.add_argument("--gen-length", type=int, default=None, help="= steps; default 32 (smoke 8)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random model, 1 thread per process")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default="serving", help="output file stem (default serving)")
    ap.add_argument("--budget-s", type=float, default=None, help="default 3000 (smoke 120); skips cells")
    ap.add_argument(
        "--serve-flags", default="", help="extra flags for every `pdllm serve`, e.g. --cuda-graph"
    )
    ap.add_argument(
        "--ckpt-dir", type=Path, default=None, help="default: $TMPDIR/pdllm_serving/<model>-<dtype>"
    )
    ap.add_argument("--decode-round-json", type=Path, default=None, help="decode_rounds.py's JSON")
    ap.add_argument(
        "--share-gpu",
        action="store_true",
        help="with one GPU, run 2-GPU layouts with every process on GPU 0 (meta.shared_gpu; correctness, "
        "and the handoff over CUDA IPC, not a two-GPU measurement)",
    )
    ap.add_argument("--warm-burst", type=int, default=None, help="warm-up streams per cell (default: its c)")
    ap.add_argument("--workloads", default="unique",
                    help="comma list: unique (every request its own document), reuse (--documents documents, "
                    "requests drawn Zipf(--zipf) over them, each with its own question)")  # fmt: skip
    ap.add_argument(
        "--documents", type=int, default=None, help="reuse: distinct documents (default 64; smoke 6)"
    )
    ap.add_argument("--zipf", type=float, default=1.0, help="reuse: Zipf exponent over the documents' ranks")
    ap.add_argument("--reuse-requests", type=int, default=None,
                    help="reuse: measured requests per cell (default max(4 c, 32); smoke max(2 c, 8))")  # fmt: skip
    ap.add_argument(
        "--single-repeats",
        type=int,
        default=0,
        help="service overhead: N single requests in process, then served by the all-in-one (0: off)",
    )
    args = ap.parse_args(argv)
    smoke = args.smoke
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    if unknown := [x for x in layouts if x not in LAYOUT_GPUS]:
        ap.error(f"unknown layouts {unknown}; choose from {list(LAYOUT_GPUS)}")
    if args.single_repeats and "all-in-one" not in layouts:
        ap.error("--single-repeats compares the in-process engine with the all-in-one layout: add it")
    concs = [int(x) for x in (args.concurrency or ("1,4" if smoke else "1,4,16,64")).split(",")]
    workloads = [x.strip() for x in args.workloads.split(",") if x.strip()]
    if unknown := [x for x in workloads if x not in WORKLOADS]:
        ap.error(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
    reuse_n = lambda c: args.reuse_requests or (max(2 * c, 8) if smoke else max(4 * c, 32))  # noqa: E731
    ctxs = [int(x) for x in (args.context_tokens or ("2048" if smoke else "16384,32768")).split(",")]
    gen = args.gen_length or (8 if smoke else 32)
    clock = Clock(args.budget_s or (120.0 if smoke else 3000.0))
    serve_flags = shlex.split(args.serve_flags)
    if not smoke and not torch.cuda.is_available():
        ap.error("no GPU visible: use --smoke for the CPU run")
    device, dtype = ("cpu", "float32") if smoke else ("cuda", "bfloat16")
    gpus = 0 if smoke else torch.cuda.device_count()
    if smoke:  # one thread per process: OpenMP threads of several processes on few cores spin each other
        torch.set_num_threads(1)
        env = lambda g: {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # noqa: E731
    else:
        one = args.share_gpu and gpus < 2
        env = lambda g: {"CUDA_VISIBLE_DEVICES": "0" if one and g else g}  # noqa: E731
    mcfg = smoke_config() if smoke else dream7b()
    engine = {"chunk_size": 256, "top_k": 3} if smoke else {"chunk_size": 1024, "top_k": 4}
    ckpt = args.ckpt_dir or Path(tempfile.gettempdir()) / "pdllm_serving" / f"{mcfg.model_id}-{dtype}"
    decode_round = (
        json.loads(args.decode_round_json.read_text())["decode_round"] if args.decode_round_json else []
    )
    meta = {"smoke": smoke, "gpus_visible": gpus, "torch": torch.__version__, "dtype": dtype, "layouts": layouts,
            "concurrency": concs, "context_tokens": ctxs, "gen_length": gen, "steps": gen, "engine": engine,
            "model": mcfg.to_hf_dict(), "serve_flags": serve_flags, "budget_s": clock.budget_s,
            "warm_burst": args.warm_burst if args.warm_burst is not None else "concurrency of each cell",
            "requests_per_cell": f"max(concurrency, {MIN_REQUESTS}), at most concurrency in flight",
            "replicas_note": "2x(--role prefill + --role decode), pair i on GPU i, one router: --role all "
                             "does not expose its internal workers' addresses",
            "skipped": [], "errors": [], "cells": [], "documents_tokens": {}, "workloads": workloads,
            "reuse": {"documents": args.documents or (6 if smoke else 64), "zipf": args.zipf,
                      "requests": "--reuse-requests" if args.reuse_requests else
                      ("max(2 c, 8)" if smoke else "max(4 c, 32)"),
                      "warm_up": "every document twice, before the first reuse cell"},
            "shared_gpu": bool(args.share_gpu and gpus < 2), "single_repeats": args.single_repeats}  # fmt: skip
    report = {"device": torch.cuda.get_device_name(0) if gpus else "cpu",
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "command": "python benchmarks/serving.py " + shlex.join(sys.argv[1:] if argv is None else argv),
              "rows": [], "ratios": [], "overhead": None, "decode_round": decode_round, "meta": meta}  # fmt: skip

    def save() -> None:
        meta["runtime_s"] = clock.elapsed()
        report["ratios"] = ratios(report["rows"])
        write(args.out, args.name, report)

    meta["checkpoint"] = {
        "dir": str(ckpt),
        **write_checkpoint(mcfg, ckpt, torch.device(device), dtype, engine),
    }
    print(f"checkpoint ready after {clock.elapsed():.0f}s: {meta['checkpoint']}", flush=True)
    tokenizer = load_tokenizer(ckpt)
    warm_n = lambda c: c if args.warm_burst is None else args.warm_burst  # noqa: E731
    per_ctx = 2 + sum(warm_n(c) + max(c, MIN_REQUESTS) for c in concs)
    pools = {ctx: documents(tokenizer, ctx, per_ctx, seed=1000 * i) for i, ctx in enumerate(ctxs)}
    for ctx, pool in pools.items():
        meta["documents_tokens"][str(ctx)] = len(tokenizer.encode(pool[0][0], add_special_tokens=False))
    n_docs = args.documents or (6 if smoke else 64)
    reuse_pools = {
        ctx: documents(tokenizer, ctx, n_docs, seed=500_000 + 1000 * i) if "reuse" in workloads else []
        for i, ctx in enumerate(ctxs)
    }
    # the service-overhead requests: their own documents, at the first context
    single_docs = (
        documents(tokenizer, ctxs[0], 1 + args.single_repeats, seed=99_000) if args.single_repeats else []
    )
    print(
        f"{per_ctx * len(ctxs) + len(single_docs)} documents ready after {clock.elapsed():.0f}s", flush=True
    )
    base = None
    if single_docs:  # before any server: the in-process engine has the device to itself
        base = in_process(ckpt, device, dtype, single_docs[1:], single_docs[0], gen, serve_flags)
        print(f"in-process single: {base['median_s']:.3f}s (model load {base['load_s']:.1f}s)", flush=True)
    reference: dict[tuple[str, int, int], list] = {}  # the all-in-one's answers per (workload, context, c)
    model_args = ["--model", str(ckpt), "--device", device, "--dtype", dtype, "--port", "0", "--metrics-port",
                  "0", *serve_flags]  # fmt: skip
    router_args = ["--model", str(ckpt), "--port", "0", "--metrics-port", "0", *serve_flags]

    def cell(layout: str, need: int, address: str, procs: list, ctx: int, c: int, warm: list, measured: list,
             workload: str, single_s: float, unloaded_ms: float) -> None:  # fmt: skip
        """One cell: the warm-up burst, then the measured requests at most ``c`` in flight; its row."""
        where = {"layout": layout, "workload": workload, "context_tokens": ctx, "concurrency": c}
        est = (len(warm) + len(measured)) * single_s + 2.0
        if not clock.fits(est):
            meta["skipped"].append(
                {**where, "reason": f"budget: estimated {est:.0f}s, {clock.left():.0f}s left"}
            )
            return
        w = burst(address, warm, gen, max(min(len(warm), max(c, 1)), 1), clock) if warm else None
        s0, n0 = decode_steps(procs)
        b = burst(address, measured, gen, c, clock)
        s1, n1 = decode_steps(procs)
        worker_ms = (s1 - s0) / (n1 - n0) * 1e3 if n1 > n0 else float("nan")
        if layout == "all-in-one":
            reference[workload, ctx, c] = [r.get("answer") for r in b["results"]]
        ref = None if layout == "all-in-one" else reference.get((workload, ctx, c))
        row = cell_row(layout, need if gpus else 0, c, ctx, gen, b, unloaded_ms, worker_ms, ref, workload)
        report["rows"].append(row)
        meta["cells"].append({**where, "wall_s": b["wall_s"], "estimate_s": est,
                              "warm_s": w["wall_s"] if w else 0.0, "warm_failed": len(w["errors"]) if w else 0,
                              "cache_hits": sum(r["cache_hits"] for r in b["ok"])})  # fmt: skip
        meta["errors"] += [
            f"{layout}/{workload}/{ctx}/c{c}: {e}" for e in b["errors"] + (w["errors"] if w else [])
        ]
        print(json.dumps(row), flush=True)
        save()

    for layout in layouts:
        need = LAYOUT_GPUS[layout]
        if need > 1 and gpus < need and not args.share_gpu:
            meta["skipped"].append({"layout": layout, "reason": f"needs {need} GPUs, {gpus} visible"})
            continue
        procs: list[ServeProcess] = []
        try:
            t = time.perf_counter()
            address = start_layout(layout, model_args, router_args, env, procs, clock)
            meta.setdefault("start_s", {})[layout] = time.perf_counter() - t
            if layout == "all-in-one" and base is not None:
                wait_routable(address, single_docs[0], gen, clock, min(clock.left(), 300))
                served = single_requests(address, single_docs[1:], gen, clock)
                report["overhead"] = overhead(base, served, ctxs[0])
                print(f"all-in-one single: {served['median_s']:.3f}s, overhead "
                      f"{report['overhead']['service_overhead']:+.1%}", flush=True)  # fmt: skip
                save()
            for ctx in ctxs:
                docs = iter(pools[ctx])
                single_s = wait_routable(address, next(docs), gen, clock, min(clock.left(), 300))
                alone = stream_one(address, next(docs), gen, max(clock.left(), 5.0))
                if not alone["ok"]:
                    raise RuntimeError(f"single request failed: {alone['error']}")
                single_s = min(single_s, alone["end"] - alone["start"])
                unloaded_ms = pct(alone["gaps_s"], 0.5) * 1e3
                print(f"{layout} ctx {ctx}: alone {single_s:.2f}s, step {unloaded_ms:.1f} ms", flush=True)
                for c in concs if "unique" in workloads else []:
                    warm = [next(docs) for _ in range(warm_n(c))]
                    measured = [next(docs) for _ in range(max(c, MIN_REQUESTS))]
                    cell(
                        layout, need, address, procs, ctx, c, warm, measured, "unique", single_s, unloaded_ms
                    )
                if "reuse" in workloads:
                    for i, c in enumerate(concs):
                        measured = reuse_requests(reuse_pools[ctx], reuse_n(c), args.zipf, seed=7 + c)
                        # twice: under the default write policy (second-sight) a document's first request stores
                        # its top-K chunks, the second one the rest
                        warm = reuse_pools[ctx] * 2 if i == 0 else []
                        cell(
                            layout,
                            need,
                            address,
                            procs,
                            ctx,
                            c,
                            warm,
                            measured,
                            "reuse",
                            single_s,
                            unloaded_ms,
                        )
        except Exception as exc:  # a layout that fails to start or answer is reported, the others still run
            meta["errors"].append(f"{layout}: {type(exc).__name__}: {exc}"[:2000])
            print(f"{layout} failed: {exc}", flush=True)
        finally:
            for p in procs:
                p.kill()
        save()
    save()
    print((args.out / f"{args.name}.md").read_text(), flush=True)
    return 0


def overhead(base: dict, served: dict, context: int) -> dict:
    """The single-request service overhead: served (``serve --role all``) against the in-process engine."""
    value = served["median_s"] / base["median_s"] - 1.0
    strip = lambda d: {k: v for k, v in d.items() if k != "answers"}  # noqa: E731
    return {"context_tokens": context, "requests": len(base["seconds"]), "in_process": strip(base),
            "served": strip(served), "service_overhead": value, "target_max": TARGET_OVERHEAD,
            "met": value <= TARGET_OVERHEAD, "answers_equal_in_process": served["answers"] == base["answers"]}  # fmt: skip


def ratios(rows: list[dict]) -> list[dict]:
    """Each layout's requests/s over the all-in-one's at the same context and concurrency (same run)."""

    def key(r: dict) -> tuple:
        return r.get("workload", "unique"), r["context_tokens"], r["concurrency"]

    alone = {key(r): r for r in rows if r["layout"] == "all-in-one"}
    out = []
    for r in rows:
        base = alone.get(key(r))
        if r["layout"] == "all-in-one" or base is None or not base["requests_per_s"]:
            continue
        value = r["requests_per_s"] / base["requests_per_s"]
        answered = r["failed"] == 0 and base["failed"] == 0
        split = r["layout"].startswith("1p1d")
        out.append({"layout": r["layout"], "workload": key(r)[0], "context_tokens": r["context_tokens"],
                    "concurrency": r["concurrency"],
                    "vs_all_in_one": value, "target_min": TARGET_SPLIT_RATIO if split else None,
                    "met": (answered and value >= TARGET_SPLIT_RATIO) if split else None,
                    "every_request_answered": answered})  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------- report
def _f(value: object) -> str:
    return format(value, ".4g") if isinstance(value, float) else str(value)


def write(out: Path, name: str, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    meta = report["meta"]
    label = "CPU SMOKE (tiny random model; not a GPU result)" if meta["smoke"] else report["device"]
    lines = [f"# Serving concurrency sweep — {label}, {report['date']}", "", f"`{report['command']}`", "",
             f"Model {meta['model'].get('hidden_size')}-hidden x {meta['model'].get('num_hidden_layers')} layers, "
             f"random {meta['dtype']} weights; C={meta['engine']['chunk_size']}, K={meta['engine']['top_k']}; "
             f"gen {meta['gen_length']} ({meta['steps']} steps); serve flags: {' '.join(meta['serve_flags']) or 'none'}; "
             f"warm-up burst: {meta['warm_burst']}; requests per cell: {meta['requests_per_cell']}. GPUs visible: "
             f"{meta['gpus_visible']}. Runtime {meta.get('runtime_s', 0):.0f} s of a {meta['budget_s']:.0f} s budget.",
             "", "| " + " | ".join(ROW_KEYS) + " |", "|" + "---|" * len(ROW_KEYS)]  # fmt: skip
    lines += [
        "| " + " | ".join(_f(r.get(k, ROW_DEFAULTS.get(k))) for k in ROW_KEYS) + " |" for r in report["rows"]
    ]
    notes: dict[str, list[str]] = {}  # rows merged from other runs say how they differ (e.g. a shared GPU)
    for r in report["rows"]:
        if r.get("note"):
            notes.setdefault(r["note"], []).append(
                f"{r['layout']} x{r['concurrency']} @ {r['context_tokens']}"
            )
    lines += [""] * bool(notes) + [f"Rows {', '.join(rows)}: {note}" for note, rows in notes.items()]
    lines += ratio_lines(report, meta)
    if report.get("handoff"):  # kv_handoff.py's list: one decode KV moved from a prefill to a decode worker
        keys = list(report["handoff"][0])
        lines += ["", f"KV handoff ({meta.get('handoff', {}).get('note', 'kv_handoff.py')}):", "",
                  "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]  # fmt: skip
        lines += ["| " + " | ".join(_f(h[k]) for k in keys) + " |" for h in report["handoff"]]
    if report["decode_round"]:
        keys = list(dict.fromkeys(k for r in report["decode_round"] for k in r))
        lines += ["", "Batched decode rounds (decode_rounds.py):", "", "| " + " | ".join(keys) + " |",
                  "|" + "---|" * len(keys)]  # fmt: skip
        lines += ["| " + " | ".join(_f(r.get(k, "")) for k in keys) + " |" for r in report["decode_round"]]
    for part in ("skipped", "errors"):
        if meta[part]:
            lines += ["", f"{part.capitalize()}:", ""] + [f"- {json.dumps(x) if isinstance(x, dict) else x}"
                                                           for x in meta[part][:20]]  # fmt: skip
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    plot(out / f"{name}.png", report)


def ratio_lines(report: dict, meta: dict) -> list[str]:
    """The layouts against the all-in-one, and the single-request service overhead (when measured)."""
    lines: list[str] = []
    if report.get("ratios"):
        where = " (every process on one GPU: not the two-GPU claim)" if meta.get("shared_gpu") else ""
        lines += ["", f"Requests/s against the all-in-one at the same context and concurrency, same run{where}:", "",
                  "| layout | workload | context | concurrency | vs all-in-one | target | met | answers equal all-in-one |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        rows = {(r["layout"], r.get("workload", "unique"), r["context_tokens"], r["concurrency"]): r
                for r in report["rows"]}  # fmt: skip
        for x in report["ratios"]:
            row = rows.get(
                (x["layout"], x.get("workload", "unique"), x["context_tokens"], x["concurrency"]), {}
            )
            target = f">= {x['target_min']}x" if x["target_min"] else "—"
            lines.append(f"| {x['layout']} | {x.get('workload', 'unique')} | {x['context_tokens']} | {x['concurrency']} "
                         f"| {x['vs_all_in_one']:.2f}x "
                         f"| {target} | {_f(x['met'])} | {row.get('answers_equal_all_in_one') or '—'} |")  # fmt: skip
    o = report.get("overhead")
    if o:
        lines += ["", f"Single-request service overhead ({o['requests']} requests of {o['context_tokens']} tokens, "
                  "unary, one at a time; the in-process engine first, before any server):", "",
                  "| in-process median s | served (--role all) median s | overhead | target | met | answers equal |",
                  "|---|---|---|---|---|---|",
                  f"| {o['in_process']['median_s']:.3f} | {o['served']['median_s']:.3f} | {o['service_overhead']:+.1%} "
                  f"| <= {o['target_max']:.0%} | {o['met']} | {o['answers_equal_in_process']} |"]  # fmt: skip
    return lines


def plot(path: Path, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    series: dict[tuple[str, int], list[dict]] = {}
    for r in report["rows"]:
        series.setdefault((r["layout"], r["context_tokens"]), []).append(r)
    for (layout, ctx), rows in series.items():
        rows = sorted(rows, key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rows]
        for ax, key in zip(axes, ("requests_per_s", "step_p99_ms"), strict=True):
            shared = " (both on 1 GPU)" if rows[0].get("shared_gpu") else ""
            ax.plot(xs, [r[key] for r in rows], marker="o", label=f"{layout}, {ctx} tok{shared}")
    for ax, title in zip(axes, ("requests / s", "step gap p99 (ms)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    if series:
        axes[0].legend(fontsize=8)
    fig.suptitle(f"pdllm serving sweep — {report['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
