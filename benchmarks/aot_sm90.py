"""Offline sm_90 register / shared-memory study of the split-S kernels: no GPU needed.

Compiles each config for sm_90 (Hopper) with the Triton in ``--triton-path`` (else the installed one),
reads registers, spills and shared memory from the cubin, and writes ``aot_sm90.json`` / ``aot_sm90.md``
under ``--out`` with the occupancy each config allows. A config that fails to compile is a recorded row::

    python benchmarks/aot_sm90.py --triton-path /tmp/t36/site --out benchmarks/results
    python benchmarks/aot_sm90.py --smoke --out /tmp/aot        # one small case per kernel
    python benchmarks/aot_sm90.py --configs cases.json --out /tmp/aot

Occupancy (sm_90): 65536 registers per SM, allocated per warp in units of 256 (a thread's count rounded up
to 8); 64 warps and 32 programs per SM; 228 KB of shared memory per SM, 227 KB per program, plus 1 KB the
runtime reserves per program.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.aot_sm90_cases import PRESETS, build_cases  # noqa: E402

WORKER = Path(__file__).with_name("aot_sm90_worker.py")
REGS_PER_SM = 65536
WARPS_PER_SM = 64
PROGRAMS_PER_SM = 32
SMEM_PER_SM = 228 * 1024
SMEM_PER_PROGRAM = 227 * 1024
SMEM_RESERVED = 1024


def occupancy(regs: int, num_warps: int, smem: int) -> dict:
    """Programs per SM allowed by registers, by shared memory (``smem``: one program's bytes) and both."""
    per_warp = math.ceil(regs * 32 / 256) * 256
    by_regs = min(REGS_PER_SM // per_warp // num_warps, WARPS_PER_SM // num_warps, PROGRAMS_PER_SM)
    need = smem + SMEM_RESERVED
    by_smem = SMEM_PER_SM // need if smem <= SMEM_PER_PROGRAM else 0
    return {"progs_by_regs": by_regs, "progs_by_smem": min(by_smem, PROGRAMS_PER_SM),
            "progs_per_sm": min(by_regs, by_smem, PROGRAMS_PER_SM)}  # fmt: skip


def _worker_env(triton_path: str | None) -> dict:
    env = dict(os.environ)
    if triton_path:
        # PYTHONPATH entries precede site-packages, so this Triton shadows the installed one in the worker only.
        env["PYTHONPATH"] = os.pathsep.join([triton_path, *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_cases(cases: list[dict], triton_path: str | None, timeout_s: float = 600.0) -> dict[str, dict]:
    """Compile ``cases`` in worker subprocesses; returns a record per case id (``ok`` False on failure).

    A worker that dies mid-case (an assertion in Triton's C++ passes aborts the process) is restarted on
    the cases after it, and the dead case is recorded with the worker's last stderr lines.
    """
    results: dict[str, dict] = {}
    todo = list(cases)
    while todo:
        try:
            p = subprocess.run(
                [sys.executable, str(WORKER)], input=json.dumps(todo), capture_output=True, text=True,
                env=_worker_env(triton_path), timeout=timeout_s,
            )  # fmt: skip
            out, err, rc = p.stdout, p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
            err, rc = f"worker timed out after {timeout_s:.0f} s", -1
        started = None
        for line in out.splitlines():
            if line.startswith("START "):
                started = line[6:]
            elif line.startswith("RESULT "):
                rec = json.loads(line[7:])
                results[rec["id"]] = rec
        ids = [c["id"] for c in todo]
        if all(i in results for i in ids):
            break
        tail = " | ".join(err.strip().splitlines()[-4:])[-500:]
        # The case the worker was on when it died (else the first one it never reached).
        dead = (
            started if started in ids and started not in results else next(i for i in ids if i not in results)
        )
        results[dead] = {"id": dead, "ok": False, "triton": None, "error": f"worker exited {rc}: {tail}"}
        if started is None:  # died before compiling anything: the same would happen to every case
            for i in ids:
                results.setdefault(i, dict(results[dead], id=i))
        todo = [c for c in todo if c["id"] not in results]
    return results


def table_rows(cases: list[dict], results: dict[str, dict]) -> list[dict]:
    """One flat row per case: its config, the compile record and the occupancy columns."""
    rows = []
    for c in cases:
        rec = results[c["id"]]
        row = {k: v for k, v in c.items() if k not in ("keep_ir",)}
        row.update({k: v for k, v in rec.items() if k != "ir"})
        if rec.get("ok"):
            row["smem"] = rec["dyn_smem"] + rec["static_smem"]
            row.update(occupancy(rec["regs"], c["num_warps"], row["smem"]))
            row["warps_per_sm"] = row["progs_per_sm"] * c["num_warps"]
        rows.append(row)
    return rows


def _cfg(row: dict) -> str:
    k = row["constexprs"]
    if row["kernel"] == "merge":
        return f"R{k['BLOCK_R']}"
    tile = f"{k['BLOCK_M']}x{k['BLOCK_N']}"
    flags = [n.lower() for n in ("HAS_LOCAL", "SINGLE", "FUSED", "HAS_FILL", "ROW_LSE") if k.get(n)]
    if row["kernel"] == "hopper_ws":
        flags.append("auto")
    elif row["kernel"] == "hopper":
        flags.append("tma" if k.get("USE_TMA") else "plain")
    return tile + (" " + ",".join(flags) if flags else "")


def _ws_cell(row: dict) -> str:
    """``ttg.warp_specialize`` in the TTGIR, with the consumers' / producer's ``setmaxnreg`` requests."""
    if not row.get("warp_specialized"):
        return "no"
    return f"yes ({row['setmaxnreg']})" if row.get("setmaxnreg") else "yes"


def write_outputs(out: Path, rows: list[dict], meta: dict) -> None:
    """``aot_sm90.json`` (meta + rows) and ``aot_sm90.md`` (one table row per case) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "aot_sm90.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    head = ["set", "kernel", "config", "warps", "stages", "maxnreg", "triton", "regs", "spill st/ld B",
            "smem KB", "progs/SM regs", "progs/SM smem", "progs/SM", "wgmma", "warp spec.", "note"]  # fmt: skip
    lines = [
        "# Offline sm_90 compiles of the split-S kernels",
        "",
        f"{meta['date']}, `{meta['command']}`; Triton {meta['tritons']} (column `triton`: the one that compiled"
        " the row), target `cuda:90` (sm_90a), bf16 unless the config says otherwise, no GPU involved.",
        "Programs per SM: registers 65536 / (regs rounded up to 8 x 32 x warps), shared memory 228 KB /"
        " (dynamic + static + 1 KB reserved); the lower of the two.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        if r.get("ok"):
            sp = f"{r['spill_stores']}/{r['spill_loads']}" if r["spill_stores"] is not None else "?"
            vals = [r["regs"], sp, f"{r['smem'] / 1024:.1f}", r["progs_by_regs"], r["progs_by_smem"],
                    r["progs_per_sm"], "yes" if r["uses_wgmma"] else "no", _ws_cell(r), r.get("note", "")]  # fmt: skip
        else:
            vals = ["-"] * 8 + [" ".join(("FAILED: " + r["error"]).replace("|", "/").split())[:160]]
        cells = [r["set"], r["kernel"], _cfg(r), r["num_warps"], r["num_stages"], r.get("maxnreg") or "",
                 r.get("triton") or "?", *vals]  # fmt: skip
        lines.append("| " + " | ".join(str(v) for v in cells) + " |")
    (out / "aot_sm90.md").write_text("\n".join(lines) + "\n")


def dump_ir(out: Path, cases: list[dict], results: dict[str, dict]) -> None:
    """Write the kept TTGIR / LLVM IR / PTX of ``keep_ir`` cases under ``out/aot_sm90_ir``."""
    for c in cases:
        ir = results[c["id"]].get("ir")
        if ir:
            d = out / "aot_sm90_ir"
            d.mkdir(parents=True, exist_ok=True)
            for name, text in ir.items():
                (d / f"{c['id']}.{name}").write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--triton-path", default=None, help="a directory holding the Triton package to compile with"
    )
    ap.add_argument("--presets", default="tuned,batch1,sweep,probe,cap,hopper",
                    help=f"comma-separated sets of configs, of {sorted(PRESETS)}")  # fmt: skip
    ap.add_argument("--configs", type=Path, default=None, help="a JSON list of cases instead of the presets")
    ap.add_argument("--smoke", action="store_true", help="the 'smoke' preset only (a few small cases)")
    ap.add_argument("--keep-ir", default="", help="comma-separated case ids whose TTGIR/LLIR/PTX to write")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="per worker process")
    a = ap.parse_args(argv)
    if a.configs is not None:
        cases = build_cases([], json.loads(a.configs.read_text()))
    else:
        cases = build_cases(["smoke"] if a.smoke else a.presets.split(","))
    keep = set(filter(None, a.keep_ir.split(",")))
    for c in cases:
        c["keep_ir"] = c["id"] in keep
    results = run_cases(cases, a.triton_path, a.timeout_s)
    rows = table_rows(cases, results)
    versions = sorted({str(r.get("triton")) for r in rows if r.get("triton")})
    meta = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python", "benchmarks/aot_sm90.py", *map(shlex.quote, argv or sys.argv[1:])]),
        "triton_path": a.triton_path,
        "tritons": ", ".join(versions) or "none",
        "target": "cuda:90",
    }
    write_outputs(a.out, rows, meta)
    dump_ir(a.out, cases, results)
    ok = sum(bool(r.get("ok")) for r in rows)
    print(f"{ok} of {len(rows)} configs compiled (Triton {meta['tritons']}) -> {a.out}/aot_sm90.{{json,md}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
