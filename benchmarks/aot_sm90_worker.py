"""Compile split-S kernels for sm_90 without a GPU and report their resource use (one JSON line per case).

Run by :mod:`aot_sm90` in a subprocess whose ``sys.path`` starts with the Triton to test, so the compiling
Triton may differ from the one the repository imports. Reads a JSON list of cases on stdin; for each prints
``START <id>`` and then one ``RESULT <json>`` line, flushed, so the parent can tell which case a hard crash
(an MLIR assertion aborts the process) belongs to.

Resources come from the compiled cubin (``cuobjdump -res-usage``: registers, stack, static shared memory) and
from ``ptxas -v`` on the same PTX (spill stores/loads), both the tools of the compiling Triton; dynamic shared
memory is Triton's ``metadata.shared``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

# The kernels' pointer arguments and their element types (the rest are i32 strides/sizes or constexprs).
_MAIN_PTRS = {
    "Q": "act", "KP": "act", "VP": "act", "KL": "act", "VL": "act", "OUT": "act",
    "PT": "*i32", "PF": "*i32", "KVL": "*i32", "QO": "*i32", "CNT": "*i32",
    "OP": "*fp32", "LSE": "*fp32", "RLSE": "*fp32", "qk_scale": "fp32",
}  # fmt: skip
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# Integer arguments that are not multiples of 16 at the benchmark's shapes (the LSE token stride is Hq = 28;
# split counts and row counts vary). Every other pointer and integer is, so it gets the divisibility hint
# the JIT attaches at launch; without the hint alignment is unknown, the K/V loads cannot go through
# cp.async and the kernel compiles to a different (register-staged, unpipelined) loop.
_NOT_ALIGNED = {"s_lst", "n_split", "n_rows"}


def _kernel(name: str) -> object:
    """The JIT function a case names: ``split_s`` (main), ``merge``, ``hopper`` (the ``tma``/``plain``
    kernel) or ``hopper_ws`` (mode ``auto``'s all-TMA, warp-specialized kernel)."""
    if name == "hopper":
        from pdllm.kernels import split_s_hopper_tma as tma

        return tma._split_s_hopper_kernel
    if name == "hopper_ws":
        from pdllm.kernels import split_s_hopper_ws as ws

        return ws._split_s_ws_kernel
    from pdllm.kernels import split_s_attention as mod

    return mod._merge_kernel if name == "merge" else mod._split_s_kernel


def _descriptor_boxes(fn_name: str, const: dict) -> dict[str, list[int]]:
    """Block shapes of the host ``TensorDescriptor`` arguments the launcher passes (see
    ``split_s_hopper_ws.ws_descriptors`` and ``split_s_hopper_tma.launch_pointer_q``)."""
    bm, bn, d = const.get("BLOCK_M"), const.get("BLOCK_N"), const.get("D")
    if fn_name == "_split_s_ws_kernel":
        gp = const["GP"]
        # Without local K/V the pool's descriptors stand in for the local ones.
        local = [bn, 1, d] if const["HAS_LOCAL"] else [1, bn, d]
        return {"QD": [bm // gp, gp, d], "KD": [1, bn, d], "VD": [1, bn, d], "KLD": local, "VLD": local}
    if fn_name == "_split_s_hopper_kernel" and const.get("USE_TMA"):
        return {"KD": [bn, d], "VD": [bn, d]}
    return {}  # plain mode passes the pool tensors as KD/VD


def _signature(fn: object, case: dict) -> tuple[dict, dict, dict]:
    """Triton signature, constexpr values and divisibility attributes for ``fn`` from a case, as the JIT
    specializes a launch: pointers and integers (bar ``_NOT_ALIGNED``) divisible by 16; host tensor
    descriptors typed ``tensordesc<dtype[box]>`` with no hint (the JIT attaches none to them)."""
    act = "*" + _DTYPES[case["dtype"]]
    const = dict(case["constexprs"])
    boxes = _descriptor_boxes(fn.__name__, const)
    sig: dict[str, str] = {}
    for n in fn.arg_names:
        if n in const:
            sig[n] = "constexpr"
        elif n in boxes:
            sig[n] = f"tensordesc<{act[1:]}{boxes[n]}>"
        else:
            t = _MAIN_PTRS.get(n, "act" if n in ("KD", "VD") else "i32")
            if n == "OP" and case.get("partials") == "act":  # SplitSConfig.partials_16bit
                t = "act"
            sig[n] = act if t == "act" else t
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(fn.arg_names)
        if sig[n] == "i32" and n not in _NOT_ALIGNED or sig[n].startswith("*")
    }
    return sig, const, attrs


def _tool(name: str) -> str:
    """Path of a CUDA tool shipped with the compiling Triton (``ptxas`` as Triton itself picks it)."""
    from triton.backends.nvidia import compiler

    if name == "ptxas":
        return compiler.get_ptxas(90).path
    return os.path.join(os.path.dirname(compiler.__file__), "bin", name)


def _res_usage(cubin: bytes, fn_name: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True
        ).stdout
    m = re.search(
        rf"Function {re.escape(fn_name)}:\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text
    )
    if m is None:
        raise RuntimeError(f"cuobjdump -res-usage gave no resource line: {text[-300:]!r}")
    regs, stack, shared, local = (int(x) for x in m.groups())
    return {"regs": regs, "stack": stack, "static_smem": shared, "local": local}


def _spills(ptx: str, maxnreg: int | None) -> dict:
    """Spill bytes from ``ptxas -v`` on the kernel's PTX (sm_90a, as Triton assembles it); None if it fails."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [_tool("ptxas"), "-v", "--gpu-name", "sm_90a", src, "-o", os.path.join(d, "k.cubin")]
        if maxnreg:
            cmd[1:1] = ["--maxrregcount", str(maxnreg)]
        r = subprocess.run(cmd, capture_output=True, text=True)
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stdout + r.stderr)
    if m is None:
        return {"spill_stores": None, "spill_loads": None}
    return {"spill_stores": int(m.group(1)), "spill_loads": int(m.group(2))}


def _ptx_counts(ptx: str) -> dict:
    """Instruction counts that explain the register budget (static counts in the PTX, not executed)."""
    pats = {
        "wgmma": r"wgmma\.mma_async", "mma_sync": r"\bmma\.sync", "cp_async": r"cp\.async\.(?:ca|cg)",
        "tma": r"cp\.async\.bulk\.tensor", "ld_global": r"\bld\.global", "ex2": r"ex2\.approx",
        "ld_local": r"\bld\.local", "st_local": r"\bst\.local",
    }  # fmt: skip
    counts = {k: len(re.findall(p, ptx)) for k, p in pats.items()}
    # Warp specialization re-balances registers: consumers ask for more (inc), the producer gives back (dec).
    regs = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)
    counts["setmaxnreg"] = " ".join(sorted({f"{op} {n}" for op, n in regs}))
    return counts


def compile_case(case: dict) -> dict:
    """Compile one case for sm_90 and return its resource record (raises on a compile failure)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _kernel(case["kernel"])
    sig, const, attrs = _signature(fn, case)
    opts = {"num_warps": case["num_warps"], "num_stages": case["num_stages"]}
    if case.get("maxnreg"):
        opts["maxnreg"] = case["maxnreg"]
    t0 = time.monotonic()
    k = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=opts)
    seconds = time.monotonic() - t0
    ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
    rec = {"compile_s": round(seconds, 2), "dyn_smem": int(k.metadata.shared)}
    rec.update(_res_usage(k.asm["cubin"], k.metadata.name))
    rec.update(_spills(ptx, case.get("maxnreg")))
    rec.update(_ptx_counts(ptx))
    rec["uses_wgmma"] = rec["wgmma"] > 0 or "warp_group_dot" in ttgir
    rec["warp_specialized"] = "ttg.warp_specialize" in ttgir
    if case.get("keep_ir"):
        rec["ir"] = {n: k.asm[n] for n in ("ttgir", "llir", "ptx")}
    return rec


def main() -> int:
    cases = json.load(sys.stdin)
    try:
        import triton

        version = triton.__version__
    except Exception as e:  # noqa: BLE001 - any import failure is the answer for every case
        version = None
        err = f"{type(e).__name__}: {e}"
    for case in cases:
        print(f"START {case['id']}", flush=True)
        rec = {"id": case["id"], "triton": version}
        if version is None:
            rec.update(ok=False, error=f"cannot import triton: {err}")
        else:
            try:
                rec.update(compile_case(case), ok=True)
            except Exception as e:  # noqa: BLE001 - recorded per case, the rest still compile
                msg = " ".join(str(e).split())  # the cause is at the end of Triton's messages: keep both ends
                msg = msg if len(msg) <= 500 else msg[:150] + " ... " + msg[-350:]
                rec.update(ok=False, error=f"{type(e).__name__}: {msg}")
        print("RESULT " + json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
