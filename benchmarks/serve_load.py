"""Serving under load: all-in-one on one GPU vs prefill and decode as separate processes, same run.

    python benchmarks/serve_load.py --out benchmarks/results              # GPU: Dream-7B shapes, bf16
    python benchmarks/serve_load.py --smoke --out /tmp/serve_load         # CPU: tiny random model, < 90 s

Model: Dream-7B shapes (``benchmarks.shapes.dream7b``) with random weights, written once as a
checkpoint (``--ckpt-dir``, default under /tmp; reused when its marker matches) with the shipped
tokenizer (ids < 4096 < the model's vocabulary) and a ``pdllm.json`` giving the engine settings
(C=1024, K=4, fixed chunks; smoke: C=256, K=3). Prompts: seeded needle documents of ``--context-tokens``
tokens from the evaluation haystack (``shared/eval/tasks.py``) and their question; every request of a
scenario has its own document, so no chunk KV is reused within a server.

Scenarios (real ``pdllm serve`` processes on 127.0.0.1, killed at the end):
  1. in-process engine, single request: ``PrefillingEngine.generate`` with the engine ``pdllm serve``
     builds (same store, same settings), tokenization included; median of ``--single-repeats``.
  2. ``serve --role all``, single unary request, same documents; overhead = (2) / (1) - 1.
  3. ``serve --role all`` under ``--concurrency`` simultaneous streams: throughput (requests/s,
     generated tokens/s = gen_length per finished request / wall), TTFT (send -> first streamed
     event), time per step (median gap between a stream's partial events: one scheduler round, all
     active requests advance one step).
  4. split: router + prefill process + decode process (``CUDA_VISIBLE_DEVICES`` 0 and 1 when two GPUs
     are visible, else both on GPU 0), the same load and documents; also the decode worker's own
     per-request step histogram. Ratio = (4) / (3) throughput.
Each server gets one warm-up request and a warm-up burst of 2 streams (own documents) first. A scenario
is skipped when its estimated time would overrun ``--budget-s``; every wait is bounded by the budget.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import shutil
import statistics
import sys
import tempfile
import threading
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

SHIPPED = ROOT / "shared" / "checkpoints" / "pdllm-needle"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TARGET_SPLIT_RATIO = 1.7
TARGET_OVERHEAD = 0.10
WARM_BURST = 2


def smoke_config() -> ModelConfig:
    """e2e_speedup's tiny shapes with the shipped tokenizer's vocabulary and special ids."""
    return tiny().replace(
        vocab_size=4096, mask_token_id=3, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        model_id="tiny-serve-load",
    )  # fmt: skip


# ---------------------------------------------------------------------------------------- checkpoint
def write_checkpoint(mcfg: ModelConfig, out: Path, device: torch.device, dtype: str, engine: dict) -> dict:
    """Random-weight checkpoint + shipped tokenizer + pdllm.json; reused when the marker matches."""
    marker = out / "serve_load.json"
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


def documents(tokenizer, tokens: int, count: int, seed: int = 0) -> list[tuple[str, str]]:
    """``count`` distinct seeded needle documents of ~``tokens`` tokens with their questions."""
    from pdllm.shared.eval.tasks import eval_factory

    factory = eval_factory(tokenizer)
    docs = []
    for i in range(count):
        s = factory.make_sample("needle", tokens, round((i * 37 % 100) / 100, 2), seed + i)
        docs.append((s.context, s.question))
    return docs


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


def quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "max": float("nan")}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": statistics.median(ordered), "p90": pick(0.9), "max": ordered[-1]}


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


def single_requests(address: str, docs: list[tuple[str, str]], gen: int, clock: Clock) -> dict:
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


def load(address: str, docs: list[tuple[str, str]], gen: int, clock: Clock) -> dict:
    """All of ``docs`` as simultaneous streams; per request TTFT, step gaps, latency; bounded by the budget."""
    n = len(docs)
    results: list[dict | None] = [None] * n
    barrier = threading.Barrier(n)
    timeout = max(clock.left(), 5.0)

    def one(i: int) -> None:
        context, question = docs[i]
        with PdllmClient(address, timeout_s=timeout) as client:
            try:
                barrier.wait(timeout=30)
                start = time.perf_counter()
                stamps, final = [], None
                for event in client.generate_stream(context, question, gen_length=gen, steps=gen):
                    stamps.append(time.perf_counter())
                    if event.HasField("final"):
                        final = event.final
                if final is None:
                    raise RuntimeError("stream ended without a final message")
                gaps = [b - a for a, b in zip(stamps[:-2], stamps[1:-1], strict=False)]  # partial -> partial
                results[i] = {"ok": True, "start": start, "end": stamps[-1], "ttft_s": stamps[0] - start,
                              "step_s": statistics.median(gaps) if gaps else float("nan"),
                              "partials": len(stamps) - 1, "answer": list(final.token_ids),
                              "server_ttft_s": final.trace.timings.ttft_s}  # fmt: skip
            except Exception as exc:  # every failure is a finding: counted, first ones reported
                results[i] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(clock.left(), 1.0) + 10)
    rows = [r or {"ok": False, "error": "still running at the time budget"} for r in results]
    ok = [r for r in rows if r["ok"]]
    out = {
        "requests": n,
        "ok": len(ok),
        "failed": n - len(ok),
        "errors": [r["error"] for r in rows if not r["ok"]][:5],
    }
    if ok:
        wall = max(r["end"] for r in ok) - min(r["start"] for r in ok)
        out |= {
            "wall_s": wall,
            "requests_per_s": len(ok) / wall,
            "tokens_per_s": len(ok) * gen / wall,
            "ttft_s": quantiles([r["ttft_s"] for r in ok]),
            "server_ttft_s": quantiles([r["server_ttft_s"] for r in ok]),
            "step_ms": {k: v * 1e3 for k, v in quantiles([r["step_s"] for r in ok]).items()},
            "latency_s": quantiles([r["end"] - r["start"] for r in ok]),
            "partials_min": min(r["partials"] for r in ok),
        }
    out["answers"] = [r.get("answer") for r in rows]
    return out


def start_all(procs: list[ServeProcess], timeout_s: float) -> None:
    """Start the processes in parallel (each start blocks until its ready line)."""
    with ThreadPoolExecutor(len(procs)) as pool:
        for f in [pool.submit(p.start, timeout_s) for p in procs]:
            f.result()


def step_metric(decode: ServeProcess) -> tuple[float, float]:
    return decode.metric("pdllm_decode_step_seconds_sum"), decode.metric("pdllm_decode_step_seconds_count")


# ---------------------------------------------------------------------------------------- scenarios
def in_process(ckpt: Path, device: str, dtype: str, docs: list[tuple[str, str]], warm: tuple[str, str],
               gen: int, serve_flags: list[str]) -> dict:  # fmt: skip
    """Scenario 1: the engine ``pdllm serve`` builds, called directly (tokenization included), decoding with
    a CUDA graph on CUDA as the served decode worker's rounds do."""
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


def _engine_run(engine, tokenizer, context: str, question: str, gen: int) -> tuple[float, list[int], dict]:
    sync(engine.device)
    t = time.perf_counter()
    ids = encode_prompt(tokenizer, context, question)
    result, trace = engine.generate(ids.context, ids.query, GenerationConfig(gen_length=gen, steps=gen))
    sync(engine.device)
    return time.perf_counter() - t, result.token_ids, dict(trace.timings)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--smoke", action="store_true", help="CPU, tiny random model, 2K tokens, 4 streams, gen 8"
    )
    ap.add_argument("--device", default=None, help="default: cuda when available (smoke: cpu)")
    ap.add_argument(
        "--dtype", default=None, choices=sorted(DTYPES), help="default: bfloat16 on cuda, else float32"
    )
    ap.add_argument("--context-tokens", type=int, default=None, help="default 16384 (smoke 2048)")
    ap.add_argument("--concurrency", type=int, default=None, help="default 16 (smoke 4)")
    ap.add_argument(
        "--gen-length", type=int, default=None, help="generated tokens = steps; default 32 (smoke 8)"
    )
    ap.add_argument("--single-repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument(
        "--name", default=None, help="output file stem (default serve_load, smoke serve_load_smoke)"
    )
    ap.add_argument(
        "--ckpt-dir", type=Path, default=None, help="default: $TMPDIR/pdllm_serve_load/<model>-<dtype>"
    )
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip scenarios that would overrun")
    ap.add_argument(
        "--cuda-graph", action="store_true", help="every engine as `serve --cuda-graph` builds it"
    )
    args = ap.parse_args(argv)
    serve_flags = ["--cuda-graph"] if args.cuda_graph else []
    clock = Clock(args.budget_s)
    smoke = args.smoke
    device = args.device or ("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    n_ctx = args.context_tokens or (2048 if smoke else 16384)
    conc = args.concurrency or (4 if smoke else 16)
    gen = args.gen_length or (8 if smoke else 32)
    name = args.name or ("serve_load_smoke" if smoke else "serve_load")
    mcfg = smoke_config() if smoke else dream7b()
    engine_settings = {"chunk_size": 256, "top_k": 3} if smoke else {"chunk_size": 1024, "top_k": 4}
    ckpt = args.ckpt_dir or Path(tempfile.gettempdir()) / "pdllm_serve_load" / f"{mcfg.model_id}-{dtype}"
    gpus = torch.cuda.device_count() if device.startswith("cuda") else 0
    split_gpus = ("0", "1") if gpus >= 2 else ("0", "0")
    # CPU: one thread per process (this benchmark and each server); OpenMP threads of several processes
    # competing for a few cores spin against each other and make every number meaningless.
    cpu_threads = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cuda_env = (lambda g: {"CUDA_VISIBLE_DEVICES": g}) if gpus else (lambda g: dict(cpu_threads))
    if device == "cpu":
        torch.set_num_threads(1)
    meta = {
        "device": torch.cuda.get_device_name(0) if gpus else "cpu",
        "gpus_visible": gpus,
        "smoke": smoke,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python benchmarks/serve_load.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "torch": torch.__version__,
        "dtype": dtype,
        "context_tokens": n_ctx,
        "concurrency": conc,
        "gen_length": gen,
        "steps": gen,
        "engine": engine_settings,
        "model": mcfg.to_hf_dict(),
        "cpu_threads_per_process": 1 if device == "cpu" else None,
        "split_placement": {"prefill_gpu": split_gpus[0], "decode_gpu": split_gpus[1]} if gpus else "cpu",
        "budget_s": args.budget_s,
        "serve_flags": serve_flags,
        "skipped": [],
    }
    rows: dict[str, dict] = {}
    ratios: dict[str, dict] = {}

    def save() -> None:
        meta["runtime_s"] = clock.elapsed()
        write(args.out, name, meta, rows, ratios)

    meta["checkpoint"] = {"dir": str(ckpt), **write_checkpoint(mcfg, ckpt, torch.device(device), dtype,
                                                                 engine_settings)}  # fmt: skip
    print(f"checkpoint {ckpt} ready after {clock.elapsed():.0f}s: {meta['checkpoint']}", flush=True)
    tokenizer = load_tokenizer(ckpt)
    r = args.single_repeats
    pool = documents(tokenizer, n_ctx, 1 + r + WARM_BURST + conc)
    warm, singles, burst, loaded_docs = (
        pool[0],
        pool[1 : 1 + r],
        pool[1 + r : 1 + r + WARM_BURST],
        pool[1 + r + WARM_BURST :],
    )
    meta["documents_tokens"] = [len(tokenizer.encode(pool[i][0], add_special_tokens=False)) for i in (0, -1)]
    print(f"{len(pool)} documents ready after {clock.elapsed():.0f}s", flush=True)

    # 1. in-process baseline
    base = in_process(ckpt, device, dtype, singles, warm, gen, serve_flags)
    rows["in_process_single"] = {k: v for k, v in base.items() if k != "answers"}
    print(f"in-process single: {base['median_s']:.3f}s (model load {base['load_s']:.1f}s)", flush=True)
    save()
    start_est = 2.0 * base["load_s"] + 15.0
    single_est = base["median_s"]
    load_est = (WARM_BURST + conc) * single_est + 10.0

    procs: list[ServeProcess] = []
    model_args = [
        "--model",
        str(ckpt),
        "--device",
        device,
        "--dtype",
        dtype,
        "--port",
        "0",
        "--metrics-port",
        "0",
        *serve_flags,
    ]
    try:
        # 2 + 3. all-in-one
        if clock.fits(start_est + (2 + r) * single_est + load_est):
            allp = ServeProcess("all", model_args, env=cuda_env("0"))
            procs.append(allp)
            start_all([allp], min(clock.left(), 300))
            wait_routable(allp.address, warm, gen, clock, 120)
            single = single_requests(allp.address, singles, gen, clock)
            rows["all_single"] = {k: v for k, v in single.items() if k != "answers"}
            rows["all_single"]["answers_equal_in_process"] = single["answers"] == base["answers"]
            ratios["service_overhead"] = {"value": single["median_s"] / base["median_s"] - 1.0,
                                          "target_max": TARGET_OVERHEAD}  # fmt: skip
            ratios["service_overhead"]["met"] = ratios["service_overhead"]["value"] <= TARGET_OVERHEAD
            print(f"all-in-one single: {single['median_s']:.3f}s, overhead "
                  f"{ratios['service_overhead']['value']:+.1%}", flush=True)  # fmt: skip
            save()
            load(allp.address, burst, gen, clock)
            all_load = load(allp.address, loaded_docs, gen, clock)
            rows["all_load"] = {k: v for k, v in all_load.items() if k != "answers"} | {
                "processes": 1,
                "gpus": min(gpus, 1),
            }
            print(f"all-in-one x{conc}: {json.dumps(rows['all_load'])}", flush=True)
            save()
            allp.kill()
            procs.remove(allp)
        else:
            meta["skipped"].append("all-in-one (budget)")
        # 4. split
        if clock.fits(start_est + single_est + load_est):
            prefill = ServeProcess("prefill", model_args, env=cuda_env(split_gpus[0]))
            decode = ServeProcess("decode", model_args, env=cuda_env(split_gpus[1]))
            procs += [prefill, decode]
            start_all([prefill, decode], min(clock.left(), 300))
            router_args = ["--model", str(ckpt), "--port", "0", "--metrics-port", "0",
                           "--prefill-workers", prefill.address, "--decode-workers", decode.address]  # fmt: skip
            router = ServeProcess("router", router_args, env=cuda_env(""))
            procs.append(router)
            start_all([router], min(clock.left(), 120))
            wait_routable(router.address, warm, gen, clock, 120)
            load(router.address, burst, gen, clock)
            s0, c0 = step_metric(decode)
            split_load = load(router.address, loaded_docs, gen, clock)
            s1, c1 = step_metric(decode)
            rows["split_load"] = {k: v for k, v in split_load.items() if k != "answers"} | {
                "processes": 3, "gpus": len(set(split_gpus)) if gpus else 0,
                "decode_step_ms_metric": (s1 - s0) / (c1 - c0) * 1e3 if c1 > c0 else float("nan"),
            }  # fmt: skip
            if "all_load" in rows:
                same = sum(
                    a is not None and a == b
                    for a, b in zip(all_load["answers"], split_load["answers"], strict=True)
                )
                rows["split_load"]["answers_equal_all_in_one"] = f"{same}/{conc}"
                if "requests_per_s" in rows["all_load"] and "requests_per_s" in rows["split_load"]:
                    value = rows["split_load"]["requests_per_s"] / rows["all_load"]["requests_per_s"]
                    answered = rows["all_load"]["failed"] == 0 and rows["split_load"]["failed"] == 0
                    ratios["split_vs_all_throughput"] = {"value": value, "target_min": TARGET_SPLIT_RATIO,
                                                         "met": answered and value >= TARGET_SPLIT_RATIO,
                                                         "every_request_answered": answered}  # fmt: skip
            print(f"split x{conc}: {json.dumps(rows['split_load'])}", flush=True)
        else:
            meta["skipped"].append("split (budget)")
    finally:
        for p in procs:
            p.kill()
        save()
    print((args.out / f"{name}.md").read_text(), flush=True)
    return 0


# ---------------------------------------------------------------------------------------- report
def _f(value: object, spec: str = ".3f") -> str:
    return format(value, spec) if isinstance(value, int | float) else "—"


def write(out: Path, name: str, meta: dict, rows: dict[str, dict], ratios: dict[str, dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows, "ratios": ratios}, indent=1))
    label = "CPU SMOKE (tiny random model; not the GPU result)" if meta["smoke"] else meta["device"]
    lines = [
        f"# Serving under load: all-in-one vs split prefill/decode — {label}, {meta['date']}",
        "",
        f"`{meta['command']}`",
        "",
        f"Model {meta['model'].get('hidden_size')}-hidden x {meta['model'].get('num_hidden_layers')} layers, random "
        f"{meta['dtype']} weights; C={meta['engine']['chunk_size']}, K={meta['engine']['top_k']}; documents of "
        f"{meta['context_tokens']} tokens, {meta['concurrency']} concurrent streams, gen {meta['gen_length']} "
        f"({meta['steps']} steps). GPUs visible: {meta['gpus_visible']}; split placement: {meta['split_placement']}. "
        f"Runtime {meta.get('runtime_s', 0):.0f} s (checkpoint: {'reused' if meta['checkpoint']['reused'] else 'written'} "
        f"in {meta['checkpoint']['seconds']:.0f} s). Serve flags: {' '.join(meta['serve_flags']) or 'none'}.",
        "",
        "| scenario | requests | failed | median s | req/s | gen tok/s | TTFT p50 / p90 s | step ms p50 (stream) "
        "| decode step ms (worker) | latency p50 / max s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, label_row in (("in_process_single", "1. in-process engine, single"),
                           ("all_single", "2. serve --role all, single"),
                           ("all_load", "3. serve --role all, concurrent"),
                           ("split_load", "4. split router+prefill+decode, concurrent")):  # fmt: skip
        r = rows.get(key)
        if r is None:
            lines.append(f"| {label_row} | not run | | | | | | | | |")
        elif "median_s" in r:
            n = len(r["seconds"])
            lines.append(f"| {label_row} | {n} | 0 | {_f(r['median_s'])} | | | | | | |")
        else:
            ttft, lat = r.get("ttft_s", {}), r.get("latency_s", {})
            lines.append(
                f"| {label_row} | {r['requests']} | {r['failed']} | | {_f(r.get('requests_per_s'))} "
                f"| {_f(r.get('tokens_per_s'), '.1f')} | {_f(ttft.get('p50'))} / {_f(ttft.get('p90'))} "
                f"| {_f(r.get('step_ms', {}).get('p50'), '.1f')} | {_f(r.get('decode_step_ms_metric'), '.1f')} "
                f"| {_f(lat.get('p50'))} / {_f(lat.get('max'))} |"
            )
    lines += ["", "| ratio | value | target | met |", "|---|---|---|---|"]
    o, s = ratios.get("service_overhead"), ratios.get("split_vs_all_throughput")
    lines.append(
        f"| service overhead, single request: (2)/(1) - 1 | {o['value']:+.1%} | <= {TARGET_OVERHEAD:.0%} | {o['met']} |"
        if o else f"| service overhead, single request | not measured | <= {TARGET_OVERHEAD:.0%} | |"
    )  # fmt: skip
    lines.append(
        f"| split / all-in-one throughput: (4)/(3) | {s['value']:.2f}x | >= {TARGET_SPLIT_RATIO}x | {s['met']} |"
        if s else f"| split / all-in-one throughput | not measured | >= {TARGET_SPLIT_RATIO}x | |"
    )  # fmt: skip
    notes = []
    if meta["skipped"]:
        notes.append("Skipped: " + ", ".join(meta["skipped"]) + ".")
    for key in ("all_load", "split_load"):
        if rows.get(key, {}).get("errors"):
            notes.append(f"{key} errors: " + "; ".join(rows[key]["errors"]))
    if meta["smoke"]:
        notes.append(
            "CPU smoke: checks that the scenarios run end to end; its ratios say nothing about GPUs."
        )
    lines += [""] + notes if notes else []
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
