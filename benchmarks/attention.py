"""Attention kernel benchmark: split-S paged decode vs SDPA / FlexAttention / FlashAttention, chunk prefill,
retention scores. Writes attention.json, attention.md, attention.png (+ attention_sweep.json with --sweep).

    python benchmarks/attention.py --out benchmarks/results [--sweep] [--quick]
    TRITON_INTERPRET=1 python benchmarks/attention.py --smoke --out /tmp/x     # CPU: exercises the code paths

Timing: CUDA-graph replay of R back-to-back calls, each on its own copy of the KV (R chosen so >= 200 MB is
touched, like consecutive layers of one decode step, so the KV never sits in L2), median of replays / R.
Every implementation reads the same KV bytes: the selected chunks' K and V plus the local (query+response)
K and V. Baselines get that KV already gathered into contiguous memory (their best case); split-S reads it
from a scattered page pool. HBM peak is measured in the same run with a 2 GB device copy.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from pdllm.kernels.chunk_prefill_attention import chunk_prefill_attention
from pdllm.kernels.retention_scores import retention_scores
from pdllm.kernels.split_s_attention import SplitSConfig, split_s_attention

HQ, HKV, D = 28, 4, 128


def time_us(fn: Callable[[], object], reps: int, graph: bool = True) -> tuple[float, str]:
    """Median microseconds of one ``fn()``; CUDA-graph replay when capturable, else eager events."""
    if not torch.cuda.is_available():
        fn()
        return float("nan"), "cpu"
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    n_inner = 5
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
        ws = torch.zeros(self.batch * HKV * 64, dtype=torch.int32, device=self.q.device)

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


def decode_rows(shapes: list[tuple[int, int, int, int]], flex_shapes: set, dev: str, dtype: torch.dtype,
                peak: float, reps: int, cfg: SplitSConfig | None,
                checkpoint: Callable[[list[dict]], None] | None = None) -> list[dict]:  # fmt: skip
    flex = None
    if flex_shapes and dev == "cuda":
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.cache_size_limit = 256
        flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    for batch, lq, s, c in shapes:
        kv_bytes = batch * (s * c + lq) * HKV * D * 4
        R = max(1, min(16, math.ceil(200e6 / kv_bytes))) if dev == "cuda" else 1
        case = DecodeCase(batch, lq, s, c, 64 if dev == "cuda" else 16, dev, dtype, R)
        impls = {"split_s_triton": case.split_s(cfg), "sdpa_gathered": case.sdpa()}
        if dev == "cuda":
            impls["split_s_triton_fused"] = case.split_s(SplitSConfig(fused_merge=True))
        if dev == "cuda":
            impls["flash_varlen_gathered"] = case.flash_varlen()
        if flex is not None and (batch, lq, s, c) in flex_shapes:
            impls["flex_vanilla"] = case.flex(flex)
            impls["flex_split_s"] = case.flex_split_s(flex)
        row = {"batch": batch, "Lq": lq, "S": s, "C": c, "kv_bytes": case.kv_bytes, "replicas": R,
               "latency_us": {}, "mode": {}}  # fmt: skip
        ref = case.sdpa()()[0]
        for name, fn in impls.items():
            try:
                out = fn()
                out = out[0] if isinstance(out, list) else out
                out = out[0] if isinstance(out, tuple) else out
                if out.shape != ref.shape:
                    out = out.view(batch, lq, HQ, D).transpose(1, 2)
                err = float((out.float() - ref.float()).norm() / ref.float().norm())
                us, mode = time_us(fn, reps)
                row["latency_us"][name] = us / R
                row["mode"][name] = mode
                row.setdefault("rel_err_vs_sdpa", {})[name] = err
            except Exception as e:  # a baseline that cannot run here is recorded, not fatal
                row.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:200]}"
        us_eager, _ = time_us(case.split_s(cfg), reps, graph=False)
        row["latency_us"]["split_s_triton_eager"] = us_eager / R
        lat = row["latency_us"]
        ours = lat.get("split_s_triton", float("nan"))
        row["bw_GBps"] = case.kv_bytes / ours / 1e3
        row["hbm_fraction"] = row["bw_GBps"] / peak
        row["speedup_vs_sdpa"] = lat.get("sdpa_gathered", float("nan")) / ours
        row["speedup_vs_flex"] = lat["flex_vanilla"] / ours if "flex_vanilla" in lat else None
        row["speedup_vs_flash"] = (
            lat["flash_varlen_gathered"] / ours if "flash_varlen_gathered" in lat else None
        )
        print(f"B={batch:2d} Lq={lq:3d} S={s:2d} C={c:4d} {case.kv_bytes / 1e6:7.1f}MB  "
              + "  ".join(f"{k}={v:8.1f}" for k, v in lat.items()) + f"  hbm={row['hbm_fraction']:.2f}", flush=True)  # fmt: skip
        rows.append(row)
        if checkpoint is not None and len(rows) % 9 == 0:
            checkpoint(rows)  # a run cut short by its time limit still leaves its rows behind
        del case
        torch.cuda.empty_cache() if dev == "cuda" else None
    return rows


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


def write_outputs(out: Path, meta: dict, rows: list[dict], prefill: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention.json").write_text(
        json.dumps({"meta": meta, "decode": rows, "prefill": prefill}, indent=1)
    )
    names = sorted({k for r in rows for k in r["latency_us"]})
    fmt = lambda v: "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1f}"
    lines = [f"# Attention benchmark — {meta['device']}, {meta['date']}", "", f"`{meta['command']}`", "",
             f"HBM peak (2 GB copy, read+write): {meta['hbm_peak_GBps']:.0f} GB/s. Latency in µs per layer call "
             f"({meta['dtype']}, {HQ}/{HKV} heads, d={D}, page 64).", "",
             "| B | Lq | S | C | KV MB | " + " | ".join(names) + " | GB/s | HBM frac | x SDPA | x flex | x flash |",
             "|" + "---|" * (10 + len(names))]  # fmt: skip
    for r in rows:
        lat = r["latency_us"]
        lines.append(f"| {r['batch']} | {r['Lq']} | {r['S']} | {r['C']} | {r['kv_bytes'] / 1e6:.1f} | "
                     + " | ".join(fmt(lat.get(n)) for n in names)
                     + f" | {r['bw_GBps']:.0f} | {r['hbm_fraction']:.2f} | {fmt(r['speedup_vs_sdpa'])} | "
                     f"{fmt(r['speedup_vs_flex'])} | {fmt(r['speedup_vs_flash'])} |")  # fmt: skip
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
    errs = [(r["batch"], r["Lq"], r["S"], r["C"], r["errors"]) for r in rows + prefill if r.get("errors")]
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--quick", action="store_true", help="a handful of shapes")
    ap.add_argument("--sweep", action="store_true", help="time kernel configs first")
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args(argv)
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
        grid = [(1, 32, 4, 1024), (8, 32, 8, 1024), (32, 32, 4, 1024), (1, 256, 16, 2048), (32, 96, 16, 2048)]
    if a.smoke:
        grid, flex_shapes, prefill_sizes = [(1, 16, 2, 32), (2, 16, 1, 64)], set(), [(2, 48)]
    meta = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv), "torch": torch.__version__, "dtype": str(dtype),
    }  # fmt: skip
    meta["hbm_peak_GBps"] = hbm_peak_gbps(dev)
    print(f"HBM peak {meta['hbm_peak_GBps']:.0f} GB/s on {meta['device']}", flush=True)
    cfg = SplitSConfig(16, 16) if a.smoke else None
    if a.sweep and not a.smoke:
        shapes = [(1, 32, 4, 1024), (8, 32, 8, 1024), (32, 32, 8, 2048), (1, 256, 4, 1024), (8, 96, 16, 2048)]
        res = sweep(dev, dtype, shapes, a.reps)
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "attention_sweep.json").write_text(json.dumps({"meta": meta, "rows": res}, indent=1))
    rows = decode_rows(grid, flex_shapes, dev, dtype, meta["hbm_peak_GBps"], a.reps, cfg,
                       checkpoint=lambda r: write_outputs(a.out, meta, r, []))  # fmt: skip
    prefill = prefill_rows(dev, dtype, prefill_sizes, 64 if not a.smoke else 16, a.reps)
    write_outputs(a.out, meta, rows, prefill)
    print((a.out / "attention.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
