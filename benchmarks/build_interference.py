"""Decode-KV builds against running decode rounds: whole builds on their own CUDA stream vs builds in layer
pieces between rounds, in one process, on one workload.

    python benchmarks/build_interference.py --out benchmarks/results          # GPU: Dream-7B shapes, bf16
    python benchmarks/build_interference.py --smoke --out /tmp/interference    # CPU: tiny random model

Workload (open loop): request i arrives at i / ``--rate`` seconds; each has K chunks of C random tokens and
a Q-token question, and generates G tokens in G steps after a full-mask build (one forward over
K * C + Q + G tokens); at most ``--active`` decode at once. ``--warmup`` requests run first (CUDA-graph
captures of new buckets), then ``--requests`` are measured. The decode worker's own scheduler runs it
(``DecodeScheduler``, CUDA-graphed rounds), driven with ``run_once`` on this thread. Modes:

- ``stream``: each build runs whole on the build stream while rounds run on a high-priority stream
  (``build_pieces=0``, the default of ``pdllm serve``);
- ``pieces-N``: builds run on the round stream in pieces of N layers, one piece per scheduler iteration.

Per mode: request latency (arrival to final result) p50 / p99, the wall time of scheduler iterations that
ran a round (what a streaming client sees between steps) p50 / p99 / max, and build latency (launch to
joining the rounds) p50 / max. The first mode is run again at the end: the two runs bound the run-to-run noise.
Writes ``build_interference.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.shapes import build_model, dream7b, sync, tiny  # noqa: E402
from pdllm.decode_service.kv_pool import DecodeKVPool, KVPoolConfig  # noqa: E402
from pdllm.decode_service.request import DecodeRequest, Final, StaticDecode  # noqa: E402
from pdllm.decode_service.round_graphs import GraphedRoundForward  # noqa: E402
from pdllm.decode_service.scheduler import DecodeScheduler, SchedulerConfig  # noqa: E402
from pdllm.decode_service.worker import DecodeWorker  # noqa: E402
from pdllm.shared.config import EngineConfig  # noqa: E402
from pdllm.shared.generation.sampler import GenerationConfig  # noqa: E402
from pdllm.shared.layout import Request, decode_layout  # noqa: E402
from pdllm.shared.stepwise import drain  # noqa: E402


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


class Workload:
    """Random requests and the decode worker that builds them."""

    def __init__(self, model, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
        self.args = args
        self.cfg = EngineConfig(chunk_size=args.chunk, top_k=args.top_k)
        self.gen = GenerationConfig(gen_length=args.gen, steps=args.gen)
        self.worker = DecodeWorker(model, self.cfg)
        vocab = model.config.vocab_size - 8  # clear of the special ids at the top of the vocabulary
        g = torch.Generator().manual_seed(0)
        rand = lambda n: torch.randint(10, vocab, (n,), generator=g).tolist()  # noqa: E731
        self.requests = [
            Request(
                instruction=[], chunks=[rand(args.chunk) for _ in range(args.top_k)], query=rand(args.query)
            )
            for _ in range(8)
        ]

    def job(self, i: int) -> DecodeRequest:
        req = self.requests[i % len(self.requests)]
        layout = decode_layout(req, list(range(len(req.chunks))), self.gen.gen_length)

        def steps(layers: int | None):  # type: ignore[no-untyped-def]
            static = yield from self.worker.build_steps(req, layout, self.cfg, (), layers)
            return StaticDecode(req.query, static, self.gen)

        kv = layout.static_len
        return DecodeRequest(
            f"r{i}", lambda: drain(steps(None)), threading.Event(), False, kv, start_steps=steps
        )


def run_mode(sched: DecodeScheduler, load: Workload, device: torch.device) -> dict:
    """Open loop: request i arrives at i / rate seconds; stats of the requests after the warm-up ones."""
    args = load.args
    warm, total = args.warmup, args.warmup + args.requests
    live: list[DecodeRequest] = []
    arrived: dict[str, float] = {}
    iterations: list[float] = []
    builds: list[float] = []
    latencies: list[float] = []
    next_i = finished = 0
    sync(device)
    t0 = time.perf_counter()
    while finished < total:
        now = time.perf_counter()
        while next_i < total and now >= t0 + next_i / args.rate:
            job = load.job(next_i)
            arrived[job.request_id] = now
            live.append(sched.submit(job))
            next_i += 1
        if not live:
            time.sleep(max(0.0, t0 + next_i / args.rate - now))
            continue
        before = sched.rounds
        sched.run_once()
        dt = time.perf_counter() - now
        if next_i > warm and sched.rounds > before:
            iterations.append(dt * 1e3)
        for job in list(live):
            while not job.events.empty():
                event = job.events.get()
                if isinstance(event, BaseException):
                    raise event
                if isinstance(event, Final):
                    live.remove(job)
                    finished += 1
                    if int(job.request_id[1:]) >= warm:
                        builds.append(event.build_s * 1e3)
                        latencies.append(time.perf_counter() - arrived[job.request_id])
    sync(device)
    return {
        "requests": args.requests,
        "rate_per_s": args.rate,
        "latency_p50_s": statistics.median(latencies),
        "latency_p99_s": pct(latencies, 0.99),
        "round_iter_p50_ms": statistics.median(iterations),
        "round_iter_p99_ms": pct(iterations, 0.99),
        "round_iter_max_ms": max(iterations),
        "build_p50_ms": statistics.median(builds),
        "build_max_ms": max(builds),
        "rounds": len(iterations),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--active", type=int, default=None, help="requests decoding at once (16; smoke 4)")
    ap.add_argument("--requests", type=int, default=None, help="measured requests per mode (64; smoke 8)")
    ap.add_argument(
        "--warmup", type=int, default=None, help="requests before the measured ones (16; smoke 2)"
    )
    ap.add_argument("--rate", type=float, default=None, help="arrivals per second (6; smoke 40)")
    ap.add_argument("--chunk", type=int, default=None, help="C (1024; smoke 32)")
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--query", type=int, default=24)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument(
        "--modes", default=None, help="comma list (stream,pieces-4,pieces-14; smoke stream,pieces-1)"
    )
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if gpu else "cpu")
    args.active = args.active or (16 if gpu else 4)
    args.requests = args.requests or (64 if gpu else 8)
    args.warmup = args.warmup if args.warmup is not None else (16 if gpu else 2)
    args.rate = args.rate or (6.0 if gpu else 40.0)
    args.chunk = args.chunk or (1024 if gpu else 32)
    if not gpu:
        args.gen = min(args.gen, 8)
    modes = (args.modes or ("stream,pieces-4,pieces-14" if gpu else "stream,pieces-1")).split(",")
    modes.append(modes[0])
    model = build_model(dream7b() if gpu else tiny(), device, torch.bfloat16 if gpu else torch.float32)
    load = Workload(model, args)
    c = model.config
    per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * next(model.parameters()).element_size()
    tokens = args.top_k * (args.chunk + 1) + 64
    pool = DecodeKVPool.for_model(
        model, KVPoolConfig((args.active + 4) * tokens * per_token, 64 if gpu else 16)
    )
    forward = GraphedRoundForward(model, pool, "triton" if gpu else "torch", capture=gpu)
    rows = []
    for n, mode in enumerate(modes):
        pieces = 0 if mode == "stream" else int(mode.split("-")[1])
        sched = DecodeScheduler(
            model, pool, forward, SchedulerConfig(args.active, build_pieces=pieces), start_thread=False
        )
        row = {"mode": mode, "repeat": n == len(modes) - 1, **run_mode(sched, load, device)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        sched.close()
    report = {
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python benchmarks/build_interference.py "
        + shlex.join(sys.argv[1:] if argv is None else argv),
        "workload": {
            k: getattr(args, k)
            for k in ("active", "rate", "warmup", "requests", "chunk", "top_k", "query", "gen")
        },
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "build_interference.json").write_text(json.dumps(report, indent=2) + "\n")
    keys = ("latency_p50_s", "latency_p99_s", "round_iter_p50_ms", "round_iter_p99_ms", "round_iter_max_ms",
            "build_p50_ms", "build_max_ms")  # fmt: skip
    lines = [f"# Builds vs decode rounds — {report['device']}, {report['date']}", "", f"`{report['command']}`", "",
             f"Workload: {report['workload']} (open loop, {'Dream-7B shapes, random bf16' if gpu else 'tiny fp32'}); "
             "round_iter = wall time of a scheduler iteration that ran a round; the last row repeats the first mode.",
             "", "| mode | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]  # fmt: skip
    for r in rows:
        name = r["mode"] + (" (repeat)" if r["repeat"] else "")
        lines.append(f"| {name} | " + " | ".join(f"{r[k]:.3g}" for k in keys) + " |")
    (args.out / "build_interference.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
