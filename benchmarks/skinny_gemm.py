"""The decode step's GEMMs at Dream-7B shapes: cuBLAS + separate epilogue kernels (the model before) vs the
skinny Triton GEMMs with fused epilogues (``kernels/skinny_gemm.py``, the model's route now), same run.

    python benchmarks/skinny_gemm.py --out benchmarks/results          # GPU (bf16)
    python benchmarks/skinny_gemm.py --smoke --out /tmp/skinny         # CPU: tiny shapes, the references

Rows: one per projection of a decoder layer at M rows (default 56: a 24-token question + 32-token response).
"before": ``F.linear`` (+ bias in cuBLAS's epilogue), then ``silu_mul_fused`` for gate/up, an add for down's
residual. "after": what ``MLP.forward`` runs now (skinny GEMMs where :func:`pick_config` has a config, the
same cuBLAS call elsewhere). Times are CUDA-graph replays of one call per weight copy, the copies rotated so
weights come from HBM as in a decode step (each layer reads its own); ``hbm_fraction`` = weight bytes / time
/ the HBM peak measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the benchmarks package importable
    sys.path.insert(0, str(ROOT))

from benchmarks.shapes import dream7b, measure_peaks, tiny  # noqa: E402
from pdllm.kernels.silu_mul import silu_mul_fused, silu_mul_fused_reference  # noqa: E402
from pdllm.kernels.skinny_gemm import (  # noqa: E402
    pick_config,
    skinny_linear,
    skinny_linear_reference,
    skinny_silu_mul,
    skinny_silu_mul_reference,
)


def time_us(fn: Callable[[int], object], copies: int, device: torch.device, reps: int = 20) -> float:
    """Best of 5: mean µs per call over ``reps`` replays of a graph calling ``fn(0..copies-1)``."""
    if device.type != "cuda":
        t = time.perf_counter()
        for c in range(copies):
            fn(c)
        return (time.perf_counter() - t) * 1e6 / copies
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles, autotune-free configs, cuBLAS handles
        for c in range(copies):
            fn(c)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in range(copies):
            fn(c)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize(device)
        best = min(best, start.elapsed_time(end) * 1e3 / reps / copies)
    return best


def projection_row(name: str, m: int, n: int, k: int, packed: int, has_bias: bool, has_res: bool,
                   device: torch.device, dtype: torch.dtype, hbm_gbps: float) -> dict:  # fmt: skip
    """Time one projection before and after; on the CPU (smoke) "after" runs the kernels' references."""
    gpu = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(0)
    copies = max(2, min(16, int(2e9 // (packed * k * 2)))) if gpu else 1
    ws = [torch.randn(packed, k, device=device, dtype=dtype, generator=gen) * 0.02 for _ in range(copies)]
    bias = torch.randn(packed, device=device, dtype=dtype, generator=gen) if has_bias else None
    x = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
    res = torch.randn(m, n, device=device, dtype=dtype, generator=gen) if has_res else None
    glu = packed == 2 * n
    cfg = pick_config(m, n, k, glu)
    act = silu_mul_fused if gpu else silu_mul_fused_reference

    def before(c: int) -> torch.Tensor:
        y = F.linear(x, ws[c], bias)
        y = act(y) if glu else y
        return y if res is None else res + y

    def after(c: int) -> torch.Tensor:
        if cfg is None:
            return before(c)
        if glu:
            return skinny_silu_mul(x, ws[c], cfg) if gpu else skinny_silu_mul_reference(x, ws[c])
        return (
            skinny_linear(x, ws[c], bias, res, cfg) if gpu else skinny_linear_reference(x, ws[c], bias, res)
        )

    want = before(0).float()
    err = ((after(0).float() - want).norm() / want.norm()).item()
    t_before, t_after = time_us(before, copies, device), time_us(after, copies, device)
    weight_bytes = packed * k * dtype.itemsize
    floor_us = weight_bytes / (hbm_gbps * 1e3)
    return {
        "projection": name, "M": m, "N": n, "K": k, "weight_MB": round(weight_bytes / 1e6, 2),
        "skinny_config": None if cfg is None else cfg.__dict__, "before_us": round(t_before, 2),
        "after_us": round(t_after, 2), "speedup": round(t_before / t_after, 3),
        "hbm_fraction_before": round(floor_us / t_before, 3), "hbm_fraction_after": round(floor_us / t_after, 3),
        "rel_err_vs_before": err,
    }  # fmt: skip


def measure(m: int, hidden: int, inter: int, heads: tuple[int, int, int], device: torch.device,
            dtype: torch.dtype, hbm_gbps: float) -> list[dict]:  # fmt: skip
    hq, hkv, d = heads
    qkv = (hq + 2 * hkv) * d
    projections = [  # (name, N out, K, packed weight rows, bias, residual)
        ("qkv", qkv, hidden, qkv, True, False),
        ("o", hidden, hidden, hidden, False, False),
        ("gate_up+silu", inter, hidden, 2 * inter, False, False),
        ("down+residual", hidden, inter, hidden, False, True),
    ]
    rows = []
    for spec in projections:
        rows.append(projection_row(spec[0], m, *spec[1:], device, dtype, hbm_gbps))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "skinny_gemm.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# Decode-step GEMMs: cuBLAS + separate epilogues vs skinny Triton GEMMs — {result['device']}, "
        f"{result['date']}",
        "",
        f"`{result['command']}`",
        "",
        f"HBM peak measured in this run: {result['hbm_gbps']:.0f} GB/s. M = {result['rows'][0]['M']} rows, bf16, "
        "weights rotated over copies (read from HBM). µs per call, CUDA-graph replay.",
        "",
        "| projection | N x K | weights MB | before µs | after µs | speedup | HBM fraction before / after | config |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        cfg = r["skinny_config"]
        cfg_s = "cuBLAS (no skinny config)" if cfg is None else ", ".join(f"{k}={v}" for k, v in cfg.items())
        lines.append(
            f"| {r['projection']} | {r['N']} x {r['K']} | {r['weight_MB']} | {r['before_us']} | {r['after_us']} | "
            f"{r['speedup']}x | {r['hbm_fraction_before']} / {r['hbm_fraction_after']} | {cfg_s} |"
        )
    saved = sum(r["before_us"] - r["after_us"] for r in result["rows"])
    lines += ["", f"Per decoder layer: {saved:.1f} µs saved; x {result['layers']} layers = "
              f"{saved * result['layers'] / 1e3:.2f} ms per decode step."]  # fmt: skip
    (out / "skinny_gemm.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, the reference functions")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument(
        "--rows", type=int, default=56, help="activation rows (a decode step's question + response)"
    )
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    cfg = tiny() if device.type == "cpu" else dream7b()
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    peaks = measure_peaks(device, dtype)
    rows = measure(args.rows, cfg.hidden_size, cfg.intermediate_size, (cfg.num_heads, cfg.num_kv_heads,
                   cfg.head_dim), device, dtype, peaks["hbm_gbps"])  # fmt: skip
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python benchmarks/skinny_gemm.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "hbm_gbps": peaks["hbm_gbps"], "layers": cfg.num_layers, "rows": rows,
    }  # fmt: skip
    write(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
