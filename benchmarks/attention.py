"""Attention kernel benchmark: split-S paged decode vs SDPA / FlexAttention / FlashAttention, chunk prefill,
retention scores. Writes attention.json, attention.md, attention.png (+ attention_sweep.json with --sweep).

    python benchmarks/attention.py --out benchmarks/results [--sweep] [--quick]
    python benchmarks/attention.py --grid --out benchmarks/results [--budget-s 330] [--table T.json]
    TRITON_INTERPRET=1 python benchmarks/attention.py --smoke --out /tmp/x     # CPU: exercises the code paths

Timing: CUDA-graph replay of R back-to-back calls, each on its own copy of the KV (R chosen so >= 200 MB is
touched, like consecutive layers of one decode step, so the KV never sits in L2), median of replays / R.
Every implementation reads the same KV bytes: the selected chunks' K and V plus the local (query+response)
K and V. Baselines get that KV already gathered into contiguous memory (their best case); split-S reads it
from a scattered page pool. HBM peak is measured in the same run with a 2 GB device copy, the dense bf16
peak with an 8192^3 GEMM (or given by --peak-tflops).

split-S is timed twice: ``split_s_triton`` is what the launcher picks with ``config=None`` (the tuned table's
entry for this device and shape bucket, else the heuristic; see kernels/split_s_tuning.py) and
``split_s_default`` the fixed ``SplitSConfig()`` every shape used before. A call's roofline is the larger of
its KV read time at the HBM peak and its attention FLOPs (4 * B * Lq * Hq * d * S * C) at the GEMM peak.
--grid runs the five-shape table and the grid; cells whose KV copies need more than --mem-gb, whose predicted call
time exceeds --max-call-ms, or that start after --budget-s are recorded under ``decode_skipped``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pdllm.kernels import split_s_tuning
from pdllm.kernels.chunk_prefill_attention import chunk_prefill_attention
from pdllm.kernels.retention_scores import retention_scores
from pdllm.kernels.split_s_attention import SplitSConfig, split_s_attention
from pdllm.kernels.split_s_tuner import call_cost, predicted_ms
from pdllm.kernels.split_s_tuning import config_to_dict, select_config

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the benchmarks package importable
    sys.path.insert(0, str(ROOT))
from benchmarks.attention_ragged import PAGE, RAGGED_CELLS, SMOKE_CELLS, ragged_markdown, ragged_rows  # noqa: E402

HQ, HKV, D = 28, 4, 128


def time_us(
    fn: Callable[[], object], reps: int, graph: bool = True, target_s: float | None = None
) -> tuple[float, str]:
    """Median microseconds of one ``fn()``; CUDA-graph replay when capturable, else eager events.

    ``target_s``: spend about that long replaying (at least 3 replays, at most ``reps``), with fewer calls
    per replay for slow ``fn``; the grid's largest cells would otherwise take minutes each.
    """
    if not torch.cuda.is_available():
        fn()
        return float("nan"), "cpu"
    for _ in range(2 if target_s is not None else 3):
        fn()
    torch.cuda.synchronize()
    n_inner = 5
    if target_s is not None:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        once = max(a.elapsed_time(b) * 1000, 1.0)
        n_inner = max(1, min(5, math.ceil(2000 / once)))  # >= 2 ms per replay hides the launch
        reps = max(3, min(reps, int(target_s * 1e6 / (once * n_inner))))
    if graph:
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(n_inner):
                    fn()
            run, mode = g.replay, "graph"
        except Exception as e:  # capture can fail for compiled/dynamic code: fall back, and say so
            print(f"  graph capture failed ({type(e).__name__}: {str(e)[:80]}), timing eagerly")
            graph = False
    if not graph:

        def run() -> None:
            for _ in range(n_inner):
                fn()

        mode = "eager"
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / n_inner)
    return statistics.median(times), mode


def hbm_peak_gbps(dev: str) -> float:
    if dev != "cuda":
        return float("nan")
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev).random_()
    y = torch.empty_like(x)
    us, _ = time_us(lambda: y.copy_(x), reps=20, graph=False)
    return 2 * x.numel() / us / 1e3


def gemm_peak_tflops(dev: str) -> float:
    """Dense bf16 GEMM throughput (8192^3, graph replay): the compute roof the FLOP fractions use."""
    if dev != "cuda":
        return float("nan")
    a, b = (torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16) for _ in range(2))
    us, _ = time_us(lambda: a @ b, reps=20)
    return 2 * 8192**3 / us / 1e6


class DecodeCase:
    """One decode shape: R replicas of a scattered page pool, plus gathered copies for the baselines."""

    def __init__(
        self, batch: int, lq: int, s: int, c: int, page: int, dev: str, dtype: torch.dtype, reps: int
    ):
        self.batch, self.lq, self.s, self.c = batch, lq, s, c
        self.L = s * c + lq
        self.kv_bytes = batch * self.L * HKV * D * 2 * dtype.itemsize
        self.R = reps
        n_pages = batch * s * c // page
        g = torch.Generator(device=dev).manual_seed(0)
        self.pools, self.tables, self.gathered = [], [], []
        self.q = torch.randn(batch * lq, HQ, D, device=dev, dtype=dtype, generator=g)
        self.q4 = self.q.view(batch, lq, HQ, D).transpose(1, 2).contiguous()
        for _ in range(reps):
            pool = torch.randn(2, n_pages, HKV, page, D, device=dev, dtype=dtype, generator=g)
            perm = torch.randperm(n_pages, device=dev, generator=g).to(torch.int32)
            table = perm.view(batch, s * c // page)
            local = torch.randn(2, batch * lq, HKV, D, device=dev, dtype=dtype, generator=g)
            # Contiguous [2, B, Hkv, L, D]: the request's pages in table order, then its local tokens.
            paged = pool[:, table.long()].permute(0, 1, 3, 2, 4, 5).reshape(2, batch, HKV, s * c, D)
            loc = local.view(2, batch, lq, HKV, D).transpose(2, 3)
            self.pools.append((pool, local))
            self.tables.append(table)
            self.gathered.append(torch.cat([paged, loc], 3).contiguous())
        self.kv_lens = torch.full((batch,), s * c, dtype=torch.int32, device=dev)
        self.q_offsets = torch.arange(0, batch * lq + 1, lq, dtype=torch.int32, device=dev)

    def split_s(self, cfg: SplitSConfig | None) -> Callable[[], object]:
        """All R calls; ``cfg`` None = the launcher's own pick (tuned table, else heuristic), called as the
        decode service calls it (no counter workspace: a fused-merge pick zeroes its own)."""
        m_blocks = -(-self.lq * (HQ // HKV) // 16)  # enough counters for any block_m >= 16
        ws = (
            None
            if cfg is None
            else torch.zeros(self.batch * HKV * m_blocks, dtype=torch.int32, device=self.q.device)
        )

        def fn() -> list[torch.Tensor]:
            return [
                split_s_attention(self.q, pool[0], pool[1], table, self.kv_lens, self.q_offsets, local[0], local[1],
                                  config=cfg, max_q_len=self.lq, max_kv_len=self.s * self.c, workspace=ws)
                for (pool, local), table in zip(self.pools, self.tables)
            ]  # fmt: skip

        return fn

    def sdpa(self) -> Callable[[], object]:
        return lambda: [
            F.scaled_dot_product_attention(self.q4, kv[0], kv[1], enable_gqa=True) for kv in self.gathered
        ]

    def flash_varlen(self) -> Callable[[], object]:
        packed = [
            kv.transpose(2, 3).reshape(2, self.batch * self.L, HKV, D).contiguous() for kv in self.gathered
        ]
        dev = self.q.device
        cu_k = torch.arange(0, self.batch * self.L + 1, self.L, dtype=torch.int32, device=dev)
        op = torch.ops.aten._flash_attention_forward
        return lambda: [op(self.q, kv[0], kv[1], self.q_offsets, cu_k, self.lq, self.L, 0.0, False, False)
                        for kv in packed]  # fmt: skip

    def flex(self, compiled: Callable) -> Callable[[], object]:
        return lambda: [compiled(self.q4, kv[0], kv[1], enable_gqa=True) for kv in self.gathered]

    def flex_split_s(self, compiled: Callable) -> Callable[[], object]:
        """The paper's split-S FlexAttention: the S chunk segments (+ the local KV as one more) along the batch
        dimension, per-segment LSE, merged in torch."""
        b, s, c, lq = self.batch, self.s, self.c, self.lq
        segs = [kv[:, :, :, : s * c].reshape(2, b, HKV, s, c, D).transpose(2, 3).reshape(2, b * s, HKV, c, D)
                for kv in self.gathered]  # fmt: skip
        locs = [kv[:, :, :, s * c :] for kv in self.gathered]
        qs = self.q4.repeat_interleave(s, 0)

        def fn() -> list[torch.Tensor]:
            outs = []
            for seg, loc in zip(segs, locs):
                o1, l1 = compiled(qs, seg[0], seg[1], enable_gqa=True, return_lse=True)
                o2, l2 = compiled(self.q4, loc[0], loc[1], enable_gqa=True, return_lse=True)
                o = torch.cat([o1.view(b, s, HQ, lq, D), o2[:, None]], 1)
                lse = torch.cat([l1.view(b, s, HQ, lq), l2[:, None]], 1)
                w = torch.softmax(lse, 1)
                outs.append((o * w[..., None]).sum(1))
            return outs

        return fn


Shape = tuple[int, int, int, int]  # (batch, Lq, S, C)


@dataclass(frozen=True)
class DecodeOptions:
    """How decode rows are run. ``extra``: also the fused-merge and FA2-varlen columns; ``target_s``: see
    :func:`time_us`; cells are skipped past ``mem_gb``, ``max_call_ms`` (predicted) and ``budget_s``."""

    reps: int
    hbm_gbps: float
    gemm_tflops: float
    flex_shapes: frozenset[Shape] = frozenset()
    extra: bool = True
    target_s: float | None = None
    mem_gb: float = 40.0
    max_call_ms: float = float("inf")
    budget_s: float = float("inf")


def cell_cost(shape: Shape, dtype: torch.dtype) -> tuple[float, float, int]:
    """(attention FLOPs, KV bytes read, replicas R) of one cell."""
    batch, lq, s, c = shape
    flops, kv_bytes = call_cost(batch, lq, HQ, HKV, D, s * c, dtype.itemsize)
    return flops, kv_bytes, max(1, min(16, math.ceil(200e6 / kv_bytes)))


def skip_reason(shape: Shape, dtype: torch.dtype, opts: DecodeOptions) -> str | None:
    """Why a cell is not run (before it is built), or None. Pools + gathered copies: 2 * R * KV bytes."""
    flops, kv_bytes, reps = cell_cost(shape, dtype)
    if 2 * reps * kv_bytes > opts.mem_gb * 1e9:
        return f"KV copies need {2 * reps * kv_bytes / 1e9:.0f} GB > --mem-gb {opts.mem_gb:g}"
    if predicted_ms(flops, kv_bytes) > opts.max_call_ms:
        return (
            f"predicted {predicted_ms(flops, kv_bytes):.1f} ms per call > --max-call-ms {opts.max_call_ms:g}"
        )
    return None


def _check(fn: Callable[[], object], ref: torch.Tensor, batch: int, lq: int) -> float:
    out = fn()
    out = out[0] if isinstance(out, list) else out
    out = out[0] if isinstance(out, tuple) else out
    if out.shape != ref.shape:
        out = out.view(batch, lq, HQ, D).transpose(1, 2)
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def decode_row(
    shape: Shape, dev: str, dtype: torch.dtype, opts: DecodeOptions, flex: Callable | None
) -> dict:
    batch, lq, s, c = shape
    flops, _, reps = cell_cost(shape, dtype)
    R = reps if dev == "cuda" else 1
    page = 64 if dev == "cuda" else 16
    case = DecodeCase(batch, lq, s, c, page, dev, dtype, R)
    sel = select_config(torch.device(dev), dtype, lq * (HQ // HKV), s * c + lq, batch * HKV, D, page)
    picked = sel.config
    # split_s_triton: config=None, exactly what the decode service gets.
    impls = {"split_s_triton": case.split_s(None), "sdpa_gathered": case.sdpa()}
    if picked != SplitSConfig():
        impls["split_s_default"] = case.split_s(SplitSConfig())
    if dev == "cuda" and opts.extra:
        impls["split_s_triton_fused"] = case.split_s(SplitSConfig(fused_merge=True))
        if 3 * R * case.kv_bytes <= opts.mem_gb * 1e9:  # FA2 varlen needs a third, packed copy
            impls["flash_varlen_gathered"] = case.flash_varlen()
    if flex is not None and shape in opts.flex_shapes:
        impls["flex_vanilla"] = case.flex(flex)
        impls["flex_split_s"] = case.flex_split_s(flex)
    row = {"batch": batch, "Lq": lq, "S": s, "C": c, "kv_bytes": case.kv_bytes, "flops": flops, "replicas": R,
           "config": {"source": sel.source, "bucket": dataclasses.asdict(sel.bucket), **config_to_dict(picked)},
           "latency_us": {}, "mode": {}}  # fmt: skip
    ref = case.sdpa()()[0]
    for name, fn in impls.items():
        try:
            err = _check(fn, ref, batch, lq)
            us, mode = time_us(fn, opts.reps, target_s=opts.target_s)
            row["latency_us"][name] = us / R
            row["mode"][name] = mode
            row.setdefault("rel_err_vs_sdpa", {})[name] = err
        except Exception as e:  # a baseline that cannot run here is recorded, not fatal
            row.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:200]}"
    lat = row["latency_us"]
    if "split_s_default" not in impls and "split_s_triton" in lat:
        lat["split_s_default"] = lat["split_s_triton"]  # the pick is the default: one timing serves both
    us_eager, _ = time_us(case.split_s(None), opts.reps, graph=False, target_s=opts.target_s)
    lat["split_s_triton_eager"] = us_eager / R
    ours, default_us = lat.get("split_s_triton", math.nan), lat.get("split_s_default", math.nan)
    sdpa = lat.get("sdpa_gathered", math.nan)
    roof_us = max(case.kv_bytes / opts.hbm_gbps / 1e3, flops / opts.gemm_tflops / 1e6)
    row.update({
        "bw_GBps": case.kv_bytes / ours / 1e3,
        "hbm_fraction": case.kv_bytes / ours / 1e3 / opts.hbm_gbps,
        "tflops": flops / ours / 1e6,
        "flop_fraction": flops / ours / 1e6 / opts.gemm_tflops,
        "roofline_us": roof_us,
        "roofline_fraction": roof_us / ours,
        "speedup_vs_sdpa": sdpa / ours,
        "speedup_vs_sdpa_default": sdpa / default_us,
        "tuned_vs_default": default_us / ours,
        "speedup_vs_flex": lat["flex_vanilla"] / ours if "flex_vanilla" in lat else None,
        "speedup_vs_flash": lat["flash_varlen_gathered"] / ours if "flash_varlen_gathered" in lat else None,
    })  # fmt: skip
    print(f"B={batch:2d} Lq={lq:3d} S={s:2d} C={c:4d} {case.kv_bytes / 1e6:7.1f}MB {sel.source}:{picked.block_m}x"
          f"{picked.block_n}w{picked.num_warps}s{picked.num_stages}  "
          + "  ".join(f"{k}={v:8.1f}" for k, v in lat.items())
          + f"  roof={row['roofline_fraction']:.2f} xSDPA={row['speedup_vs_sdpa']:.2f}", flush=True)  # fmt: skip
    return row


def decode_rows(shapes: list[Shape], dev: str, dtype: torch.dtype, opts: DecodeOptions,
                checkpoint: Callable[[list[dict], list[dict]], None] | None = None
                ) -> tuple[list[dict], list[dict]]:  # fmt: skip
    """Rows for the cells that ran and ``{batch, Lq, S, C, kv_bytes, reason}`` for those skipped."""
    flex = None
    if opts.flex_shapes and dev == "cuda":
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.cache_size_limit = 256
        flex = torch.compile(flex_attention, dynamic=False)
    rows: list[dict] = []
    skipped: list[dict] = []
    t0 = time.monotonic()
    for shape in shapes:
        reason = skip_reason(shape, dtype, opts)
        if reason is None and rows and time.monotonic() - t0 > opts.budget_s:  # the first cell always runs
            reason = f"time budget: --budget-s {opts.budget_s:g} spent"
        if reason is not None:
            b, lq, s, c = shape
            skipped.append({"batch": b, "Lq": lq, "S": s, "C": c, "kv_bytes": int(cell_cost(shape, dtype)[1]),
                            "reason": reason})  # fmt: skip
            print(f"skip B={b} Lq={lq} S={s} C={c}: {reason}", flush=True)
            continue
        rows.append(decode_row(shape, dev, dtype, opts, flex))
        if checkpoint is not None and len(rows) % 9 == 0:
            checkpoint(rows, skipped)  # a run cut short by its time limit still leaves its rows behind
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows, skipped


def _prefill_impls(n: int, c: int, lq: int, dev: str, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    t = c + lq
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(n * t, HQ, D, device=dev, dtype=dtype, generator=g)
    k = torch.randn(n * t, HKV, D, device=dev, dtype=dtype, generator=g)
    v = torch.randn(n * t, HKV, D, device=dev, dtype=dtype, generator=g)
    cu = torch.arange(0, n * t + 1, t, dtype=torch.int32, device=dev)
    ql = torch.full((n,), lq, dtype=torch.int32, device=dev)
    q4, k4, v4 = (x.view(n, t, -1, D).transpose(1, 2) for x in (q, k, v))
    lse = chunk_prefill_attention(q, k, v, cu, return_lse=True, max_seqlen=t)[1]
    return {
        "chunk_prefill (flash varlen)": lambda: chunk_prefill_attention(q, k, v, cu, max_seqlen=t),
        "chunk_prefill + lse": lambda: chunk_prefill_attention(q, k, v, cu, return_lse=True, max_seqlen=t),
        "sdpa_batched": lambda: F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True),
        "retention_scores": lambda: retention_scores(q, k, cu, ql, lse=lse, max_chunk_len=c),
    }


def prefill_rows(
    dev: str, dtype: torch.dtype, sizes: list[tuple[int, int]], lq: int, reps: int
) -> list[dict]:
    rows = []
    for n, c in sizes:
        row = {"N": n, "C": c, "Lq": lq, "latency_us": {}}
        for name, fn in _prefill_impls(n, c, lq, dev, dtype).items():
            try:
                row["latency_us"][name] = time_us(fn, reps)[0]
            except Exception as e:
                row.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:200]}"
        print(
            f"prefill N={n} C={c} Lq={lq} " + "  ".join(f"{k}={v:.1f}" for k, v in row["latency_us"].items())
        )
        rows.append(row)
    return rows


SWEEP = [
    SplitSConfig(), SplitSConfig(num_stages=3), SplitSConfig(fused_merge=True),
    SplitSConfig(num_stages=3, fused_merge=True), SplitSConfig(fused_merge=True, partial_cost=0.25),
]  # fmt: skip


def sweep(dev: str, dtype: torch.dtype, shapes: list[tuple[int, int, int, int]], reps: int) -> list[dict]:
    out = []
    for batch, lq, s, c in shapes:
        kv_bytes = batch * (s * c + lq) * HKV * D * 4
        case = DecodeCase(batch, lq, s, c, 64, dev, dtype, max(1, min(16, math.ceil(200e6 / kv_bytes))))
        for cfg in SWEEP:
            try:
                us = time_us(case.split_s(cfg), reps)[0] / case.R
            except Exception as e:
                us = float("nan")
                print(f"  {cfg}: {type(e).__name__} {str(e)[:120]}")
            out.append({"batch": batch, "Lq": lq, "S": s, "C": c, "config": repr(cfg), "us": us})
            print(f"sweep B={batch} Lq={lq} S={s} C={c} {us:8.1f} us  {cfg}", flush=True)
        del case
    return out


def _fmt(v: object, spec: str = ".1f") -> str:
    return "—" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def _cfg_label(cfg: dict) -> str:
    fused = "+fm" if cfg["fused_merge"] else ""
    return (
        f"{cfg['source'][0]}:{cfg['block_m']}x{cfg['block_n']}w{cfg['num_warps']}s{cfg['num_stages']}{fused}"
    )


def write_outputs(out: Path, meta: dict, rows: list[dict], prefill: list[dict], skipped: list[dict],
                  ragged: list[dict] | None = None) -> None:  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    rows = sorted(rows, key=lambda r: (r["batch"], r["Lq"], r["S"], r["C"]))
    data = {
        "meta": meta,
        "decode": rows,
        "decode_skipped": skipped,
        "prefill": prefill,
        "ragged": ragged or [],
    }
    (out / "attention.json").write_text(json.dumps(data, indent=1))
    names = sorted({k for r in rows for k in r["latency_us"]})
    fmt = _fmt
    lines = [f"# Attention benchmark — {meta['device']}, {meta['date']}", "", f"`{meta['command']}`", "",
             f"HBM peak (2 GB copy, read+write): {meta['hbm_peak_GBps']:.0f} GB/s; dense bf16 GEMM peak: "
             f"{meta['gemm_peak_TFLOPs']:.0f} TFLOP/s ({meta['gemm_peak_source']}). Latency in µs per layer call "
             f"({meta['dtype']}, {HQ}/{HKV} heads, d={D}, page 64). `split_s_triton`: the launcher's pick "
             "(config column: t = tuned table, h = heuristic; BLOCK_M x BLOCK_N, warps, stages, +fm = fused "
             "merge); `split_s_default`: the fixed 64x64w4s2. Roofline = max(KV bytes / HBM peak, "
             "4·B·Lq·Hq·d·S·C / GEMM peak).", "",
             "| B | Lq | S | C | KV MB | config | " + " | ".join(names)
             + " | GB/s | HBM frac | TFLOP/s | FLOP frac | roofline frac | x default | x SDPA | x SDPA (default) "
             "| x flex | x flash |",
             "|" + "---|" * (16 + len(names))]  # fmt: skip
    for r in rows:
        lat = r["latency_us"]
        lines.append(f"| {r['batch']} | {r['Lq']} | {r['S']} | {r['C']} | {r['kv_bytes'] / 1e6:.1f} | "
                     f"{_cfg_label(r['config'])} | " + " | ".join(fmt(lat.get(n)) for n in names)
                     + f" | {fmt(r['bw_GBps'], '.0f')} | {fmt(r['hbm_fraction'], '.2f')} | {fmt(r['tflops'], '.0f')} | "
                     f"{fmt(r['flop_fraction'], '.2f')} | {fmt(r['roofline_fraction'], '.2f')} | "
                     f"{fmt(r['tuned_vs_default'], '.2f')} | {fmt(r['speedup_vs_sdpa'], '.2f')} | "
                     f"{fmt(r['speedup_vs_sdpa_default'], '.2f')} | {fmt(r['speedup_vs_flex'], '.2f')} | "
                     f"{fmt(r['speedup_vs_flash'], '.2f')} |")  # fmt: skip
    if skipped:
        lines += ["", f"Skipped cells ({len(skipped)}):", ""]
        lines += [f"- B={r['batch']} Lq={r['Lq']} S={r['S']} C={r['C']} ({r['kv_bytes'] / 1e6:.0f} MB): {r['reason']}"
                  for r in skipped]  # fmt: skip
    if prefill:
        pn = sorted({k for r in prefill for k in r["latency_us"]})
        lines += ["", "## Chunk prefill and retention scores (µs per layer call)", "",
                  "| N | C | Lq | " + " | ".join(pn) + " |", "|" + "---|" * (3 + len(pn))]  # fmt: skip
        for r in prefill:
            lines.append(
                f"| {r['N']} | {r['C']} | {r['Lq']} | "
                + " | ".join(fmt(r["latency_us"].get(n)) for n in pn)
                + " |"
            )
    if ragged:
        lines += ragged_markdown(ragged)
    errs = [(*(r[k] for k in ("batch", "N", "Lq", "S", "C") if k in r), r["errors"]) for r in rows + prefill
            if r.get("errors")]  # fmt: skip
    if errs:
        lines += ["", "Errors (implementation could not run):", *[f"- {e}" for e in errs[:10]]]
    (out / "attention.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    if not any(math.isfinite(v) for r in rows for v in r["latency_us"].values()):
        return  # nothing timed (CPU smoke run)
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    lq0 = min(r["Lq"] for r in rows)
    for ax, b in zip(axes[0], batches):
        sel = sorted((r for r in rows if r["batch"] == b and r["Lq"] == lq0), key=lambda r: r["S"] * r["C"])
        for n in names:
            pts = [
                (r["S"] * r["C"], r["latency_us"][n])
                for r in sel
                if math.isfinite(r["latency_us"].get(n, math.nan))
            ]
            if pts:
                ax.plot(*zip(*sorted(pts)), marker="o", label=n)
        ax.set(xscale="log", yscale="log", xlabel="prefix KV tokens (S*C)", ylabel="µs / layer call",
               title=f"batch {b}, Lq {lq0}")  # fmt: skip
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{meta['device']} {meta['date']}\n{meta['command']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "attention.png", dpi=110)


# The five-shape table (the decode shapes the targets name), then the grid.
TABLE_SHAPES: list[Shape] = [(1, 32, 4, 1024), (8, 32, 8, 1024), (32, 32, 4, 1024), (1, 256, 16, 2048),
                             (32, 96, 16, 2048)]  # fmt: skip
GRID_SHAPES: list[Shape] = [
    (b, lq, s, c) for b in (1, 4, 16, 64) for lq in (32, 96) for s in (4, 16, 64) for c in (256, 1024, 2048)
]


def grid_shapes(dtype: torch.dtype) -> list[Shape]:
    """The five table shapes, then the grid cheapest first (so a spent budget skips the largest)."""
    rest = [sh for sh in GRID_SHAPES if sh not in TABLE_SHAPES]
    return TABLE_SHAPES + sorted(rest, key=lambda sh: predicted_ms(*cell_cost(sh, dtype)[:2]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--quick", action="store_true", help="a handful of shapes")
    ap.add_argument("--grid", action="store_true", help="the shape table + grid (split-S, default, SDPA)")
    ap.add_argument("--sweep", action="store_true", help="time kernel configs first")
    ap.add_argument("--ragged", action="store_true", help="the ragged decode batches (on with --grid)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument(
        "--table", type=Path, default=None, help="tuned config table (default: the committed one)"
    )
    ap.add_argument(
        "--budget-s", type=float, default=None, help="start no decode cell after this (grid: 330)"
    )
    ap.add_argument("--max-call-ms", type=float, default=12.0, help="skip cells predicted slower per call")
    ap.add_argument("--mem-gb", type=float, default=40.0, help="skip cells whose KV copies need more")
    ap.add_argument(
        "--peak-tflops", type=float, default=None, help="dense bf16 peak (default: measured GEMM)"
    )
    a = ap.parse_args(argv)
    if a.table is not None:
        os.environ[split_s_tuning.TABLE_ENV] = str(a.table)  # the launcher's own lookup reads it too
        split_s_tuning.clear_caches()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float16
    grid = [
        (b, lq, s, c)
        for b in (1, 8, 32)
        for lq in (32, 96, 256)
        for s in (4, 8, 16)
        for c in (512, 1024, 2048)
    ]
    flex_shapes = {
        (1, 32, 4, 1024),
        (8, 32, 4, 1024),
        (32, 32, 4, 1024),
        (1, 32, 16, 1024),
        (1, 256, 4, 1024),
    }
    prefill_sizes = [(32, 1024), (16, 2048), (64, 512)]
    if a.quick:
        grid = list(TABLE_SHAPES)
    if a.grid:
        grid, flex_shapes = grid_shapes(dtype), set()
    if a.smoke:
        grid, flex_shapes, prefill_sizes = [(1, 16, 2, 32), (2, 16, 1, 64)], set(), [(2, 48)]
        if a.grid:  # and a cell over --max-call-ms, so the skip path runs too
            grid.append((64, 96, 64, 2048))
    table = split_s_tuning.load_table()  # a malformed table fails here, before any timing
    meta = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv), "torch": torch.__version__, "dtype": str(dtype),
        "config_table": table.path,
    }  # fmt: skip
    meta["config_table_entries_for_device"] = sum(d == meta["device"] for d, _ in table.entries)
    meta["hbm_peak_GBps"] = hbm_peak_gbps(dev)
    measured = gemm_peak_tflops(dev) if a.peak_tflops is None else math.nan
    meta["gemm_peak_TFLOPs"] = a.peak_tflops if a.peak_tflops is not None else measured
    meta["gemm_peak_source"] = (
        "given (--peak-tflops)" if a.peak_tflops is not None else "8192^3 GEMM, same run"
    )
    print(f"HBM peak {meta['hbm_peak_GBps']:.0f} GB/s, GEMM {meta['gemm_peak_TFLOPs']:.0f} TFLOP/s on "
          f"{meta['device']}; table {table.path} ({meta['config_table_entries_for_device']} entries here)",
          flush=True)  # fmt: skip
    if a.sweep and not a.smoke:
        shapes = [(1, 32, 4, 1024), (8, 32, 8, 1024), (32, 32, 8, 2048), (1, 256, 4, 1024), (8, 96, 16, 2048)]
        res = sweep(dev, dtype, shapes, a.reps)
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "attention_sweep.json").write_text(json.dumps({"meta": meta, "rows": res}, indent=1))
    budget = a.budget_s if a.budget_s is not None else (330.0 if a.grid and not a.smoke else math.inf)
    opts = DecodeOptions(
        reps=a.reps, hbm_gbps=meta["hbm_peak_GBps"], gemm_tflops=meta["gemm_peak_TFLOPs"],
        flex_shapes=frozenset(flex_shapes), extra=not a.grid, target_s=0.1 if a.grid else None,
        mem_gb=a.mem_gb, max_call_ms=a.max_call_ms, budget_s=budget,
    )  # fmt: skip
    meta["grid"] = {"budget_s": opts.budget_s, "max_call_ms": opts.max_call_ms, "mem_gb": opts.mem_gb}
    rows, skipped = decode_rows(grid, dev, dtype, opts,
                                checkpoint=lambda r, sk: write_outputs(a.out, meta, r, [], sk))  # fmt: skip
    prefill = prefill_rows(dev, dtype, prefill_sizes, 64 if not a.smoke else 16, a.reps)
    ragged = []
    if a.ragged or a.grid:
        cells = SMOKE_CELLS if a.smoke else RAGGED_CELLS
        ragged = ragged_rows(dev, dtype, cells, HQ, HKV, D, meta["hbm_peak_GBps"], meta["gemm_peak_TFLOPs"],
                             time_us, a.reps, page=16 if a.smoke else PAGE)  # fmt: skip
    write_outputs(a.out, meta, rows, prefill, skipped, ragged)
    print((a.out / "attention.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
