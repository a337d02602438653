"""Serving benchmark: requests/s, TTFT and step gaps of real `pdllm serve` layouts under load, and the
service's overhead over the in-process engine.

    # GPU (Dream-7B shapes, random bf16 weights):
    python benchmarks/serving.py --out benchmarks/results --serve-flags=--cuda-graph
    python benchmarks/serving.py --layouts all-in-one,replicas,1p1d-build-on-decode \\
        --decode-round-json benchmarks/results/decode_rounds.json --out benchmarks/results
    # all-in-one vs split prefill/decode processes and the single-request service overhead, one call:
    python benchmarks/serving.py --layouts all-in-one,1p1d-build-on-decode --share-gpu --context-tokens 16384 \\
        --concurrency 16 --warm-burst 2 --single-repeats 3 --out $OUT
    # four GPUs (nvidia-h100-x4 / nvidia-h200-x4): one-GPU baseline, 4 replica pairs, the simulator's 3:1 and
    # an even split, 64 x 16K (the four-GPU targets: best >= 3.6x the all-in-one, the best split within 10%
    # of replicas4 with step p99 <= 2x unloaded, sim_req_s within 10% of each split row):
    python benchmarks/serving.py --layouts all-in-one,replicas4,3p1d,2p2d --context-tokens 16384 \\
        --concurrency 64 --budget-s 540 --out $OUT --name serving_x4
    # CPU smoke (tiny random model, 1 thread per process; says nothing about GPUs):
    python benchmarks/serving.py --smoke --out /tmp/serving
    python benchmarks/serving.py --smoke --layouts 2p1d --share-gpu --concurrency 4 --out /tmp/serving
    # a run joins the committed report (every run merged, a section each: serving_report.py):
    python -m benchmarks.serving_report --out benchmarks/results benchmarks/results/serving.json NAME=$OUT/<name>.json

Model: Dream-7B shapes (``benchmarks.shapes.dream7b``) with random weights, written once as a checkpoint
(``--ckpt-dir``, default under /tmp; reused when its marker matches) with the shipped tokenizer (ids < 4096 <
the model's vocabulary) and a ``pdllm.json`` giving the engine settings (C=1024, K=4, fixed chunks; smoke:
C=256, K=3). Prompts: seeded needle documents of ``--context-tokens`` tokens from the evaluation haystack
(``shared/eval/tasks.py``) and their question; every request has its own document, so no chunk KV is shared
within a server.

Layouts (``--layouts``; processes started once per layout, reused for all its cells, killed at the end or on
error; ``parse_layout``):
  all-in-one            one ``serve --role all`` on GPU 0 (gpus=1).
  LAYOUT[FLAGS]         any layout with its own extra ``serve`` flags for its workers, compared in the same
                        run, e.g. ``all-in-one[--fused-prefill]`` or ``all-in-one[--kv-gpu-bytes 24G]``.
  replicasN             ``--role all`` keeps its prefill/decode workers on private loopback ports that it
                        never prints, so a router cannot reach them: N replicas are N ``--role prefill`` + N
                        ``--role decode`` processes (prefill_i and decode_i share GPU i) behind one ``--role
                        router`` (gpus=N). ``replicas`` is replicas2 (the name of the committed two-GPU rows).
  NpMd                  router + N ``--role prefill`` workers on GPUs 0..N-1 + M ``--role decode`` workers on
                        GPUs N..N+M-1 (gpus=N+M; e.g. 3p1d: prefill on 0,1,2, decode on 3; ``assign_gpus``).
                        The decode KV is built where the suffix says (the router's ``--build-on``):
    NpMd, NpMd-build-on-decode   the prefill workers send chunk handles, the decode worker builds their KV;
    NpMd-build-on-prefill        the prefill worker builds the decode KV and hands it off (NCCL between GPUs);
    NpMd-auto                    the router picks the side per request.
  (1p1d-build-on-decode, 1p1d-build-on-prefill and 1p1d-auto are the committed two-GPU names.)
A layout that needs more GPUs than are visible is skipped (meta.skipped), unless ``--share-gpu`` puts every
process of it on GPU 0 (on CPU: every process on the CPU; meta.shared_gpu lists those layouts). A row's
``gpus`` is the number of distinct GPUs its processes ran on (1 when squeezed onto GPU 0, 0 on the CPU);
meta.placement gives each layout's CUDA_VISIBLE_DEVICES per worker.

Router simulator (``sim_req_s``, JSON per row, and a table in the Markdown): ``router_sim.py`` with the
committed per-request costs ``prefill_decode_ratio.py`` reads (one request alone on an H100), the cell's
requests with at most c in flight, steps = gen length. Only for NpMd rows built on one side, at contexts
those files measured (16K, 32K); None for the all-in-one, replicasN, -auto and other contexts (the
simulator does not model prefill and decode sharing a GPU). meta.simulator.recommended: the analytic best
NpMd for each GPU count the run's split layouts use (``prefill_decode_ratio.capacities``; the 8-GPU
recommendation of prefill_decode_ratio.py, for this run's GPUs).

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
batched bf16 rounds a request's logits depend on its round-mates, so random weights may flip tokens),
``shared_gpu`` (the layout squeezed onto GPU 0 by ``--share-gpu``) and ``sim_req_s`` (above).
``ratios``: each layout's requests/s over the all-in-one's at the same context and concurrency, same run
(target >= 1.7x for the 1p1d layouts, a two-GPU claim; the four-GPU targets are read from the
rows: the best layout >= 3.6x, the best NpMd within 10% of replicas4). ``ratios``, ``targets_x4`` and the
report files (``write``) are ``serving_report.py``'s.

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
import os
import random
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
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

LAYOUT_GPUS = {  # the named layouts (any NpMd[-build-on-SIDE|-auto] and replicasN parse too: parse_layout)
    "all-in-one": 1,
    "replicas": 2,
    "1p1d-build-on-decode": 2,
    "1p1d-build-on-prefill": 2,
    "1p1d-auto": 2,
}
_SPLIT = re.compile(r"(?P<p>[1-9]\d*)p(?P<d>[1-9]\d*)d(?:-build-on-(?P<on>decode|prefill)|(?P<auto>-auto))?")
_REPLICAS = re.compile(r"replicas(?P<n>[1-9]\d*)?")
_FLAGGED = re.compile(r"(?P<base>[^\[\]]+)\[(?P<flags>[^\[\]]*)\]")
LAYOUT_SYNTAX = ("all-in-one; replicasN (N pairs of prefill + decode workers, pair i on GPU i, one router; "
                 "replicas = replicas2); NpMd (N prefill workers on GPUs 0..N-1, M decode workers on GPUs "
                 "N..N+M-1, one router), optionally -build-on-decode (the default), -build-on-prefill or -auto; "
                 "e.g. 3p1d, 2p2d-build-on-prefill; any of them followed by [serve flags of its workers], e.g. "
                 "all-in-one[--fused-prefill]")  # fmt: skip


@dataclass(frozen=True)
class Layout:
    """A served layout: ``prefill`` + ``decode`` worker processes behind one router (none for the
    all-in-one); ``replicas``: worker pairs sharing a GPU each; ``build_on``: the router's ``--build-on``."""

    name: str
    prefill: int = 0
    decode: int = 0
    build_on: str = "decode"
    replicas: bool = False
    flags: tuple[str, ...] = ()  # its own serve flags

    @property
    def gpus(self) -> int:
        """GPUs the layout is meant for: one per worker, one per replica pair, one for the all-in-one."""
        if not self.prefill:
            return 1
        return self.prefill if self.replicas else self.prefill + self.decode

    @property
    def split(self) -> bool:
        """Prefill and decode on GPUs of their own (the KV or chunk handles cross between them)."""
        return bool(self.prefill) and not self.replicas


def parse_layout(name: str) -> Layout:
    """``all-in-one``, ``replicas``/``replicasN`` or ``NpMd[-build-on-decode|-build-on-prefill|-auto]``;
    ValueError (saying what is accepted) otherwise."""
    name = name.strip()
    if name == "all-in-one":
        return Layout(name)
    if m := _FLAGGED.fullmatch(name):
        base = parse_layout(m["base"])
        return replace(base, name=name, flags=(*base.flags, *shlex.split(m["flags"])))
    if m := _REPLICAS.fullmatch(name):
        n = int(m["n"] or 2)
        return Layout(name, n, n, "decode", True)
    if m := _SPLIT.fullmatch(name):
        return Layout(name, int(m["p"]), int(m["d"]), "auto" if m["auto"] else m["on"] or "decode")
    raise ValueError(f"unknown layout {name!r}: expected {LAYOUT_SYNTAX}")


def assign_gpus(layout: Layout, visible: int, share: bool = False) -> dict[str, list[str]]:
    """CUDA_VISIBLE_DEVICES of each worker: {"all": [...]} for the all-in-one, else {"prefill": [...],
    "decode": [...]}. Prefill worker i on GPU i; decode worker j on GPU P + j (replicas: on GPU j, beside
    prefill worker j). ``share`` with fewer than ``layout.gpus`` visible: every worker on GPU 0 (on the CPU,
    where ``visible`` is 0, the value is not used). ValueError if the layout does not fit and not ``share``."""
    need = layout.gpus
    if visible < need and not share:
        raise ValueError(f"{layout.name} needs {need} GPUs, {visible} visible (--share-gpu puts it on GPU 0)")
    squeeze = visible < need
    gpu = lambda i: "0" if squeeze else str(i)  # noqa: E731
    if not layout.prefill:
        return {"all": [gpu(0)]}
    first_decode = 0 if layout.replicas else layout.prefill
    return {"prefill": [gpu(i) for i in range(layout.prefill)],
            "decode": [gpu(first_decode + j) for j in range(layout.decode)]}  # fmt: skip


def visible_devices(indices: str, parent: str | None = None) -> str:
    """CUDA_VISIBLE_DEVICES for a worker given GPU indices ("0", "1,2" or "" for none) counted among the GPUs
    this process sees: with CUDA_VISIBLE_DEVICES=2,3 set here, worker GPU "1" is device 3."""
    parent = os.environ.get("CUDA_VISIBLE_DEVICES") if parent is None else parent
    ids = [d.strip() for d in parent.split(",") if d.strip()] if parent else []
    if not ids or not indices:
        return indices
    return ",".join(ids[int(i)] for i in indices.split(","))


ROW_KEYS = ("layout", "workload", "gpus", "concurrency", "context_tokens", "requests", "failed", "requests_per_s",
            "gen_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "step_p50_ms", "step_p99_ms", "unloaded_step_ms",
            "peak_gib", "hit_rate")  # fmt: skip
ROW_DEFAULTS = {"workload": "unique", "hit_rate": "—"}  # rows merged from runs before these keys existed
# Per-row diagnostics kept in the JSON, not in the table (rows merged from older runs lack them): where
# each request's decode KV came from (``trace.kv_source``) and its median handoff and build seconds; the
# decode workers' own step; request latency; answers against the all-in-one's.
DIAG_KEYS = ("kv_sources", "handoff_s_p50", "build_s_p50", "decode_step_ms_worker", "latency_p50_s",
             "latency_max_s", "answers_equal_all_in_one", "shared_gpu", "sim_req_s")  # fmt: skip
MIN_REQUESTS = 4
WORKLOADS = ("unique", "reuse")
SHIPPED = ROOT / "shared" / "checkpoints" / "pdllm-needle"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
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


# ---------------------------------------------------------------------------------------- simulator
SIM_NOTE = ("router_sim.py driven by the committed per-request costs prefill_decode_ratio.py reads (H100, one "
            "request alone: prefill + scoring, decode-KV build, K=4 handoff over CUDA IPC, the batched round "
            "curve), steps = gen length, closed loop: the cell's requests with at most c in flight, no warm-up. "
            "Only NpMd layouts with the build on one side, at the contexts those files measured; None otherwise "
            "(the all-in-one and replicas share a GPU between prefill and decode, which the simulator does not "
            "model; -auto picks a side per request). The costs are not this run's: a row on another GPU or "
            "after engine changes compares against stale costs")  # fmt: skip


def simulator_costs(results: Path | None = None) -> tuple[dict, dict]:
    """The simulator's per-context costs (``prefill_decode_ratio.load_inputs`` over the committed results)
    and where they came from; ({}, {"error": ...}) when the files are missing."""
    from benchmarks.prefill_decode_ratio import RESULTS, load_inputs

    try:
        costs, sources = load_inputs(results or RESULTS)
    except (OSError, KeyError, IndexError, ValueError) as exc:
        return {}, {"note": SIM_NOTE, "error": f"{type(exc).__name__}: {exc}"[:300]}
    return costs, {"note": SIM_NOTE, "contexts": sorted(costs), "inputs": sources}


def recommended_splits(costs: dict, gpus: int) -> dict[str, dict[str, str]]:
    """Per context and build side, the NpMd with N + M = ``gpus`` of the most analytic capacity
    (``prefill_decode_ratio.capacities``: min(N x prefill req/s per GPU, M x decode req/s per GPU)), the
    recommendation prefill_decode_ratio.py makes for 8 GPUs, for the run's GPU count."""
    from benchmarks.prefill_decode_ratio import capacities

    out: dict[str, dict[str, str]] = {}
    for ctx, c in sorted(costs.items()):
        for side in ("decode", "prefill"):
            mu_p, mu_d, _ = capacities(c, side)
            p = max(range(1, gpus), key=lambda p: (min(p * mu_p, (gpus - p) * mu_d), gpus - p))
            out.setdefault(str(ctx), {})[side] = f"{p}p{gpus - p}d-build-on-{side}"
    return out


def simulated_req_s(layout: Layout, ctx: int, conc: int, requests: int, gen: int, costs: dict,
                    max_active: int = 64) -> float | None:  # fmt: skip
    """The router simulator's requests/s for ``requests`` streams, at most ``conc`` in flight, on ``layout``
    (one GPU per worker); None where it has nothing to say (see SIM_NOTE)."""
    from benchmarks.router_sim import SimConfig, simulate

    c = costs.get(ctx)
    if c is None or not layout.split or layout.build_on not in ("decode", "prefill"):
        return None
    cfg = SimConfig(layout.prefill, layout.decode, c.prefill_s, c.build_s, c.handoff_s, gen, c.rounds,
                    layout.build_on, concurrency=conc, requests=requests, warmup=0, max_active=max_active)  # fmt: skip
    return simulate(cfg)["throughput_req_s"]


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
             workload: str = "unique", shared: bool = False, sim_req_s: float | None = None) -> dict:  # fmt: skip
    """The cell's row; ``reference``: the all-in-one's answers to the same documents (None: not compared);
    ``shared``: the layout squeezed onto one GPU (--share-gpu); ``sim_req_s``: the router simulator's
    requests/s for the layout and cell (None: not simulated, see ``simulated_req_s``)."""
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
            "answers_equal_all_in_one": same, "shared_gpu": shared, "sim_req_s": sim_req_s}  # fmt: skip


def start_layout(
    layout: str | Layout,
    model_args: list[str],
    router_args: list[str],
    env,  # type: ignore[no-untyped-def]
    procs: list,
    clock: Clock,
    placement: dict[str, list[str]] | None = None,
) -> str:
    """Start ``layout``'s processes (appended to ``procs`` first, so the caller kills them); its address.
    ``placement``: ``assign_gpus``'s (default: the layout on its own GPUs); ``env(gpu)``: a process's extra
    environment (``env("")`` for the router)."""
    lay = parse_layout(layout) if isinstance(layout, str) else layout
    gpus = placement or assign_gpus(lay, lay.gpus)
    limit = min(max(clock.left(), 10.0), 600.0)
    if not lay.prefill:
        procs.append(ServeProcess("all", [*model_args, *lay.flags], env=env(gpus["all"][0])))
        start_all(procs[-1:], limit)
        return procs[-1].address
    pre = [ServeProcess("prefill", [*model_args, *lay.flags], env=env(g)) for g in gpus["prefill"]]
    dec = [ServeProcess("decode", [*model_args, *lay.flags], env=env(g)) for g in gpus["decode"]]
    procs += pre + dec
    start_all(pre + dec, limit)
    addrs = lambda ps: ",".join(p.address for p in ps)  # noqa: E731
    router = ServeProcess("router", [*router_args, "--prefill-workers", addrs(pre), "--decode-workers",
                                     addrs(dec), "--build-on", lay.build_on], env=env(""))  # fmt: skip
    procs.append(router)
    start_all([router], min(limit, 120.0))
    return router.address


def main(argv: list[str] | None = None) -> int:
    from benchmarks.serving_report import ratios, targets_x4, write  # the report reads this module's layouts

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default="all-in-one", help="comma list of: " + LAYOUT_SYNTAX)
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
        help="run a layout that needs more GPUs than are visible with every process on GPU 0 (on the CPU "
        "with --smoke) instead of skipping it (meta.shared_gpu lists them; correctness, and the handoff "
        "over CUDA IPC, not a multi-GPU measurement)",
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
    try:
        parsed = {x: parse_layout(x) for x in layouts}
    except ValueError as exc:
        ap.error(str(exc))
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
    else:  # the router gets "": no GPU; worker GPU i is the i-th of this process's CUDA_VISIBLE_DEVICES
        env = lambda g: {"CUDA_VISIBLE_DEVICES": visible_devices(g)}  # noqa: E731
    # a layout wider than the GPUs visible (on the CPU: one) is skipped, or with --share-gpu put on GPU 0
    # (on the CPU: every process on the CPU); placements[x] is None for a skipped layout
    room = max(gpus, 1)
    placements = {x: assign_gpus(lay, room, share=True) if lay.gpus <= room or args.share_gpu else None
                  for x, lay in parsed.items()}  # fmt: skip
    mcfg = smoke_config() if smoke else dream7b()
    engine = {"chunk_size": 256, "top_k": 3} if smoke else {"chunk_size": 1024, "top_k": 4}
    ckpt = args.ckpt_dir or Path(tempfile.gettempdir()) / "pdllm_serving" / f"{mcfg.model_id}-{dtype}"
    decode_round = (
        json.loads(args.decode_round_json.read_text())["decode_round"] if args.decode_round_json else []
    )
    sim_costs, sim_meta = simulator_costs() if any(lay.split for lay in parsed.values()) else ({}, None)
    if sim_meta and sim_costs:  # the analytic best split for each GPU count the run's split layouts use
        sim_meta["recommended"] = {
            str(n): recommended_splits(sim_costs, n)
            for n in sorted({x.gpus for x in parsed.values() if x.split})
        }
    max_active = (
        int(serve_flags[serve_flags.index("--max-active") + 1]) if "--max-active" in serve_flags else 64
    )
    meta = {"smoke": smoke, "gpus_visible": gpus, "torch": torch.__version__, "dtype": dtype, "layouts": layouts,
            "concurrency": concs, "context_tokens": ctxs, "gen_length": gen, "steps": gen, "engine": engine,
            "model": mcfg.to_hf_dict(), "serve_flags": serve_flags, "budget_s": clock.budget_s,
            "warm_burst": args.warm_burst if args.warm_burst is not None else "concurrency of each cell",
            "requests_per_cell": f"max(concurrency, {MIN_REQUESTS}), at most concurrency in flight",
            "replicas_note": "replicasN: N x (--role prefill + --role decode), pair i on GPU i, one router: "
                             "--role all does not expose its internal workers' addresses",
            "placement": ({x: p for x, p in placements.items() if p} if gpus else "every process on the CPU"),
            "skipped": [], "errors": [], "cells": [], "documents_tokens": {}, "workloads": workloads,
            "reuse": {"documents": args.documents or (6 if smoke else 64), "zipf": args.zipf,
                      "requests": "--reuse-requests" if args.reuse_requests else
                      ("max(2 c, 8)" if smoke else "max(4 c, 32)"),
                      "warm_up": "every document twice, before the first reuse cell"},
            "shared_gpu": [x for x, p in placements.items() if p and parsed[x].gpus > room],
            "simulator": sim_meta, "single_repeats": args.single_repeats}  # fmt: skip
    report = {"device": torch.cuda.get_device_name(0) if gpus else "cpu",
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "command": "python benchmarks/serving.py " + shlex.join(sys.argv[1:] if argv is None else argv),
              "rows": [], "ratios": [], "overhead": None, "decode_round": decode_round, "meta": meta}  # fmt: skip

    def save() -> None:
        meta["runtime_s"] = clock.elapsed()
        report["ratios"] = ratios(report["rows"])
        meta["targets_x4"] = targets_x4(report["rows"])
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

    def cell(layout: str, used: int, address: str, procs: list, ctx: int, c: int, warm: list, measured: list,
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
        lay = parsed[layout]
        sim = simulated_req_s(lay, ctx, c, len(measured), gen, sim_costs, max_active)
        row = cell_row(layout, used, c, ctx, gen, b, unloaded_ms, worker_ms, ref, workload,
                       shared=lay.gpus > room, sim_req_s=sim)  # fmt: skip
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
        placement = placements[layout]
        if placement is None:
            meta["skipped"].append({"layout": layout, "reason": f"needs {parsed[layout].gpus} GPUs, {gpus} "
                                    "visible (--share-gpu runs it on GPU 0)"})  # fmt: skip
            continue
        # the row's gpus: distinct GPUs its processes ran on (0: the CPU)
        used = len({g for gs in placement.values() for g in gs}) if gpus else 0
        procs: list[ServeProcess] = []
        try:
            t = time.perf_counter()
            address = start_layout(parsed[layout], model_args, router_args, env, procs, clock, placement)
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
                        layout, used, address, procs, ctx, c, warm, measured, "unique", single_s, unloaded_ms
                    )
                if "reuse" in workloads:
                    for i, c in enumerate(concs):
                        measured = reuse_requests(reuse_pools[ctx], reuse_n(c), args.zipf, seed=7 + c)
                        # twice: under the default write policy (second-sight) a document's first request stores
                        # its top-K chunks, the second one the rest
                        warm = reuse_pools[ctx] * 2 if i == 0 else []
                        cell(
                            layout,
                            used,
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


if __name__ == "__main__":
    raise SystemExit(main())
