"""Config lists for :mod:`aot_sm90`: the launcher's mapping from a split-S call to kernel constexprs.

A case is a JSON-able dict: ``id``, ``set`` (which list it came from), ``kernel`` (``split_s``, ``merge`` or
``hopper`` for the Hopper variant's ``tma``/``plain`` kernel, ``hopper_ws`` for its ``auto`` kernel), ``dtype``, ``constexprs`` (every constexpr of the kernel), ``num_warps``, ``num_stages``,
optional ``maxnreg`` (ptxas register cap) and ``note``. Shapes are Dream-7B's as ``benchmarks/attention.py``
runs them: 28 query / 4 KV heads, head dim 128, bf16, page 64, local K/V present (``HAS_LOCAL``), no
holed pages (``HAS_FILL`` off: the serving path), no ``lse_out``.
"""

from __future__ import annotations

import itertools

from pdllm.kernels.split_s_attention import MERGE_UNROLLED_ROWS
from pdllm.kernels.split_s_hopper_ws import group_pad
from pdllm.kernels.split_s_reference import SplitSConfig, plan_splits
from pdllm.kernels.split_s_tuning import ShapeBucket, _lookup, load_table

HQ, HKV, D, PAGE = 28, 4, 128, 64
DEVICE = "NVIDIA H100 80GB HBM3"  # the tuned table's entries the GPU runs
NUM_SMS = 132
MERGE_BLOCK_R, MERGE_WARPS, MERGE_STAGES = 16, 4, 3  # the launcher's merge launch (Triton's default stages)
# (batch, Lq, S, C) of benchmarks/attention.py: its five-shape table and its grid.
SHAPES = sorted(
    {(1, 32, 4, 1024), (8, 32, 8, 1024), (32, 32, 4, 1024), (1, 256, 16, 2048), (32, 96, 16, 2048)}
    | set(itertools.product((1, 4, 16, 64), (32, 96), (4, 16, 64), (256, 1024, 2048)))
)
BATCH1 = (1, 32, 4, 1024)


def main_case(
    set_: str, bm: int, bn: int, warps: int, stages: int, *, local: bool = True, single: bool = False,
    fused: bool = False, fill: bool = False, maxnreg: int | None = None, dtype: str = "bfloat16", note: str = "",
    row_lse: bool = False, partials_16bit: bool = False,
) -> dict:  # fmt: skip
    """The main split-S kernel as :func:`~pdllm.kernels.split_s_attention._launch` compiles it
    (``partials_16bit``: ``SplitSConfig.partials_16bit``, the partials in the input dtype)."""
    const = dict(G=HQ // HKV, HKV=HKV, D=D, PAGE=PAGE, BLOCK_M=bm, BLOCK_N=bn, HAS_LOCAL=local,
                 HAS_FILL=fill, SINGLE=single, FUSED=fused and not single,
                 PRECISION="ieee" if dtype == "float32" else "tf32", ROW_LSE=row_lse)  # fmt: skip
    case = _case(set_, "split_s", const, warps, stages, maxnreg, dtype, note)
    return case | ({"partials": "act"} if partials_16bit else {})


def merge_case(set_: str, block_r: int = MERGE_BLOCK_R, warps: int = MERGE_WARPS, note: str = "",
               partials_16bit: bool = False, nsp: int = 0) -> dict:  # fmt: skip
    """The separate split merge (launched whenever a call has more than one split and no fused merge);
    ``nsp`` > 0: its loop over splits unrolled to ``nsp`` (``NSP``), 0: rolled."""
    const = dict(BLOCK_R=block_r, D=D, ROW_LSE=False, NSP=nsp)
    case = _case(set_, "merge", const, warps, MERGE_STAGES, None, "bfloat16", note)
    return case | ({"partials": "act"} if partials_16bit else {})


def hopper_case(
    set_: str, bm: int, bn: int, warps: int, stages: int, mode: str, span: int = 8, *, fill: bool = False,
    row_lse: bool = False, note: str = "",
) -> dict:  # fmt: skip
    """The Hopper variant as :func:`~pdllm.kernels.split_s_hopper._launch` compiles it for ``mode``:
    ``auto`` the all-TMA kernel (``hopper_ws``, ``WS`` on), ``tma``/``plain`` the pointer-Q kernel
    (``hopper``, ``WS`` off). ``span`` = SPAN, the pages one split touches rounded up to a power of two
    (8 for the batch-1 splits of 320 tokens); ``fill`` = holed pages (``page_fill``), which ``tma`` never
    takes; ``row_lse`` = an ``lse_out`` tensor."""
    if mode not in ("auto", "tma", "plain"):
        raise ValueError(f"mode must be auto, tma or plain, got {mode!r}")
    const = dict(G=HQ // HKV, HKV=HKV, D=D, PAGE=PAGE, BLOCK_M=bm, BLOCK_N=bn, HAS_LOCAL=True, HAS_FILL=fill,
                 SINGLE=False, PRECISION="tf32", ROW_LSE=row_lse)  # fmt: skip
    if mode == "auto":
        const.update(GP=group_pad(HQ // HKV), WS=True, SPAN=span)
        kernel = "hopper_ws"
    else:
        const.update(USE_TMA=mode == "tma", WS=False, SPAN=span)
        kernel = "hopper"
    return _case(set_, kernel, const, warps, stages, None, "bfloat16", note or mode)


def _case(set_: str, kernel: str, const: dict, warps: int, stages: int, maxnreg: int | None, dtype: str,
          note: str) -> dict:  # fmt: skip
    return {"set": set_, "kernel": kernel, "dtype": dtype, "constexprs": const, "num_warps": warps,
            "num_stages": stages, "maxnreg": maxnreg, "note": note}  # fmt: skip


def _selected(shape: tuple[int, int, int, int]) -> tuple[SplitSConfig, bool]:
    """The config the launcher picks for ``shape`` on the H100 (table, else heuristic) and whether it is
    a single-split call. Shared-memory fitting is skipped: every table config fits sm_90's 227 KB."""
    b, lq, s, c = shape
    bucket = ShapeBucket.of(lq * HQ // HKV, s * c + lq, b * HKV, D, PAGE, "bfloat16")
    cfg = _lookup(load_table(), DEVICE, bucket).config
    plan = plan_splits(s * c + lq, b, HKV, lq * HQ // HKV, cfg, NUM_SMS)
    return cfg, plan.num_splits == 1


def tuned() -> list[dict]:
    """The distinct main-kernel compiles the launcher makes over the benchmark's shapes, plus the merge."""
    seen: dict[tuple, list[tuple[int, int, int, int]]] = {}
    for shape in SHAPES:
        cfg, single = _selected(shape)
        key = (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, single, cfg.fused_merge,
               cfg.maxnreg or 0, cfg.partials_16bit)  # fmt: skip
        seen.setdefault(key, []).append(shape)
    out = []
    for (bm, bn, w, st, single, fused, cap, p16), shapes in sorted(seen.items()):
        lqs = sorted({sh[1] for sh in shapes})
        note = f"{len(shapes)} shapes, Lq {'/'.join(map(str, lqs))}"
        out.append(main_case("tuned", bm, bn, w, st, single=single, fused=fused, maxnreg=cap or None,
                             partials_16bit=p16, note=note))  # fmt: skip
    return out + [merge_case("tuned", note="every multi-split call: rolled (more than 32 splits)"),
                  merge_case("tuned", MERGE_UNROLLED_ROWS, nsp=16, note="every multi-split call: unrolled (9-16 splits)")]  # fmt: skip


def batch1() -> list[dict]:
    """Batch 1, Lq 32, S 4, C 1024: its selected config, the merge, and its fused / one-split variants."""
    cfg, single = _selected(BATCH1)
    bm, bn, w, st = cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages
    b, lq, s, c = BATCH1
    splits = plan_splits(s * c + lq, b, HKV, lq * HQ // HKV, cfg, NUM_SMS).num_splits
    return [
        main_case("batch1", bm, bn, w, st, single=single, note="selected"),
        merge_case(
            "batch1",
            MERGE_UNROLLED_ROWS,
            nsp=1 << (splits - 1).bit_length(),
            note=f"selected: {splits} splits, unrolled",
        ),  # fmt: skip
        merge_case("batch1", note="rolled"),
        main_case("batch1", bm, bn, w, st, fused=True, note="fused merge"),
        main_case("batch1", bm, bn, w, st, single=True, note="one split (no partials)"),
        main_case("batch1", 32, bn, 2, st, note="32-row blocks, 2 warps"),
        main_case("batch1", 16, bn, 2, st, note="16-row blocks, 2 warps"),
        main_case("batch1", bm, bn, w, st, single=single, partials_16bit=True, note="16-bit partials"),
        merge_case("batch1", partials_16bit=True, note="16-bit partials"),
        main_case(
            "batch1", bm, bn, w, st, fused=True, partials_16bit=True, note="fused merge, 16-bit partials"
        ),
    ]


def sweep() -> list[dict]:
    """Tiles x warps x stages around the tuned configs (local K/V, several splits)."""
    out = [
        main_case("sweep", bm, bn, w, st)
        for bm, bn, w, st in itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
    ]
    return out + [main_case("sweep", bm, 64, 2, st) for bm in (16, 32) for st in (2, 3)]


def probe() -> list[dict]:
    """One constexpr or compile option at a time on the two tuned tiles: what moves the register count."""
    out = []
    for bm in (64, 128):
        out += [
            main_case("probe", bm, 64, 4, 2, local=False, note="no local K/V loop"),
            main_case("probe", bm, 64, 4, 2, fill=True, note="holed pages: no unmasked loop"),
            main_case("probe", bm, 64, 4, 2, local=False, fill=True, note="one masked loop only"),
            main_case("probe", bm, 64, 4, 2, single=True, note="one split: bf16 output, no partials"),
            main_case("probe", bm, 64, 4, 2, fused=True, note="fused merge"),
            main_case("probe", bm, 64, 4, 2, dtype="float16", note="fp16"),
            main_case("probe", bm, 64, 4, 2, maxnreg=168, note="ptxas cap: 3 programs/SM"),
            main_case("probe", bm, 64, 4, 2, maxnreg=128, note="ptxas cap: 4 programs/SM"),
        ]
    return out


def cap() -> list[dict]:
    """Configs that can reach 3+ programs per SM: one stage (no cp.async double buffer), or a ptxas cap."""
    return [
        main_case("cap", 64, 64, 4, 1, note="one stage: 48 KB"),
        main_case("cap", 64, 64, 4, 1, maxnreg=168),
        main_case("cap", 64, 32, 4, 2, maxnreg=168),
        main_case("cap", 64, 32, 4, 3, maxnreg=168),
        main_case("cap", 64, 32, 4, 2, maxnreg=128),
        main_case("cap", 64, 64, 8, 2, maxnreg=128, note="2 x 8 warps"),
        main_case("cap", 128, 64, 8, 2, maxnreg=168),
        main_case("cap", 128, 64, 4, 1, note="one stage"),
        main_case("cap", 32, 32, 4, 2, maxnreg=128),
    ]


def hopper() -> list[dict]:
    """The Hopper variant's three modes against today's kernel at Dream-7B's 64x64, 4 warps: 1/2/3 stages,
    with and without holed pages, with and without the row LSE (``tma`` never takes holed pages)."""
    out = []
    for st, fill, lse in itertools.product((1, 2, 3), (False, True), (False, True)):
        flags = ", ".join(n for n, on in (("holes", fill), ("row LSE", lse)) if on)
        out.append(main_case("hopper", 64, 64, 4, st, fill=fill, row_lse=lse, note=f"today {flags}".strip()))
        for mode in ("auto", "tma", "plain") if not fill else ("auto", "plain"):
            out.append(hopper_case("hopper", 64, 64, 4, st, mode, fill=fill, row_lse=lse,
                                   note=f"{mode} {flags}".strip()))  # fmt: skip
    return out


def smoke() -> list[dict]:
    """Two small cases, quick to compile: the merge and a 16x32 two-warp main kernel."""
    return [merge_case("smoke"), main_case("smoke", 16, 32, 2, 1, local=False)]


PRESETS = {
    "tuned": tuned,
    "batch1": batch1,
    "sweep": sweep,
    "probe": probe,
    "cap": cap,
    "hopper": hopper,
    "smoke": smoke,
}


def from_spec(spec: dict) -> dict:
    """A case from a user's JSON entry: ``{"kernel": "split_s", "block_m", "block_n", "num_warps",
    "num_stages"}`` plus optional ``local``/``single``/``fused``/``fill``/``maxnreg``/``dtype``/``note``;
    ``merge`` takes ``block_r``/``num_warps``; ``hopper`` takes ``mode``/``span``/``fill``/``row_lse``; a raw ``constexprs`` dict
    is used as given."""
    spec = dict(spec)
    kernel = spec.pop("kernel", "split_s")
    if "constexprs" in spec:
        return _case(spec.get("set", "file"), kernel, spec["constexprs"], spec["num_warps"],
                     spec["num_stages"], spec.get("maxnreg"), spec.get("dtype", "bfloat16"), spec.get("note", ""))  # fmt: skip
    if kernel == "merge":
        return merge_case("file", spec.get("block_r", MERGE_BLOCK_R), spec.get("num_warps", MERGE_WARPS))
    args = (spec.pop("block_m"), spec.pop("block_n"), spec.pop("num_warps"), spec.pop("num_stages"))
    if kernel in ("hopper", "hopper_ws"):
        mode = spec.get("mode", "auto" if kernel == "hopper_ws" else "tma")
        return hopper_case("file", *args, mode, spec.get("span", 8), fill=spec.get("fill", False),
                           row_lse=spec.get("row_lse", False))  # fmt: skip
    return main_case("file", *args, **spec)


def build_cases(presets: list[str], specs: list[dict] | None = None) -> list[dict]:
    """Cases of the named presets (then ``specs``), each with a unique ``id`` (``<set>-<n>``)."""
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        raise SystemExit(f"unknown preset(s) {unknown}; choose from {sorted(PRESETS)}")
    cases = [c for p in presets for c in PRESETS[p]()] + [from_spec(s) for s in specs or []]
    for i, c in enumerate(cases):
        c["id"] = f"{c['set']}-{i:03d}"
    return cases
