"""The CUDA tuner that writes the split-S config table read by :mod:`.split_s_tuning`.

Tuning (CUDA only; times every :func:`candidates` config with CUDA-graph replay, keeps the default unless a
candidate is >= 3% faster, merges the winners into ``--out``, replacing this device's entries it re-tuned)::

    python -m pdllm.kernels.split_s_tuner --out kernels/split_s_tuned.json [--budget-s 420]

``--candidates FILE`` times the configs listed there (a JSON list of config objects, the table's fields,
``maxnreg`` included) instead of :func:`candidates`, the fixed default still first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pdllm.kernels.split_s_reference import SplitSConfig
from pdllm.kernels.split_s_tuning import (
    DEFAULT_TABLE,
    ENTRY_FIELDS,
    TABLE_VERSION,
    ShapeBucket,
    config_from_dict,
    config_to_dict,
    device_name,
    parse_table,
)

Call = Callable[[], list[torch.Tensor]]


def candidates(bucket: ShapeBucket) -> list[SplitSConfig]:
    """The configs the tuner times for ``bucket``, the fixed default first (the one to beat by 3%).

    tests/kernels/interpreter_cases.py runs every (block_m, block_n, fused_merge) of these at pages 16 and 64.
    """
    out = [
        SplitSConfig(),
        SplitSConfig(num_stages=3),
        SplitSConfig(block_n=32),
        SplitSConfig(block_n=128),  # > page 64: the gather path, half the loop trips
        SplitSConfig(block_m=128),  # one warpgroup on 128 rows: half the KV re-reads of 64-row blocks
        SplitSConfig(block_m=128, num_warps=8, programs_per_sm=1.0),
        SplitSConfig(block_m=128, num_warps=8, num_stages=3, programs_per_sm=1.0),
        SplitSConfig(block_m=128, block_n=128, num_warps=8, programs_per_sm=1.0),
        SplitSConfig(block_m=128, block_n=32, num_stages=3),
        SplitSConfig(programs_per_sm=1.0, min_split_tokens=256),  # fewer, longer splits
        SplitSConfig(programs_per_sm=3.0, min_split_tokens=64),  # more, shorter splits
        SplitSConfig(fused_merge=True),
        # won Lq-96 buckets on an H100 (64x32 tiles capped at 128 registers: 4 programs per SM)
        SplitSConfig(block_n=32, programs_per_sm=4.0, maxnreg=128),
        # won batch 1 x 1K keys on an H100 (one stage: 3 programs per SM; 16-bit split partials)
        SplitSConfig(num_stages=1, programs_per_sm=3.0, partials_16bit=True),
    ]
    if bucket.rows <= 32:
        out += [SplitSConfig(block_m=m, num_warps=2, programs_per_sm=4.0) for m in (16, 32)]
    if bucket.page < 64:
        out.append(SplitSConfig(block_n=max(16, bucket.page)))  # the one-page-per-tile fast path
    return out


def load_candidates(path: Path) -> list[SplitSConfig]:
    """The configs listed in ``path`` (a JSON list of config objects), the default prepended if absent."""
    raw = json.loads(path.read_text())
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{path}: need a non-empty JSON list of config objects")
    cfgs = [config_from_dict(d) for d in raw]
    return cfgs if cfgs[0] == SplitSConfig() else [SplitSConfig(), *[c for c in cfgs if c != SplitSConfig()]]


def call_cost(
    batch: int, lq: int, hq: int, hkv: int, d: int, kv_tokens: int, itemsize: int
) -> tuple[float, float]:
    """(FLOPs, bytes) of one call: ``4 * B * Lq * Hq * d * kv_tokens`` FLOPs (local keys left out) and
    the K+V bytes read (paged ``kv_tokens`` plus the ``Lq`` local tokens per request)."""
    return 4.0 * batch * lq * hq * d * kv_tokens, 2.0 * batch * (kv_tokens + lq) * hkv * d * itemsize


def predicted_ms(flops: float, nbytes: float) -> float:
    """A call's time at a nominal 400 TFLOP/s (a Triton attention loop's) or 3 TB/s: for skip rules only."""
    return max(flops / 400e9, nbytes / 3e9)


@dataclass(frozen=True)
class TuneShape:
    batch: int
    lq: int
    kv_tokens: int
    page: int
    hq: int = 28
    hkv: int = 4
    head_dim: int = 128


def _runner(
    shape: TuneShape, dtype: torch.dtype, replicas: int, dev: torch.device
) -> Callable[[SplitSConfig], Call]:
    """``make(cfg)`` -> a function running ``replicas`` calls, each over its own scattered KV copy."""
    from pdllm.kernels.split_s_attention import split_s_attention

    s = shape
    g = torch.Generator(device=dev).manual_seed(0)
    pages = s.batch * -(-s.kv_tokens // s.page)
    q = torch.randn(s.batch * s.lq, s.hq, s.head_dim, device=dev, dtype=dtype, generator=g)
    kv_lens = torch.full((s.batch,), s.kv_tokens, dtype=torch.int32, device=dev)
    offsets = torch.arange(0, s.batch * s.lq + 1, s.lq, dtype=torch.int32, device=dev)
    data = []
    for _ in range(replicas):
        pool = torch.randn(2, pages, s.hkv, s.page, s.head_dim, device=dev, dtype=dtype, generator=g)
        table = torch.randperm(pages, device=dev, generator=g).to(torch.int32).view(s.batch, -1)
        local = torch.randn(2, s.batch * s.lq, s.hkv, s.head_dim, device=dev, dtype=dtype, generator=g)
        data.append((pool, table, local))

    def make(cfg: SplitSConfig) -> Call:
        return lambda: [
            split_s_attention(q, p[0], p[1], t, kv_lens, offsets, loc[0], loc[1], config=cfg,
                              max_q_len=s.lq, max_kv_len=s.kv_tokens)
            for p, t, loc in data
        ]  # fmt: skip

    return make


def graph_time_us(fn: Call, target_s: float = 0.15, max_reps: int = 20) -> float:
    """Median microseconds of one ``fn()`` replayed from a CUDA graph (as the decode step runs it)."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm the allocator off the capture stream, as torch's graph docs ask
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times: list[float] = []
    reps = max_reps
    while len(times) < reps:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
        reps = max(3, min(max_reps, int(target_s * 1e6 / max(times[0], 1.0))))
    return sorted(times)[len(times) // 2]


def tune_bucket(
    shape: TuneShape,
    bucket: ShapeBucket,
    dtype: torch.dtype,
    dev: torch.device | None = None,
    cands: list[SplitSConfig] | None = None,
) -> dict:
    """Time every candidate (``cands``, else :func:`candidates`; the first is the default to beat) on
    ``shape``; returns the table entry (plus ``timings`` for the details file)."""
    dev = dev if dev is not None else torch.device("cuda", torch.cuda.current_device())
    _, nbytes = call_cost(shape.batch, shape.lq, shape.hq, shape.hkv, shape.head_dim, shape.kv_tokens, 2)
    # >= 200 MB per replay, so the KV comes from HBM, not L2 (one copy off CUDA: the interpreter check).
    replicas = max(1, min(16, math.ceil(200e6 / nbytes))) if dev.type == "cuda" else 1
    make = _runner(shape, dtype, replicas, dev)
    want = make(SplitSConfig())()[0].float()
    timings: list[tuple[SplitSConfig, float, str]] = []
    for cfg in cands if cands is not None else candidates(bucket):
        try:
            fn = make(cfg)
            err = float((fn()[0].float() - want).norm() / want.norm())
            if not err < 2e-2:  # a wrong answer (or NaN) can never win
                raise RuntimeError(f"rel. error {err:.2e} vs the default config")
            timings.append((cfg, graph_time_us(fn) / replicas, ""))
        except Exception as e:  # out of shared memory, compile failure: recorded, not fatal
            timings.append((cfg, math.inf, f"{type(e).__name__}: {str(e)[:160]}"))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    default_us = timings[0][1]
    if not math.isfinite(default_us):
        raise RuntimeError(f"the default config failed on {shape}: {timings[0][2]}")
    best_cfg, best_us, _ = min(timings, key=lambda t: t[1])
    if not best_us < 0.97 * default_us:  # not a clear win: keep the default (sweeps are +-2% noisy)
        best_cfg, best_us = timings[0][0], default_us
    return {
        "device": device_name(dev),
        "bucket": dataclasses.asdict(bucket),
        "config": config_to_dict(best_cfg),
        "us": round(best_us, 2),
        "default_us": round(default_us, 2),
        "shape": dataclasses.asdict(shape),
        "timings": [
            [config_to_dict(c), round(us, 2) if math.isfinite(us) else None, e] for c, us, e in timings
        ],
    }


def write_table(path: Path, new: list[dict]) -> None:
    """Merge ``new`` entries into the table at ``path`` (same device + bucket replaced), sorted, validated."""
    old = json.loads(path.read_text()) if path.exists() else {"version": TABLE_VERSION, "entries": []}
    parse_table(old, str(path))  # refuse to merge into (and so overwrite) a malformed table
    fresh = [{k: v for k, v in e.items() if k in ENTRY_FIELDS} for e in new]
    keys = {(e["device"], json.dumps(e["bucket"], sort_keys=True)) for e in fresh}
    kept = [e for e in old["entries"] if (e["device"], json.dumps(e["bucket"], sort_keys=True)) not in keys]
    entries = sorted(kept + fresh, key=lambda e: (e["device"], sorted(e["bucket"].items())))
    out = {"version": TABLE_VERSION, "about": old.get("about", __doc__.splitlines()[0]), "entries": entries}
    parse_table(out, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:

    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    ap = argparse.ArgumentParser(description="Tune split-S configs per shape bucket (CUDA only).")
    ap.add_argument("--out", type=Path, default=DEFAULT_TABLE)
    ap.add_argument("--details", type=Path, default=None, help="also write every candidate's timing here")
    ap.add_argument("--batches", type=ints, default=[1, 4, 16, 64])
    ap.add_argument("--lqs", type=ints, default=[32, 96])
    ap.add_argument("--kv", type=ints, default=[1024, 4096, 8192, 16384, 32768, 65536, 131072])
    ap.add_argument("--pages", type=ints, default=[64])
    ap.add_argument("--hq", type=int, default=28)
    ap.add_argument("--hkv", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--max-call-ms", type=float, default=12.0, help="skip shapes predicted slower than this")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new buckets after this")
    ap.add_argument("--candidates", type=Path, default=None, help="JSON list of configs to time instead")
    a = ap.parse_args(argv)
    cands = load_candidates(a.candidates) if a.candidates is not None else None
    if not torch.cuda.is_available():
        raise SystemExit("the tuner times kernels on a CUDA device; none is available")
    t0, dtype = time.monotonic(), torch.bfloat16
    todo: dict[ShapeBucket, TuneShape] = {}
    for page in a.pages:
        for b in a.batches:
            for lq in a.lqs:
                for kv in a.kv:
                    shape = TuneShape(b, lq, kv, page, a.hq, a.hkv, a.head_dim)
                    if predicted_ms(*call_cost(b, lq, a.hq, a.hkv, a.head_dim, kv, 2)) > a.max_call_ms:
                        print(f"skip {shape}: predicted > {a.max_call_ms} ms per call", flush=True)
                        continue
                    bucket = ShapeBucket.of(lq * (a.hq // a.hkv), kv + lq, b * a.hkv, a.head_dim, page, dtype)
                    todo.setdefault(bucket, shape)
    done: list[dict] = []
    # Cheapest first, so a budget cut drops the largest shapes.
    for bucket, shape in sorted(todo.items(), key=lambda it: it[1].batch * it[1].lq * it[1].kv_tokens):
        if time.monotonic() - t0 > a.budget_s:
            print(f"budget spent: {bucket} left to the heuristic", flush=True)
            continue
        try:
            entry = tune_bucket(shape, bucket, dtype, cands=cands)
        except Exception as e:  # e.g. out of memory: this bucket stays with the heuristic
            print(f"{bucket}: not tuned ({type(e).__name__}: {str(e)[:200]})", flush=True)
            continue
        done.append(entry)
        print(f"{bucket}: {entry['config']} {entry['us']} us (default {entry['default_us']} us)", flush=True)
        write_table(a.out, done)  # after every bucket: a run cut short still leaves a valid table
        if a.details is not None:
            a.details.write_text(json.dumps(done, indent=1) + "\n")
    print(f"{len(done)} of {len(todo)} buckets tuned in {time.monotonic() - t0:.0f} s -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
