"""A/B at decode shapes: cuDNN SDPA over paged K/V vs our split-S kernel vs torch SDPA on gathered keys.

    python benchmarks/cudnn_paged_ab.py --out benchmarks/results    # CUDA (cudnn-frontend from .whl/)
    python benchmarks/cudnn_paged_ab.py --smoke --out /tmp/x         # CPU: lists what would run, exits 0

Per cell (uniform batch: B requests of Lq query rows and KV pool tokens each; bf16, 28/4 heads, d 128, page 64,
scale 1/sqrt(d), no causal mask), R copies of a page pool, each request's pages scattered by a random
permutation, R so that one replay reads >= 200 MB (K/V from HBM, not L2); µs per call = replay time / R:

- ``split_s``: our launcher, ``config=None``, pool + each request's local K/V (as the decode rounds call it);
- ``split_s_nolocal``: the same over the pool only (``k_local = v_local = None``): cuDNN's like-for-like peer;
- ``cudnn_paged``: cudnn-frontend SDPA forward (``is_inference``), Q/O strided views of the packed rows, K/V
  the page pools with per-request page tables, padding mask with per-request lengths;
  ``cudnn_paged_stats``: the same graph built with ``generate_stats=True`` (its LSE checked as well);
- ``sdpa_default`` / ``sdpa_<backend>``: torch SDPA with ``enable_gqa`` on gathered contiguous [B, H, L, D]
  pool keys (gathered before timing), default choice and each backend forced; ``sdpa_<backend>_rep``: K/V
  repeated to 28 heads, tried where the backend refused the GQA call.

Correctness: max abs error vs an fp32 attention over the gathered pool keys (+ local keys for ``split_s``),
``ok`` when < 2e-2. Timing: CUDA-graph replay (split_s_tuner.graph_time_us), else eager CUDA events (median
of 20), the method recorded per implementation. One failing implementation or cell is recorded, never fatal;
no cell starts after ``--budget-s``. Writes cudnn_paged_ab.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.attention import time_us  # noqa: E402
from benchmarks.harness import write_report  # noqa: E402
from pdllm.kernels.split_s_tuner import call_cost, graph_time_us  # noqa: E402

HQ, HKV, D, PAGE = 28, 4, 128, 64
G = HQ // HKV
OK_TOL = 2e-2
CELLS = [(1, 32, 4096), (4, 96, 1024), (4, 96, 16384), (16, 96, 4096), (16, 96, 32768), (64, 96, 4096),
         (16, 32, 32768), (1, 96, 16384)]  # fmt: skip
BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
IMPLS = ["split_s", "split_s_nolocal", "cudnn_paged", "cudnn_paged_stats", "sdpa_default",
         *(f"sdpa_{b}" for b in BACKENDS)]  # fmt: skip
_CUDNN: dict = {}  # "mod", "handle", "lib" once loaded; "error" if the import or handle failed


def load_cudnn() -> dict:
    """Import the cuDNN frontend against the libcudnn torch already loaded (else torch's wheel copy)."""
    if _CUDNN:
        return _CUDNN
    try:
        torch.backends.cudnn.version()  # make torch load its libcudnn
        maps = [line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if line.split()]
        lib = next((m for m in maps if os.path.basename(m).startswith("libcudnn.so")), None)
        libdir = Path(lib).parent if lib else Path(torch.__file__).resolve().parents[1] / "nvidia/cudnn/lib"
        if libdir.is_dir():  # the frontend dlopens libcudnn.so.9 from LD_LIBRARY_PATH first
            os.environ["LD_LIBRARY_PATH"] = f"{libdir}{os.pathsep}{os.environ.get('LD_LIBRARY_PATH', '')}"
        import cudnn

        _CUDNN.update(mod=cudnn, lib=str(libdir), handle=cudnn.create_handle())
    except Exception as err:  # noqa: BLE001 - recorded; the other implementations still run
        _CUDNN["error"] = f"{type(err).__name__}: {str(err)[:400]}"
    return _CUDNN


class Case:
    """R copies of a scattered page pool (+ local K/V) for one uniform cell; q shared by all copies."""

    def __init__(self, batch: int, lq: int, kv: int, reps: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(0)
        rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        self.batch, self.lq, self.kv, self.t = batch, lq, kv, batch * lq
        n_pages = batch * kv // PAGE
        self.q = rnd(self.t, HQ, D)
        self.kv_lens = torch.full((batch,), kv, dtype=torch.int32, device="cuda")
        self.offsets = torch.arange(0, self.t + 1, lq, dtype=torch.int32, device="cuda")
        self.copies = []
        for _ in range(reps):
            pool = rnd(2, n_pages, HKV, PAGE, D)
            table = torch.randperm(n_pages, device="cuda", generator=g).to(torch.int32).view(batch, -1)
            self.copies.append((pool, table, rnd(2, self.t, HKV, D)))

    def gathered(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy ``i``'s pool keys/values as contiguous [B, Hkv, KV, D], each request's pages in table order."""
        pool, table, _ = self.copies[i]
        kv = pool[:, table.long()].permute(0, 1, 3, 2, 4, 5).reshape(2, self.batch, HKV, self.kv, D)
        return kv[0], kv[1]

    def reference(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 attention of copy 0, packed [T, Hq, D]: over the pool keys, over pool + local keys; and the
        pool-only natural-log LSE [T, Hq]. One request at a time (scores stay small)."""
        local = self.copies[0][2].float()
        pool_out = torch.empty(self.t, HQ, D, device="cuda")
        local_out, lse = torch.empty_like(pool_out), torch.empty(self.t, HQ, device="cuda")
        for b in range(self.batch):
            rows = slice(b * self.lq, (b + 1) * self.lq)
            qb = (
                self.q[rows].float().view(self.lq, HKV, G, D).permute(1, 2, 0, 3).reshape(HKV, G * self.lq, D)
            )
            kb, vb = k[b].float(), v[b].float()
            for out, with_local in ((pool_out, False), (local_out, True)):
                if with_local:
                    kb = torch.cat([kb, local[0, rows].transpose(0, 1)], 1)
                    vb = torch.cat([vb, local[1, rows].transpose(0, 1)], 1)
                s = qb @ kb.transpose(1, 2) * D**-0.5
                out[rows] = (
                    (torch.softmax(s, -1) @ vb).view(HKV, G, self.lq, D).permute(2, 0, 1, 3).flatten(1, 2)
                )
                if not with_local:
                    lse[rows] = torch.logsumexp(s, -1).view(HKV, G, self.lq).permute(2, 0, 1).flatten(1)
        return pool_out, local_out, lse


def measure(make: Callable[[int], Callable[[], torch.Tensor]], reps: int, ref: torch.Tensor,
            unpack: Callable[[torch.Tensor], torch.Tensor] = lambda o: o) -> dict:  # fmt: skip
    """Check copy 0's output against ``ref``, then time all ``reps`` copies per replay; failures recorded."""
    row: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = unpack(make(0)()).float()
            torch.cuda.synchronize()
            err = float((out - ref).abs().max())
            row.update(max_abs_err=err, ok=err < OK_TOL)
            fns = [make(i) for i in range(reps)]
            run = lambda: [f() for f in fns]  # noqa: E731
            try:
                row.update(us=graph_time_us(run, max_reps=30) / reps, timing="graph")
            except Exception as err:  # noqa: BLE001 - capture refused: time eagerly, and say so
                row["timing"] = f"eager (graph: {type(err).__name__}: {str(err)[:160]})"
                torch.cuda.synchronize()
                row["us"] = time_us(run, 20, graph=False)[0] / reps
        except Exception as err:  # noqa: BLE001 - recorded per implementation, the run goes on
            row["error"] = f"{type(err).__name__}: {str(err)[:400]}"
            row["trace"] = traceback.format_exc(limit=4)[-1000:]
    if "error" in row and caught:
        row["warnings"] = [str(w.message)[:300] for w in caught[:4]]
    return row


def cudnn_make(case: Case, stats: bool) -> tuple[Callable[[int], Callable[[], torch.Tensor]], dict]:
    """Build the paged SDPA graph once; ``make(i)`` runs it on copy ``i`` (same q, O and LSE buffers)."""
    cd, b, lq = _CUDNN, case.batch, case.lq
    cudnn, handle = cd["mod"], cd["handle"]
    q4 = case.q.view(b, lq, HQ, D).transpose(1, 2)  # [B, Hq, Lq, D], strides [Lq*Hq*D, D, Hq*D, 1]
    o = torch.empty_like(case.q)
    o4 = o.view(b, lq, HQ, D).transpose(1, 2)
    lse = torch.empty(b, HQ, lq, 1, dtype=torch.float32, device="cuda")
    seq_q = torch.full((b, 1, 1, 1), lq, dtype=torch.int32, device="cuda")
    seq_kv = torch.full((b, 1, 1, 1), case.kv, dtype=torch.int32, device="cuda")
    pool0, table0, _ = case.copies[0]
    gr = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                       compute_data_type=cudnn.data_type.FLOAT, handle=handle)  # fmt: skip
    tq, tk, tv = gr.tensor_like(q4), gr.tensor_like(pool0[0]), gr.tensor_like(pool0[1])
    t4 = table0.view(b, 1, -1, 1)
    tpk, tpv = gr.tensor_like(t4), gr.tensor_like(t4)
    tsq, tskv = gr.tensor_like(seq_q), gr.tensor_like(seq_kv)
    mode = {"generate_stats": True} if stats else {"is_inference": True}
    to, tst = gr.sdpa(name="sdpa", q=tq, k=tk, v=tv, attn_scale=D**-0.5, use_causal_mask=False,
                      use_padding_mask=True, seq_len_q=tsq, seq_len_kv=tskv, paged_attention_k_table=tpk,
                      paged_attention_v_table=tpv, paged_attention_max_seq_len_kv=case.kv, **mode)  # fmt: skip
    to.set_output(True).set_dim(list(o4.shape)).set_stride(list(o4.stride()))
    if stats:
        tst.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        tst.set_dim(list(lse.shape)).set_stride(list(lse.stride()))
    gr.validate()
    gr.build_operation_graph()
    gr.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    gr.check_support()
    gr.build_plans()
    ws = torch.empty(max(1, gr.get_workspace_size()), dtype=torch.uint8, device="cuda")
    info: dict = {"workspace_bytes": ws.numel(), "lse": lse if stats else None}
    try:
        info["plan"] = gr.get_plan_name_at_index(getattr(gr, "_plan_index", 0))
    except Exception as err:  # noqa: BLE001 - informational only
        info["plan"] = f"? ({type(err).__name__})"

    def make(i: int) -> Callable[[], torch.Tensor]:
        pool, table, _ = case.copies[i]
        tt = table.view(b, 1, -1, 1)
        pack = {tq: q4, tk: pool[0], tv: pool[1], tpk: tt, tpv: tt, tsq: seq_q, tskv: seq_kv, to: o4}
        if stats:
            pack[tst] = lse

        def run() -> torch.Tensor:
            # the handle runs on whatever stream torch runs on now (the capture stream inside graph_time_us)
            cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
            gr.execute(pack, ws, handle=handle)
            return o

        return run

    return make, info


def sdpa_call(q4: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: object, gqa: bool) -> Callable:
    from torch.nn.attention import sdpa_kernel

    f = torch.nn.functional.scaled_dot_product_attention
    if backend is None:
        return lambda: f(q4, k, v, enable_gqa=gqa)

    def run() -> torch.Tensor:
        with sdpa_kernel(backend):
            return f(q4, k, v, enable_gqa=gqa)

    return run


def run_cell(batch: int, lq: int, kv: int) -> dict:
    from torch.nn.attention import SDPBackend

    from pdllm.kernels.split_s_attention import split_s_attention
    from pdllm.kernels.split_s_tuning import config_to_dict, select_config

    reps = max(1, min(16, math.ceil(200e6 / call_cost(batch, lq, HQ, HKV, D, kv, 2)[1])))
    row: dict = {"cell": f"B{batch} Lq{lq} KV{kv}", "batch": batch, "lq": lq, "kv": kv, "replicas": reps}
    impls: dict = {}
    row["impls"] = impls
    try:
        case = Case(batch, lq, kv, reps)
        gathered = [case.gathered(i) for i in range(reps)]
        ref_pool, ref_local, ref_lse = case.reference(*gathered[0])
        for key, total in (("split_s_config", kv + lq), ("split_s_nolocal_config", kv)):
            sel = select_config(torch.device("cuda"), torch.bfloat16, lq * G, total, batch * HKV, D, PAGE)
            row[key] = {"source": sel.source, **(config_to_dict(sel.config) if sel.config else {})}
    except Exception as err:  # noqa: BLE001 - a cell that cannot be built is recorded
        row["error"] = f"{type(err).__name__}: {str(err)[:400]}"
        return row

    def ours(local: bool) -> Callable[[int], Callable[[], torch.Tensor]]:
        def make(i: int) -> Callable[[], torch.Tensor]:
            pool, table, loc = case.copies[i]
            kl, vl = (loc[0], loc[1]) if local else (None, None)
            return lambda: split_s_attention(case.q, pool[0], pool[1], table, case.kv_lens, case.offsets, kl, vl,
                                             max_q_len=lq, max_kv_len=kv)  # fmt: skip

        return make

    impls["split_s"] = measure(ours(True), reps, ref_local)
    impls["split_s_nolocal"] = measure(ours(False), reps, ref_pool)
    for name, stats in (("cudnn_paged", False), ("cudnn_paged_stats", True)):
        if "error" in load_cudnn():
            impls[name] = {"error": f"import cudnn: {_CUDNN['error']}"}
            continue
        try:
            make, info = cudnn_make(case, stats)
        except Exception as err:  # noqa: BLE001 - a graph cuDNN refuses is a result
            impls[name] = {"error": f"build: {type(err).__name__}: {str(err)[:400]}"}
            continue
        lse = info.pop("lse")
        impls[name] = {**measure(make, reps, ref_pool), **info}
        if lse is not None and "max_abs_err" in impls[name]:
            try:  # timing left the last copy's LSE there: rerun copy 0
                make(0)()
                got = lse[..., 0].permute(0, 2, 1).reshape(case.t, HQ)
                impls[name]["lse_max_abs_err"] = float((got - ref_lse).abs().max())
            except Exception as err:  # noqa: BLE001 - recorded
                impls[name]["lse_error"] = f"{type(err).__name__}: {str(err)[:200]}"
        del make
    q4 = case.q.view(batch, lq, HQ, D).transpose(1, 2).contiguous()
    unpack = lambda o: o.transpose(1, 2).reshape(case.t, HQ, D)  # noqa: E731
    impls["sdpa_default"] = measure(lambda i: sdpa_call(q4, *gathered[i], None, True), reps, ref_pool, unpack)
    try:
        names = {int(v): k for k, v in SDPBackend.__members__.items()}
        impls["sdpa_default"]["backend"] = names.get(
            int(torch._fused_sdp_choice(q4, *gathered[0], enable_gqa=True))
        )
    except Exception as err:  # noqa: BLE001 - a private torch call: informational only
        impls["sdpa_default"]["backend"] = f"? ({type(err).__name__})"
    repeated: list = []
    for short, enum_name in BACKENDS.items():
        be = getattr(SDPBackend, enum_name)
        impls[f"sdpa_{short}"] = measure(
            lambda i, be=be: sdpa_call(q4, *gathered[i], be, True), reps, ref_pool, unpack
        )
        if "error" in impls[f"sdpa_{short}"]:  # refused with GQA: K/V repeated to Hq heads
            repeated = repeated or [(k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)) for k, v in gathered]  # fmt: skip
            rep_fn = lambda i, be=be, kv=repeated: sdpa_call(q4, *kv[i], be, False)  # noqa: E731
            impls[f"sdpa_{short}_rep"] = measure(rep_fn, reps, ref_pool, unpack)
    us = {n: r.get("us") for n, r in impls.items()}
    if us.get("cudnn_paged") and us.get("split_s_nolocal"):
        row["cudnn_over_nolocal"] = us["cudnn_paged"] / us["split_s_nolocal"]
    if us.get("sdpa_default") and us.get("split_s"):
        row["sdpa_default_over_split_s"] = us["sdpa_default"] / us["split_s"]
    backends = {n: u for n, u in us.items() if n.startswith("sdpa_") and n != "sdpa_default" and u}
    row["fastest_sdpa"] = min(backends, key=backends.get) if backends else None
    return row


def _f(x: object, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(meta: dict, rows: list[dict], skipped: list[str]) -> str:
    lines = [f"# cuDNN paged SDPA vs split-S vs torch SDPA on gathered keys ({meta['device']})", "",
             f"{meta['date']}, `{meta['command']}`; torch {meta['torch']} (its cuDNN {meta['torch_cudnn']}), "
             f"triton {meta['triton']}, cudnn-frontend {meta['cudnn_frontend']} (backend {meta['cudnn_backend']})"
             f". bf16, {HQ}/{HKV} heads, d = {D}, page {PAGE}, µs per call (R copies per replay, K/V from HBM).",
             "", "cuDNN sees the pool keys only (no local keys), so it is compared with `split_s_nolocal`; "
             "`sdpa_*` run on gathered contiguous pool keys (no local, the gather not timed). A backend value "
             "marked `rep` ran with K/V repeated to 28 heads (it refused `enable_gqa`).", "",
             "| cell | R | split_s | nolocal | cudnn | cudnn+stats | sdpa default (backend) | flash | efficient "
             "| cudnn sdpa | cudnn/nolocal | default/split_s | fastest sdpa | cudnn timing | not ok (max abs err) |",
             "|" + "---|" * 15]  # fmt: skip
    for r in rows:
        k = r["impls"]
        us = lambda n, k=k: _f(k.get(n, {}).get("us"))  # noqa: E731

        def be(short: str, k: dict = k) -> str:
            if k.get(f"sdpa_{short}", {}).get("us") is None and f"sdpa_{short}_rep" in k:
                return f"{_f(k[f'sdpa_{short}_rep'].get('us'))} rep"
            return _f(k.get(f"sdpa_{short}", {}).get("us"))

        bad = [f"{n} ({_f(e.get('max_abs_err'), '.1e')})" for n, e in k.items() if e.get("ok") is False]
        lines.append(f"| {r['cell']} | {r['replicas']} | {us('split_s')} | {us('split_s_nolocal')} | "
                     f"{us('cudnn_paged')} | {us('cudnn_paged_stats')} | {us('sdpa_default')} "
                     f"({k.get('sdpa_default', {}).get('backend', '-')}) | {be('flash')} | {be('efficient')} | "
                     f"{be('cudnn')} | {_f(r.get('cudnn_over_nolocal'), '.2f')} | "
                     f"{_f(r.get('sdpa_default_over_split_s'), '.2f')} | {r.get('fastest_sdpa') or '-'} | "
                     f"{k.get('cudnn_paged', {}).get('timing', '-')} | {', '.join(bad) or '-'} |")  # fmt: skip
    errors = [(r["cell"], n, e["error"] + (f" (`{n}_rep` ran instead)" if f"{n}_rep" in r["impls"] else ""))
              for r in rows for n, e in r["impls"].items() if "error" in e]  # fmt: skip
    errors += [(r["cell"], "cell", r["error"]) for r in rows if "error" in r]
    if errors:
        lines += ["", "Errors:", ""] + [f"- {c}, {n}: {e}" for c, n, e in errors]
    plans = sorted({f"{n}: {e['plan']}" for r in rows for n, e in r["impls"].items() if "plan" in e})
    lse = [f"{r['cell']} {_f(r['impls'].get('cudnn_paged_stats', {}).get('lse_max_abs_err'), '.1e')}"
           for r in rows]  # fmt: skip
    lines += [
        "",
        f"cuDNN plans: {'; '.join(plans) or '-'}.",
        f"cuDNN stats (LSE) max abs err: {', '.join(lse)}.",
    ]
    if skipped:
        lines += ["", f"Skipped (time budget): {', '.join(skipped)}"]
    return "\n".join(lines) + "\n"


def write(out: Path, meta: dict, rows: list[dict], skipped: list[str]) -> None:
    write_report(
        out,
        "cudnn_paged_ab",
        {"meta": meta, "cells": rows, "skipped": skipped},
        markdown(meta, rows, skipped),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--smoke", action="store_true", help="CPU: list what would run and exit")
    ap.add_argument("--budget-s", type=float, default=150.0, help="start no cell after this many seconds")
    a = ap.parse_args(argv)
    cells = [f"B{b} Lq{lq} KV{kv}" for b, lq, kv in CELLS]
    if a.smoke or not torch.cuda.is_available():
        print(f"CUDA needed (smoke={a.smoke}, cuda={torch.cuda.is_available()}): nothing timed. On a GPU this "
              f"would time {', '.join(IMPLS)} (+ sdpa_<backend>_rep where GQA is refused) on cells "
              f"{'; '.join(cells)} and write cudnn_paged_ab.{{json,md}} under {a.out}.")  # fmt: skip
        return 0
    import triton

    cd = load_cudnn()
    cudnn = cd.get("mod")
    meta = {
        "device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]), "torch": torch.__version__, "triton": triton.__version__,
        "torch_cudnn": torch.backends.cudnn.version(),
        "cudnn_frontend": getattr(cudnn, "__version__", None) if cudnn else f"import failed: {cd.get('error')}",
        "cudnn_backend": cudnn.backend_version() if cudnn else None, "cudnn_lib": cd.get("lib"),
    }  # fmt: skip
    t0, rows, skipped = time.monotonic(), [], []
    for (b, lq, kv), name in zip(CELLS, cells):
        if rows and time.monotonic() - t0 > a.budget_s:  # the first cell always runs
            skipped.append(name)
            continue
        rows.append(run_cell(b, lq, kv))
        torch.cuda.empty_cache()
        r = rows[-1]
        print(f"{name}: " + "  ".join(f"{n}={_f(e.get('us'))}{' ERR' if 'error' in e else ''}"
                                      for n, e in r["impls"].items())
              + f"  cudnn/nolocal={_f(r.get('cudnn_over_nolocal'), '.2f')}{'  CELL ERR' * ('error' in r)}",
              flush=True)  # fmt: skip
        write(a.out, meta, rows, skipped)  # after every cell, so a killed run keeps what it measured
    meta["wall_s"] = round(time.monotonic() - t0, 1)
    write(a.out, meta, rows, skipped)
    print((a.out / "cudnn_paged_ab.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
