"""A/B of FlashInfer's paged-KV batch prefill (FA3 on sm90, FA2, auto) against today's split-S, one run.

Device command (the tarball of ``benchmarks/flashinfer_carry.py`` carried as ``.whl/flashinfer_slim.tgz``;
FlashInfer is not installed, only unpacked; ``FLASHINFER_WORKSPACE_BASE`` keeps the JIT builds in ``/tmp``,
which a warm machine keeps for the next call):

    python -m pip install -q --no-deps --no-build-isolation -e . && set -o pipefail && \
    mkdir -p /tmp/fi && tar -xzf .whl/flashinfer_slim.tgz -C /tmp/fi && \
    PYTHONPATH=/tmp/fi/site FLASHINFER_WORKSPACE_BASE=/tmp/fi PYTHONUNBUFFERED=1 \
      python benchmarks/flashinfer_ab.py --out $OUT --budget-s 300 2>&1 | tee $OUT/log.txt

Cells (bf16, 28/4 heads, d = 128, page 64, every entry's own rows' K/V as local keys), ``--cells`` order:
the five-shape table and the grid of ``benchmarks/attention.py`` (B entries x Lq rows, S chunks of C tokens,
page-aligned: per entry one paged and one local segment, no ``page_fill``) and ragged cells (16-64 entries of
8-280 rows, 4K-32K KV tokens in chunks of random length: chunks end mid-page, both sides get ``page_fill``,
FlashInfer about a segment per chunk). Per cell: split-S as the
launcher picks it (``config=None``), then ``kernels/flashinfer_attention.attend`` per backend and merge
(scratch pages take the local K/V, one FlashInfer call, the merge), and ``fa3_kernel`` (the FA3 call alone).
Timing: ``benchmarks/attention.py``'s ``time_us``, CUDA-graph replay of R calls over R pool copies (else
events; the mode is recorded). Errors and LSE against ``split_s_attention_reference`` (fp32); ``ok``: a
relative error within 2x split-S's (or 1e-2). Each backend's first plan JIT-compiles its module (nvcc,
``compile_s``). A failure is recorded per implementation, never fatal; cells starting after ``--budget-s``
or over ``--max-call-ms`` / ``--mem-gb`` are listed as skipped. Writes flashinfer_ab.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.attention import HKV, HQ, D, DecodeOptions, grid_shapes, skip_reason, time_us  # noqa: E402
from pdllm.kernels import flashinfer_attention as fa  # noqa: E402
from pdllm.kernels.split_s_attention import split_s_attention  # noqa: E402
from pdllm.kernels.split_s_reference import split_s_attention_reference  # noqa: E402

PAGE, DTYPE = 64, torch.bfloat16


@dataclass(frozen=True)
class Cell:
    name: str
    entries: tuple[tuple[int, tuple[int, ...]], ...]  # (query rows, chunk token counts) per entry
    holed: bool  # chunks end mid-page: page_fill for both sides


def grid_cell(b: int, lq: int, s: int, c: int) -> Cell:
    return Cell(f"B{b} Lq{lq} S{s} C{c}", ((lq, (c,) * s),) * b, c % PAGE != 0)


def ragged_cell(n: int, rows: tuple[int, int], kv: tuple[int, int], seed: int) -> Cell:
    """``n`` entries; rows and KV tokens drawn uniformly, the KV cut into 2-16 chunks of random length."""
    rnd, entries = random.Random(seed), []
    for _ in range(n):
        total, k = rnd.randint(*kv), rnd.randint(2, 16)
        cuts = sorted(rnd.sample(range(1, total), k - 1))
        entries.append((rnd.randint(*rows), tuple(b - a for a, b in zip([0, *cuts], [*cuts, total]))))
    return Cell(f"ragged {n} x Lq {rows[0]}-{rows[1]}, KV {kv[0]}-{kv[1]}", tuple(entries), True)


RAGGED = [ragged_cell(16, (8, 280), (4096, 32768), 0), ragged_cell(32, (8, 64), (4096, 16384), 1),
          ragged_cell(64, (8, 96), (4096, 8192), 2)]  # fmt: skip


class Case:
    """R copies of a scattered pool (chunks page-aligned, holes random), scratch pages for local K/V."""

    def __init__(self, cell: Cell, reps: int) -> None:
        g, dev = torch.Generator(device="cuda").manual_seed(0), "cuda"
        rows = [r for r, _ in cell.entries]
        chunk_pages = [[-(-t // PAGE) for t in lens] for _, lens in cell.entries]
        scratch_n = [-(-r // PAGE) for r in rows]
        n_pages = sum(map(sum, chunk_pages)) + sum(scratch_n)
        perm = torch.randperm(n_pages, generator=g, device=dev).tolist()
        width = max(sum(p) for p in chunk_pages)
        table = torch.zeros(len(rows), max(1, width), dtype=torch.int32)
        fill = torch.zeros_like(table)
        scratch = torch.zeros(len(rows), max(scratch_n), dtype=torch.int32)
        for b, (_, lens) in enumerate(cell.entries):
            col = 0
            for t, n in zip(lens, chunk_pages[b], strict=True):
                table[b, col : col + n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
                fill[b, col : col + n] = PAGE
                fill[b, col + n - 1] = t - (n - 1) * PAGE
                col += n
            ids = [perm.pop() for _ in range(scratch_n[b])]
            scratch[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        self.table, self.scratch = table.to(dev), scratch.to(dev)
        self.fill = fill.to(dev) if cell.holed else None
        pages = [sum(p) for p in chunk_pages]
        tokens = [sum(lens) for _, lens in cell.entries]
        lens = [p * PAGE for p in pages] if cell.holed else tokens  # holed: slots, holes included
        self.kv_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        offs = [0, *torch.tensor(rows).cumsum(0).tolist()]
        self.q_offsets = torch.tensor(offs, dtype=torch.int32, device=dev)
        self.sizes = {"max_q_len": max(rows), "max_kv_len": int(self.kv_lens.max())}
        rnd = lambda *s: torch.randn(*s, device=dev, dtype=DTYPE, generator=g)  # noqa: E731
        self.q = rnd(sum(rows), HQ, D)
        self.copies = [(rnd(2, n_pages, HKV, PAGE, D), rnd(2, sum(rows), HKV, D)) for _ in range(reps)]
        self.kv_bytes = sum(tokens) * HKV * D * 2 * 2
        self.plan = fa.plan_decode(self.table, self.kv_lens, self.q_offsets, PAGE, self.fill, self.scratch)

    def split_s(self, i: int, lse: torch.Tensor | None = None) -> torch.Tensor:
        pool, local = self.copies[i]
        return split_s_attention(self.q, pool[0], pool[1], self.table, self.kv_lens, self.q_offsets, local[0],
                                 local[1], page_fill=self.fill, lse_out=lse, **self.sizes)  # fmt: skip

    def flashinfer(self, i: int, w: object, merge: str, lse: torch.Tensor | None = None) -> torch.Tensor:
        pool, local = self.copies[i]
        return fa.attend(self.q, pool[0], pool[1], self.plan, w, local[0], local[1], lse, merge)

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        pool, local = self.copies[0]
        lse = torch.empty(self.q.shape[:2], dtype=torch.float32, device=self.q.device)
        out = split_s_attention_reference(self.q, pool[0], pool[1], self.table, self.kv_lens, self.q_offsets,
                                          local[0], local[1], page_fill=self.fill, lse_out=lse)  # fmt: skip
        return out, lse


class Wrappers:
    """One planned wrapper per backend and cell; the first plan of a backend compiles it (timed)."""

    def __init__(self) -> None:
        self.compile_s: dict[str, float] = {}
        self.workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def get(self, backend: str, case: Case) -> object:
        t0 = time.monotonic()
        w = fa.make_wrapper(case.plan, HQ, HKV, D, DTYPE, backend, self.workspace)
        self.compile_s.setdefault(backend, round(time.monotonic() - t0, 1))
        return w


def measure(
    fn: Callable[[int, torch.Tensor | None], torch.Tensor], case: Case, ref: tuple | None, target_s: float
) -> dict:
    """Error vs the reference (output and natural-log LSE; ``ref`` None: none) then µs per call; a failure
    is recorded as the entry's ``error``."""
    row: dict = {}
    try:
        if ref is not None:
            lse = torch.empty(case.q.shape[:2], dtype=torch.float32, device="cuda")
            out = fn(0, lse).float()
            diff = (out - ref[0].float()).abs()
            row.update(max_abs_err=float(diff.max()), rel_err=float(diff.norm() / ref[0].float().norm()),
                       lse_max_abs_err=float((lse - ref[1]).abs().max()), finite=bool(torch.isfinite(out).all()))  # fmt: skip
        us, mode = time_us(lambda: [fn(i, None) for i in range(len(case.copies))], reps=20, target_s=target_s)
        row.update(us=us / len(case.copies), timing=mode)
    except Exception as err:  # noqa: BLE001 - recorded per implementation, the run goes on
        row.update(
            error=f"{type(err).__name__}: {str(err)[:400]}", trace=traceback.format_exc(limit=4)[-1200:]
        )
    return row


def backend_impls(backend: str, case: Case, ref: tuple, wrappers: Wrappers, a: argparse.Namespace) -> dict:
    """One backend's entries: per merge the whole path, and for fa3 its call alone (``fa3_kernel``)."""
    try:
        w = wrappers.get(backend, case)
    except Exception as err:  # noqa: BLE001 - recorded, the other backends go on
        return {backend: {"error": f"plan: {type(err).__name__}: {str(err)[:400]}"}}
    out = {}
    for merge in a.merges.split(","):
        name = backend if merge == "torch" else f"{backend}+{merge}_merge"
        out[name] = measure(lambda i, lse, m=merge: case.flashinfer(i, w, m, lse), case, ref, a.target_s)
        out[name]["backend"] = getattr(w, "_backend", backend)  # what "auto" resolved to
    if backend == "fa3":
        qe = case.q.index_select(0, case.plan.q_index)
        pools = [pool for pool, _ in case.copies]
        kernel = lambda i, lse: w.run(qe, (pools[i][0], pools[i][1]), return_lse=True)[0]  # noqa: E731
        out["fa3_kernel"] = measure(kernel, case, None, a.target_s)
    return out


def run_cell(cell: Cell, wrappers: Wrappers, a: argparse.Namespace) -> dict:
    tokens = sum(t for _, lens in cell.entries for t in lens)
    reps = max(1, min(16, math.ceil(200e6 / (tokens * HKV * D * 4))))
    row: dict = {"cell": cell.name, "batch": len(cell.entries), "rows": [r for r, _ in cell.entries],
                 "chunks": [list(lens) for _, lens in cell.entries], "holed": cell.holed, "replicas": reps,
                 "impls": {}}  # fmt: skip
    try:
        case = Case(cell, reps)
        ref = case.reference()
    except Exception as err:  # noqa: BLE001 - a cell that cannot be built is recorded
        row["error"] = f"{type(err).__name__}: {str(err)[:400]}"
        return row
    row.update(
        kv_bytes=case.kv_bytes, segments=case.plan.num_segments, max_segments=case.plan.merge_index.shape[1]
    )
    impls = row["impls"]
    impls["split_s"] = measure(case.split_s, case, ref, a.target_s)
    for backend in a.backends.split(","):
        impls.update(backend_impls(backend, case, ref, wrappers, a))
    base, err0 = impls["split_s"].get("us"), impls["split_s"].get("rel_err", 5e-3)
    for name, r in impls.items():
        if base and "us" in r:
            r["ratio_vs_split_s"] = r["us"] / base
        if "rel_err" in r and name != "split_s":
            r["ok"] = r["finite"] and r["rel_err"] <= max(2 * err0, 1e-2)
    return row


def _fmt(x: object, spec: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown(meta: dict, rows: list[dict], skipped: list[str]) -> str:
    names = [n for n in dict.fromkeys(k for r in rows for k in r["impls"]) if n != "split_s"]
    lines = [f"# FlashInfer paged prefill vs split-S ({meta['device']})", "",
             f"{meta['date']}, `{meta['command']}`; torch {meta['torch']}, flashinfer {meta['flashinfer']}, "
             f"{meta['nvcc']}; bf16, {HQ}/{HKV} heads, d = {D}, page {PAGE}. JIT compile s: {meta['compile_s']}.",
             "", "| cell | KV MB | segments | split-S µs | " + " | ".join(f"{n} µs (x split-S)" for n in names)
             + " | rel err split-S / " + " / ".join(names) + " | ok |", "|" + "---|" * (6 + len(names))]  # fmt: skip
    for r in rows:
        im = r["impls"]
        cells = [f"{_fmt(im[n].get('us'))} ({_fmt(im[n].get('ratio_vs_split_s'), '.2f')})" if n in im else "-"
                 for n in names]  # fmt: skip
        errs = " / ".join(_fmt(im.get(n, {}).get("rel_err"), ".1e") for n in ["split_s", *names])
        oks = "/".join(str(im[n]["ok"]) for n in names if "ok" in im.get(n, {}))
        lines.append(f"| {r['cell']} | {_fmt(r.get('kv_bytes', 0) / 1e6)} | {r.get('segments', '-')} | "
                     f"{_fmt(im.get('split_s', {}).get('us'))} | " + " | ".join(cells) + f" | {errs} | {oks} |")  # fmt: skip
    errors = [(r["cell"], n, e["error"]) for r in rows for n, e in r["impls"].items() if "error" in e]
    errors += [(r["cell"], "cell", r["error"]) for r in rows if "error" in r]
    if errors:
        lines += ["", "Errors:", ""] + [f"- {c}, {n}: {e}" for c, n, e in errors]
    if skipped:
        lines += ["", "Skipped: " + "; ".join(skipped)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--budget-s", type=float, default=300.0, help="start no cell after this many seconds")
    ap.add_argument("--target-s", type=float, default=0.2, help="timing seconds per implementation and cell")
    ap.add_argument("--backends", default="fa3,fa2,auto", help="FlashInfer prefill backends, in order")
    ap.add_argument("--merges", default="torch", help="merges per backend: torch, flashinfer (merge_states)")
    ap.add_argument("--cells", default="table,ragged,grid", help="which cells, in order: table, ragged, grid")
    ap.add_argument("--max-call-ms", type=float, default=12.0, help="skip grid cells predicted slower")
    ap.add_argument("--mem-gb", type=float, default=30.0, help="skip grid cells whose pool copies need more")
    a = ap.parse_args(argv)
    if not fa.available():
        lacking = "CUDA" if not torch.cuda.is_available() else "flashinfer (site/ of the carry tarball)"
        print(
            f"flashinfer_ab needs CUDA and flashinfer; here no {lacking}, see the docstring", file=sys.stderr
        )
        return 2
    fi = fa.import_flashinfer()
    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    meta = {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join(["python", *sys.argv]), "torch": torch.__version__,
            "flashinfer": fi.__version__, "nvcc": nvcc[-1] if nvcc else "nvcc not found"}  # fmt: skip
    opts = DecodeOptions(20, math.nan, math.nan, mem_gb=a.mem_gb, max_call_ms=a.max_call_ms)
    table, grid = grid_shapes(DTYPE)[:5], grid_shapes(DTYPE)[5:]
    cells: list[Cell | str] = []
    for part in a.cells.split(","):
        shapes = {"table": table, "grid": grid}.get(part)
        if part == "ragged":
            cells += RAGGED
        for sh in shapes or []:
            reason = skip_reason(sh, DTYPE, opts)
            cells.append(grid_cell(*sh) if reason is None else f"{grid_cell(*sh).name} ({reason})")
    wrappers, rows, t0 = Wrappers(), [], time.monotonic()
    skipped = [c for c in cells if isinstance(c, str)]
    a.out.mkdir(parents=True, exist_ok=True)
    for cell in (c for c in cells if isinstance(c, Cell)):
        if rows and time.monotonic() - t0 > a.budget_s:  # the first cell always runs (and compiles)
            skipped.append(f"{cell.name} (time budget)")
            continue
        rows.append(run_cell(cell, wrappers, a))
        torch.cuda.empty_cache()
        meta.update(compile_s=wrappers.compile_s, wall_s=round(time.monotonic() - t0, 1))
        im = rows[-1]["impls"]
        print(f"{cell.name}: " + "  ".join(f"{n}={_fmt(e.get('us'))}{' ERR' if 'error' in e else ''}"
                                           for n, e in im.items()), flush=True)  # fmt: skip
        report = {"meta": meta, "cells": rows, "skipped": skipped}
        (a.out / "flashinfer_ab.json").write_text(json.dumps(report, indent=1, default=str))
        (a.out / "flashinfer_ab.md").write_text(markdown(meta, rows, skipped))
    print((a.out / "flashinfer_ab.md").read_text() if rows else "no cell ran")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
