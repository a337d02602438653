"""GPU correctness of every Triton kernel against its reference, per model shape and dtype; and the CLI on CUDA.

    python benchmarks/kernel_check.py --out $OUT                  # kernels (below), on the GPU machine
    python benchmarks/kernel_check.py --out $OUT --parts cli      # pdllm generate / demo / eval on CUDA
    TRITON_INTERPRET=1 python benchmarks/kernel_check.py --smoke --out /tmp/kc   # tiny shapes on CPU

Kernels, for the shipped model (``shared/checkpoints/pdllm-needle``) and Dream-7B's shapes, in float32,
bfloat16 and float16, each called as the model calls it (the launcher fits its config to the dtype and the
device's shared memory) and compared with its reference (``||out - ref|| / ||ref||``, tolerance per dtype):

- "model shapes": split-S attention, the skinny GEMMs (cuBLAS rows where :func:`pick_config` keeps it),
  RMSNorm (+ residual), RoPE, SiLU*up, chunk-prefill attention and retention scores;
- "model forward": the model's fused CUDA route against its eager ops (Dream-7B with 2 of its 28 layers);
- "forced limit": the same kernels with the shared-memory limit forced to 64 KB (tiles shrink) and 2 KB
  (nothing fits: the reference runs);
- "unfitted": bf16's configs launched raw in fp32 (Triton's verdict against the estimate);
- split-S configs forced explicitly (single split, fused merge, repeated for races).

Every row names the config that ran, the estimate and the compiled kernels' shared memory (Triton's
metadata), and whether a reference ran instead. Writes kernel_check.{json,md} (after every section).

The cli part runs ``pdllm generate --device cuda`` on the bundled document with no ``--dtype`` (float32)
and with bfloat16 and float16, ``pdllm demo`` on CUDA (the all-in-one server; float32 by default, then
bfloat16 and float16) and the smallest ``pdllm eval`` (float32); it records each answer against the planted
fact and any kernel fallback warnings, and writes cli_check.{json,md} plus one cli_<run>.log per run.
``--budget-s`` / ``--cli-budget-s`` bound each part's wall time (later sections / runs are listed as skipped).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import logging
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pdllm.kernels import resources
from pdllm.kernels import retention_scores as rs
from pdllm.kernels import rms_norm as rms_mod
from pdllm.kernels import rope as rope_mod
from pdllm.kernels import silu_mul as silu_mod
from pdllm.kernels import skinny_gemm as sg
from pdllm.kernels import split_s_attention as sa
from pdllm.kernels import split_s_tuning as st
from pdllm.kernels.chunk_prefill_attention import chunk_prefill_attention, chunk_prefill_attention_reference
from pdllm.kernels.paged_kv import PagedKVConfig, PagedKVPool
from pdllm.kernels.split_s_attention import SplitSConfig, naive_attention, split_s_attention_reference

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.shapes import build_model, dream7b, tiny  # noqa: E402

# bf16 operands with fp32 accumulation land between 1e-3 and 1e-2 relative error (METHOD.md).
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}
# A whole forward (fused kernels vs eager ops) compounds roundings over layers.
FORWARD_TOL = {torch.bfloat16: 5e-2, torch.float16: 1e-2, torch.float32: 1e-4}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FORCED_LIMITS = (64 * 1024, 2048)
# Where the launchers' shared-memory limit is read (patched for the "forced limit" section).
LIMIT_READERS = (st, sg, rs)
KERNELS = (
    (sa, "_split_s_kernel"), (sa, "_merge_kernel"), (sg, "_skinny_kernel"), (sg, "_sum_splits_kernel"),
    (rs, "_retention_kernel"), (rms_mod, "_rms_norm_kernel"), (rope_mod, "_rope_kernel"),
    (silu_mod, "_silu_mul_kernel"),
)  # fmt: skip


@dataclass
class Row:
    section: str
    model: str
    kernel: str
    case: str
    dtype: str
    config: str
    smem_est: int | None
    smem_actual: int | None  # the largest of the compiled kernels this call launched (None: unknown)
    path: str  # "triton", "reference" (a launcher's fallback), "cublas" (no skinny config), "raw"
    err: float
    tol: float
    ok: bool
    note: str = ""


# --- what each call launched ---------------------------------------------------------------------------------


@dataclass
class Launches:
    kernels: list[tuple[str, int | None]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


class _Recorder:
    """Wraps a Triton kernel: forwards every launch and notes the compiled kernel's shared memory."""

    def __init__(self, name: str, kernel: object, log: Launches) -> None:
        self.name, self.kernel, self.log = name, kernel, log

    def __getitem__(self, grid: tuple) -> Callable[..., object]:
        def launch(*args: object, **kw: object) -> object:
            compiled = self.kernel[grid](*args, **kw)
            meta = getattr(compiled, "metadata", None)
            self.log.kernels.append((self.name, getattr(meta, "shared", None)))
            return compiled

        return launch


class _Capture(logging.Handler):
    def __init__(self, log: Launches) -> None:
        super().__init__(logging.WARNING)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        self.log.warnings.append(record.getMessage())


LOG = Launches()


def install_recorders() -> None:
    for mod, name in KERNELS:
        if hasattr(mod, name) and not isinstance(getattr(mod, name), _Recorder):
            setattr(mod, name, _Recorder(name.strip("_"), getattr(mod, name), LOG))
    logging.getLogger("pdllm.kernels").addHandler(_Capture(LOG))


@contextlib.contextmanager
def recorded() -> Iterator[Launches]:
    LOG.kernels.clear()
    LOG.warnings.clear()
    out = Launches()
    try:
        yield out
    finally:
        out.kernels, out.warnings = list(LOG.kernels), list(LOG.warnings)


@contextlib.contextmanager
def forced_limit(limit: int) -> Iterator[None]:
    saved = [m.smem_limit for m in LIMIT_READERS]
    for m in LIMIT_READERS:
        m.smem_limit = lambda device, limit=limit: limit
    st.clear_caches()
    try:
        yield
    finally:
        for m, f in zip(LIMIT_READERS, saved):
            m.smem_limit = f
        st.clear_caches()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _path(rec: Launches) -> str:
    fell_back = any("reference" in w for w in rec.warnings) or not rec.kernels
    return "reference" if fell_back else "triton"


def _actual(rec: Launches) -> int | None:
    known = [s for _, s in rec.kernels if s is not None]
    return max(known) if known else None


def _row(section: str, model: str, kernel: str, case: str, dtype: torch.dtype, config: str, est: int | None,
         rec: Launches, err: float, tol: float, ok: bool | None = None, path: str | None = None) -> Row:  # fmt: skip
    actual = _actual(rec)
    path = path or _path(rec)
    ok = (math.isfinite(err) and err < tol) if ok is None else ok
    notes = [w for w in rec.warnings]
    if est is not None and actual is not None and actual > est:
        notes.append(f"estimate {est} < compiled {actual}")
    return Row(section, model, kernel, case, str(dtype).removeprefix("torch."), config, est, actual, path,
               err, tol, ok, "; ".join(notes))  # fmt: skip


def _cfg(c: object) -> str:
    if c is None:
        return "-"
    if isinstance(c, SplitSConfig):
        return f"bm={c.block_m} bn={c.block_n} w={c.num_warps} st={c.num_stages} fused={c.fused_merge}"
    if isinstance(c, sg.SkinnyConfig):
        return f"bn={c.block_n} bk={c.block_k} split={c.split} w={c.num_warps} st={c.num_stages}"
    return str(c)


# --- the model shapes -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shapes:
    name: str
    hidden: int
    inter: int
    hq: int
    hkv: int
    d: int
    chunk: int
    # (batch, lq, chunks per request, chunk tokens) of split-S calls this model makes
    split_s: tuple[tuple[int, int, int, int], ...]
    gemm_rows: tuple[int, ...] = (1, 40)  # row tiles 16 and 64


def model_shapes(smoke: bool) -> list[Shapes]:
    if smoke:
        t = tiny()
        return [Shapes("tiny", t.hidden_size, t.intermediate_size, t.num_heads, t.num_kv_heads, t.head_dim, 24,
                       ((2, 9, 2, 20),), (5, 40))]  # fmt: skip
    from pdllm.shared.model.loader import DEFAULT_MODEL_DIR, read_config

    s = read_config(DEFAULT_MODEL_DIR)
    dm = dream7b()
    return [
        Shapes("shipped", s.hidden_size, s.intermediate_size, s.num_heads, s.num_kv_heads, s.head_dim, 256,
               ((1, 40, 3, 256), (4, 64, 8, 256), (2, 280, 4, 1024), (1, 24, 48, 256))),
        Shapes("dream7b", dm.hidden_size, dm.intermediate_size, dm.num_heads, dm.num_kv_heads, dm.head_dim, 1024,
               ((1, 32, 4, 1024), (3, 96, 8, 512), (8, 256, 4, 2048), (2, 32, 16, 1024))),
    ]  # fmt: skip


def check_split_s(section: str, model: str, dev: str, dtype: torch.dtype, batch: int, lq: int, s: int, c: int,
                  hq: int, hkv: int, d: int, page: int, local: bool, cfg: SplitSConfig | None) -> Row:  # fmt: skip
    gen = torch.Generator(device="cpu").manual_seed(batch * 1000 + lq + s + c + d + page)
    chunk_tokens = [[c + 1 if (i + j) % 3 == 0 else c for j in range(s)] for i in range(batch)]  # some +BOS
    n_pages = sum(-(-t // page) for r in chunk_tokens for t in r)
    pool = PagedKVPool(PagedKVConfig(1, hkv, d, num_pages=n_pages, page_size=page, dtype=dtype, device=dev))
    perm = torch.randperm(n_pages, generator=gen).tolist()  # scatter the chunks over the pool
    pool.allocate(n_pages)
    pool.free(perm)
    reqs = [
        [pool.write_chunk(torch.randn(1, 2, hkv, t, d, generator=gen).to(dev, dtype)) for t in r]
        for r in chunk_tokens
    ]
    pt = pool.build_page_table(reqs)
    q_lens = [max(1, lq - 7 * i) for i in range(batch)]  # ragged
    total = sum(q_lens)
    offs = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(dev, dtype)  # noqa: E731
    q = rnd(total, hq, d)
    kl, vl = (rnd(total, hkv, d), rnd(total, hkv, d)) if local else (None, None)
    k_pages, v_pages = pool.layer(0)
    args = (q, k_pages, v_pages, pt.page_table, pt.kv_lens, offs, kl, vl, pt.page_fill)
    ran = cfg
    if cfg is None:
        max_total = int(pt.kv_lens.max()) + (max(q_lens) if local else 0)
        sel = st.select_config(
            torch.device(dev), dtype, max(q_lens) * (hq // hkv), max_total, batch * hkv, d, page
        )
        ran = sel.config
    with recorded() as rec:
        out = sa.split_s_attention(*args, config=cfg)
    ref = split_s_attention_reference(*args, config=cfg)
    naive = naive_attention(*args)
    e_ref, e_naive = _rel(out, ref), _rel(out, naive)
    ok = bool(torch.isfinite(out).all()) and e_ref < TOL[dtype] and e_naive < TOL[dtype]
    case = f"B={batch} Lq<={lq} S={s} C={c} Hq/Hkv={hq}/{hkv} d={d} page={page} local={local}"
    if cfg is not None:
        case += f" splits={cfg.num_splits} (explicit)"
    est = st.smem_estimate(ran, dtype, d) if ran is not None else None
    return _row(section, model, "split_s_attention", case, dtype, _cfg(ran), est, rec, max(e_ref, e_naive),
                TOL[dtype], ok)  # fmt: skip


def check_skinny(section: str, model: str, dev: str, dtype: torch.dtype, m: int, n: int, k: int, glu: bool,
                 given: sg.SkinnyConfig | None = None) -> Row:  # fmt: skip
    name = "skinny_silu_mul" if glu else "skinny_linear"
    case = f"M={m} N={n} K={k}" + (" (given bf16 config)" if given is not None else "")
    limit = sg.smem_limit(dev)  # the device's, or the forced one
    cfg = given or sg.pick_config(m, n, k, glu, dtype, limit)
    if cfg is None:
        return _row(section, model, name, case, dtype, "-", None, Launches(), 0.0, TOL[dtype], True, "cublas")
    gen = torch.Generator(device="cpu").manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to(dev, dtype)
    w = (torch.randn(2 * n if glu else n, k, generator=gen) / math.sqrt(k)).to(dev, dtype)
    with recorded() as rec:
        if glu:
            out = sg.skinny_silu_mul(x, w, cfg)
        else:
            res = torch.randn(m, n, generator=gen).to(dev, dtype)
            out = sg.skinny_linear(x, w, residual=res, config=cfg)
    if glu:
        ref = sg.skinny_silu_mul_reference(x.double(), w.double())
    else:
        ref = sg.skinny_linear_reference(x.double(), w.double(), residual=res.double())
    ran = sg.fit_config(cfg, m, dtype, glu, limit)  # what the launcher runs
    est = sg.smem_estimate(ran, m, dtype, glu) if ran is not None else None
    return _row(section, model, name, case, dtype, _cfg(ran), est, rec, _rel(out, ref), TOL[dtype])


def rope_inputs(gen: torch.Generator, hq: int, hk: int, t: int, d: int, dtype: torch.dtype) -> tuple:
    """q/k as the model makes them (``[B, T, H, D]`` memory viewed as ``[B, H, T, D]``), real cos/sin."""
    q = torch.randn(1, t, hq, d, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(1, t, hk, d, generator=gen).to(dtype).transpose(1, 2)
    pos = torch.randint(0, 32768, (1, t), generator=gen).float()
    freqs = pos[..., None] * (1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d)))
    emb = torch.cat([freqs, freqs], dim=-1)
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


def check_elementwise(section: str, model: str, dev: str, dtype: torch.dtype, sh: Shapes) -> list[Row]:
    gen = torch.Generator(device="cpu").manual_seed(7)
    rows = []
    for t in (40,):
        x, r = (torch.randn(t, sh.hidden, generator=gen).to(dev, dtype) for _ in range(2))
        w = (1 + 0.1 * torch.randn(sh.hidden, generator=gen)).to(dev, dtype)
        with recorded() as rec:
            got = rms_mod.rms_norm(x, w, 1e-6)
            got2, s2 = rms_mod.rms_norm(x, w, 1e-6, residual=r)
        want = rms_mod.rms_norm_reference(x, w, 1e-6)
        want2, ws2 = rms_mod.rms_norm_reference(x, w, 1e-6, residual=r)
        err = max(_rel(got, want), _rel(got2, want2), _rel(s2, ws2))
        rows.append(_row(section, model, "rms_norm", f"T={t} N={sh.hidden} (+residual)", dtype, "-", None, rec,
                         err, TOL[dtype]))  # fmt: skip
        q, k, cos, sin = (a.to(dev) for a in rope_inputs(gen, sh.hq, sh.hkv, t, sh.d, dtype))
        with recorded() as rec:
            oq, ok_ = rope_mod.apply_rope(q, k, cos, sin)
        wq, wk = rope_mod.apply_rope_reference(q, k, cos, sin)
        rows.append(_row(section, model, "rope", f"T={t} Hq/Hkv={sh.hq}/{sh.hkv} d={sh.d}", dtype, "-", None,
                         rec, max(_rel(oq, wq), _rel(ok_, wk)), TOL[dtype]))  # fmt: skip
        gu = (2 * torch.randn(t, 2 * sh.inter, generator=gen)).to(dev, dtype)
        with recorded() as rec:
            got = silu_mod.silu_mul_fused(gu)
        rows.append(_row(section, model, "silu_mul", f"T={t} I={sh.inter}", dtype, "-", None, rec,
                         _rel(got, silu_mod.silu_mul_fused_reference(gu)), TOL[dtype]))  # fmt: skip
    return rows


def check_prefill_and_retention(section: str, model: str, dev: str, dtype: torch.dtype, n: int, c: int, lq: int,
                                hq: int, hkv: int, d: int, causal: bool) -> list[Row]:  # fmt: skip
    gen = torch.Generator(device="cpu").manual_seed(n + c + lq + causal)
    lens = [c + lq - 3 * i for i in range(n)]
    total = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    q = torch.randn(total, hq, d, generator=gen).to(dev, dtype)
    k = torch.randn(total, hkv, d, generator=gen).to(dev, dtype)
    v = torch.randn(total, hkv, d, generator=gen).to(dev, dtype)
    out, lse = chunk_prefill_attention(q, k, v, cu, causal=causal, return_lse=True)
    ref, ref_lse = chunk_prefill_attention_reference(q, k, v, cu, causal=causal, return_lse=True)
    tag = f"N={n} C~{c} Lq={lq} Hq/Hkv={hq}/{hkv} d={d} causal={causal}"
    e = max(_rel(out, ref), _rel(lse, ref_lse))
    rows = [_row(section, model, "chunk_prefill_attention", tag, dtype, "(torch)", None, Launches(), e, TOL[dtype],
                 path="torch")]  # fmt: skip
    ql = torch.tensor([lq] * n, dtype=torch.int32, device=dev)
    limit = rs.smem_limit(dev)
    fitted = rs.fit_config(64, 64, dtype, d, limit)
    with recorded() as rec:
        got = rs.retention_scores(q, k, cu, ql, lse=lse, causal=causal)
    want = rs.retention_scores_reference(q, k, cu, ql, causal=causal)
    est = rs.smem_estimate(*fitted, dtype, d) if fitted else None
    cfg = f"bn={fitted[0]} bm={fitted[1]} st={fitted[2]}" if fitted else "-"
    rows.append(
        _row(section, model, "retention_scores", tag, dtype, cfg, est, rec, _rel(got, want), TOL[dtype])
    )
    return rows


def kernel_rows(section: str, sh: Shapes, dev: str, dtype: torch.dtype, smoke: bool) -> list[Row]:
    rows = []
    for i, (batch, lq, s, c) in enumerate(sh.split_s):
        for page, local in ((64, True), (16, False)) if i == 0 and not smoke else ((64, True),):
            rows.append(check_split_s(section, sh.name, dev, dtype, batch, lq, s, c, sh.hq, sh.hkv, sh.d, page,
                                      local, None))  # fmt: skip
    for m in sh.gemm_rows:
        rows.append(check_skinny(section, sh.name, dev, dtype, m, sh.inter, sh.hidden, True))
        rows.append(check_skinny(section, sh.name, dev, dtype, m, sh.hidden, sh.inter, False))
    # A caller that passes bf16's measured configs whatever the dtype: the launcher fits them.
    m = sh.gemm_rows[-1]
    rows.append(check_skinny(section, sh.name, dev, dtype, m, sh.inter, sh.hidden, True,
                             sg.SkinnyConfig(64 if sh.inter % 64 == 0 else 16, 128 if sh.hidden % 128 == 0 else 16,
                                             num_stages=4)))  # fmt: skip
    split = 2 if sh.inter >= 4 * sh.hidden and sh.inter % 256 == 0 else 1
    rows.append(check_skinny(section, sh.name, dev, dtype, m, sh.hidden, sh.inter, False,
                             sg.SkinnyConfig(64 if sh.hidden % 64 == 0 else 16, 128 if sh.inter % (128 * split) == 0
                                             else 16, split, num_stages=6)))  # fmt: skip
    rows += check_elementwise(section, sh.name, dev, dtype, sh)
    for causal in (False, True):
        rows += check_prefill_and_retention(section, sh.name, dev, dtype, 2 if smoke else 4, sh.chunk + 1,
                                            8 if smoke else 64, sh.hq, sh.hkv, sh.d, causal)  # fmt: skip
    return rows


def forward_rows(sh: Shapes, dev: str, dtype: torch.dtype) -> list[Row]:
    """The model's fused route (Triton kernels) against its eager ops, on random ids."""
    from pdllm.shared.model.loader import load_model

    if sh.name == "shipped":
        model = load_model(
            None, dtype=str(dtype).removeprefix("torch."), device=dev, load_tokenizer=False
        ).model
    else:
        cfg = dream7b() if sh.name == "dream7b" else tiny()
        model = build_model(dataclasses.replace(cfg, num_layers=2), torch.device(dev), dtype)
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(11)
    rows = []
    for b, t in ((1, 40), (1, 100)):  # a decode step's rows (skinny GEMMs), and more (cuBLAS)
        ids = torch.randint(4, vocab, (b, t), generator=gen).to(dev)
        with torch.no_grad():
            model.set_fused(True)
            with recorded() as rec:
                fused = model(ids)
            model.set_fused(False)
            eager = model(ids)
            model.set_fused(True)
        err = _rel(fused.float(), eager.float())
        names = sorted({n for n, _ in rec.kernels})
        path = "reference" if any("reference" in w for w in rec.warnings) else "triton" if names else "eager"
        rows.append(_row("model forward", sh.name, "DiffusionLM fused vs eager", f"B={b} T={t}", dtype,
                         ",".join(names) or "-", None, rec, err, FORWARD_TOL[dtype], path=path))  # fmt: skip
    del model
    if dev == "cuda":
        torch.cuda.empty_cache()
    return rows


def unfitted_rows(sh: Shapes, dev: str) -> list[Row]:
    """bf16's configs launched raw in fp32 (no fitting, no guard): does Triton agree with the estimate?"""
    rows = []
    limit = resources.smem_limit(dev)
    dtype = torch.float32
    gen = torch.Generator(device="cpu").manual_seed(3)
    cases = [(m, True, sg.SkinnyConfig(64, 128, 1, num_stages=4)) for m in (16, 40)]
    if sh.inter * sh.hidden >= 32 * 1024 * 1024:
        cases.append((40, False, sg.SkinnyConfig(64, 128, 2, num_stages=6)))
    for m, glu, cfg in cases:
        n, k = (sh.inter, sh.hidden) if glu else (sh.hidden, sh.inter)
        if n % cfg.block_n or k % (cfg.block_k * cfg.split):
            continue
        x = torch.randn(m, k, generator=gen).to(dev, dtype)
        w = (torch.randn(2 * n if glu else n, k, generator=gen) / math.sqrt(k)).to(dev, dtype)
        est = sg.smem_estimate(cfg, m, dtype, glu)
        refused, err, note = False, float("nan"), ""
        with recorded() as rec:
            try:
                out = sg._launch_kernel(x, w, n, None, None, glu, cfg)
                ref = (
                    sg.skinny_silu_mul_reference(x.double(), w.double())
                    if glu
                    else (x.double() @ w.double().T)
                )
                err = _rel(out, ref)
            except Exception as exc:  # noqa: BLE001 - recorded: Triton's verdict is the point of the row
                refused, note = resources.is_out_of_resources(exc), f"{type(exc).__name__}: {exc}"[:200]
        # The estimate may be stricter than Triton (it rejects), never laxer (accepts a config Triton refuses).
        ok = not (refused and est <= limit)
        row = _row("unfitted", sh.name, "skinny_silu_mul" if glu else "skinny_linear", f"M={m} N={n} K={k}", dtype,
                   _cfg(cfg), est, rec, err if not refused else 0.0, TOL[dtype], ok, "raw")  # fmt: skip
        row.note = "; ".join(filter(None, [f"limit {limit}, refused={refused}", note, row.note]))
        rows.append(row)
    return rows


def explicit_split_s_rows(dev: str, dtype: torch.dtype) -> list[Row]:
    """Split-S configs forced explicitly at Dream-7B shapes (single split, two splits, fused merge)."""
    rows = [
        check_split_s("explicit split-S", "hq32-d64", dev, dtype, 2, 64, 4, 1024, 32, 8, 64, 64, True, None),
        check_split_s("explicit split-S", "dream7b", dev, dtype, 1, 32, 4, 1024, 28, 4, 128, 64, True,
                      SplitSConfig(num_splits=1)),
        check_split_s("explicit split-S", "dream7b", dev, dtype, 1, 32, 1, 1, 28, 4, 128, 64, True,
                      SplitSConfig(num_splits=2)),
    ]  # fmt: skip
    for batch, lq, s, c in [(1, 32, 4, 1024), (3, 96, 8, 512), (2, 32, 16, 1024), (1, 256, 4, 1024)]:
        for _ in range(3):  # repeated: a race in the in-kernel merge would show as a moving error
            rows.append(check_split_s("explicit split-S", "dream7b", dev, dtype, batch, lq, s, c, 28, 4, 128, 64,
                                      True, SplitSConfig(fused_merge=True)))  # fmt: skip
    return rows


# --- the report -------------------------------------------------------------------------------------------------


def meta(dev: str) -> dict:
    info = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "torch": torch.__version__,
        "smem_limit": resources.smem_limit(dev),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def write_kernels(out: Path, info: dict, rows: list[Row]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_check.json").write_text(
        json.dumps({"meta": info, "rows": [asdict(r) for r in rows]}, indent=1)
    )
    bad = [r for r in rows if not r.ok]
    lines = [f"# Kernel check — {info['device']}, {info['date']}", "",
             f"`{info['command']}` (torch {info['torch']}, triton {info.get('triton', '-')}, shared memory "
             f"limit {info['smem_limit']} bytes)", "", f"{len(rows) - len(bad)}/{len(rows)} ok", ""]  # fmt: skip
    section = None
    for r in rows:
        if r.section != section:
            section = r.section
            lines += ["", f"## {section}", "",
                      "| model | kernel | case | dtype | config | smem est | smem compiled | path | rel err | tol | ok "
                      "| note |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        lines.append(f"| {r.model} | {r.kernel} | {r.case} | {r.dtype} | {r.config} | {r.smem_est or '-'} | "
                     f"{r.smem_actual or '-'} | {r.path} | {r.err:.2e} | {r.tol:g} | {'yes' if r.ok else 'NO'} | "
                     f"{r.note.replace('|', '/')[:300]} |")  # fmt: skip
    (out / "kernel_check.md").write_text("\n".join(lines) + "\n")


def run_kernels(out: Path, smoke: bool, budget_s: float) -> int:
    """The sections in order of importance; once ``budget_s`` is spent the rest are listed as skipped."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    install_recorders()
    info = meta(dev)
    rows: list[Row] = []
    shapes = model_shapes(smoke)
    # The interpreter has no bf16 matmul: the smoke run checks fp32 and fp16 only.
    dtypes = (torch.float32, torch.float16) if smoke else DTYPES
    start = time.perf_counter()

    def section(name: str, fn: Callable[[], list[Row]]) -> None:
        t0 = time.perf_counter()
        if t0 - start > budget_s:
            rows.append(Row(name, "-", "-", "skipped: budget spent", "-", "-", None, None, "skipped", 0.0, 0.0,
                            True))  # fmt: skip
            write_kernels(out, info, rows)
            print(f"skipped {name} (budget)", flush=True)
            return
        try:
            new = fn()
        except Exception as exc:  # noqa: BLE001 - one broken section must not hide the others' rows
            import traceback

            traceback.print_exc()
            new = [Row(name, "-", "-", "section raised", "-", "-", None, None, "-", float("nan"), 0.0, False,
                       f"{type(exc).__name__}: {exc}"[:300])]  # fmt: skip
        rows.extend(new)
        write_kernels(out, info, rows)
        n_bad = sum(not r.ok for r in new)
        print(f"[{time.perf_counter() - t0:6.1f}s] {name}: {len(new) - n_bad}/{len(new)} ok", flush=True)

    for sh in shapes:
        for dtype in dtypes:
            section(f"model shapes {sh.name} {dtype}", lambda sh=sh, dtype=dtype: kernel_rows(
                "model shapes", sh, dev, dtype, smoke))  # fmt: skip
    for sh in shapes:
        section(f"unfitted {sh.name}", lambda sh=sh: unfitted_rows(sh, dev))
    for sh in shapes:
        for dtype in dtypes:
            section(
                f"model forward {sh.name} {dtype}", lambda sh=sh, dtype=dtype: forward_rows(sh, dev, dtype)
            )
    big = shapes[-1]
    for limit in FORCED_LIMITS:
        for dtype in dtypes:

            def forced(limit: int = limit, dtype: torch.dtype = dtype) -> list[Row]:
                small = dataclasses.replace(big, split_s=big.split_s[:1], gemm_rows=(40,))
                with forced_limit(limit):
                    got = kernel_rows(f"forced limit {limit}", small, dev, dtype, True)
                drop = ("chunk_prefill_attention", "rms_norm", "rope", "silu_mul")
                return [r for r in got if r.kernel not in drop]

            section(f"forced limit {limit} {dtype}", forced)
    if not smoke:
        for dtype in DTYPES:
            section(f"explicit split-S {dtype}", lambda dtype=dtype: explicit_split_s_rows(dev, dtype))
    bad = [r for r in rows if not r.ok]
    print((out / "kernel_check.md").read_text())
    print(f"{len(rows) - len(bad)}/{len(rows)} ok")
    return 1 if bad else 0


# --- the CLI on CUDA -------------------------------------------------------------------------------------------


@dataclass
class CliRun:
    name: str
    argv: list[str]
    env: dict[str, str]
    rc: int | None
    seconds: float
    answer: str | None
    expected: str | None
    matches: bool | None
    fallback_warnings: list[str]
    tail: str


def _answer(name: str, stdout: str) -> str | None:
    lines = [ln for ln in stdout.strip().splitlines() if ln.strip()]
    if name.startswith("generate"):
        for ln in reversed(lines):
            with contextlib.suppress(json.JSONDecodeError):
                d = json.loads(ln)
                if isinstance(d, dict):
                    return str(d.get("answer", d.get("text", ""))).strip()
        return lines[0].strip() if lines else None
    if name.startswith("eval"):  # the accuracy table's rows: "| pdllm | 1/step | 512 | 100 | 100.0 |"
        cells, section = [], ""
        for ln in lines:
            if ln.startswith("## "):
                section = ln  # "## needle (exact match, %)", then "## needle (tokens per forward)"
            elif "%" in section and re.match(r"^\| (pdllm|vanilla) \|", ln):
                cells.append(re.split(r"\s*\|\s*", ln.strip("| ")))
        return " ".join(f"{c[0]}@{c[-3]}={c[-1]}%" for c in cells) or None
    for ln in lines:  # demo: "answer: '9712217'"
        m = re.match(r"answer:\s*(.*)$", ln)
        if m:
            raw = m.group(1).strip()
            with contextlib.suppress(ValueError, SyntaxError):
                import ast

                raw = str(ast.literal_eval(raw))
            return raw.strip()
    return None


def run_cli(out: Path, device: str, timeout_s: int, budget_s: float, only: set[str] | None = None) -> int:
    """Each run with ``timeout_s`` at most, and none started or left running past ``budget_s`` in all."""
    out.mkdir(parents=True, exist_ok=True)
    bundled = json.loads((ROOT / "shared/data/demo_question.json").read_text())
    doc, question, expected = ROOT / "shared/data/demo_document.txt", bundled["question"], bundled["answer"]
    cli = [sys.executable, "-m", "pdllm.shared.app.cli"]
    gen = ["generate", "--device", device, "--context-file", str(doc), "--question", question, "--json"]
    ev = ["eval", "--device", device, "--tasks", "needle", "--methods", "vanilla,pdllm", "--samples", "1",
          "--length-multiples", "0.5", "--depths", "0.5", "--out", str(out / "eval")]  # fmt: skip
    # Most important first: a run cut short by the caller's time limit loses the least.
    runs: list[tuple[str, list[str], dict[str, str], str | None]] = [
        ("generate-default-dtype", gen, {}, expected),
        ("generate-bfloat16", [*gen, "--dtype", "bfloat16"], {}, expected),
        ("generate-float16", [*gen, "--dtype", "float16"], {}, expected),
        ("demo-serve-default-dtype", ["demo"], {"PDLLM_DEVICE": device}, expected),
        ("eval-default-dtype", [*ev, "--name", "eval_default_dtype"], {}, None),
        ("demo-serve-bfloat16", ["demo"], {"PDLLM_DEVICE": device, "PDLLM_DTYPE": "bfloat16"}, expected),
        ("demo-serve-float16", ["demo"], {"PDLLM_DEVICE": device, "PDLLM_DTYPE": "float16"}, expected),
    ]
    runs = [r for r in runs if only is None or r[0] in only]
    results: list[CliRun] = []
    info = meta(device if device == "cuda" and torch.cuda.is_available() else "cpu")
    start = time.perf_counter()
    for name, args, env, want in runs:
        t0 = time.perf_counter()
        limit = min(timeout_s, budget_s - (t0 - start))
        if limit < 10:
            results.append(CliRun(name, args, env, None, 0.0, None, want, None, [], "skipped: budget spent"))
            continue
        print(f"== {name}: {' '.join(args)} {env or ''}", flush=True)
        try:
            proc = subprocess.run([*cli, *args], env={**os.environ, **env, "PYTHONUNBUFFERED": "1"}, cwd=ROOT,
                                  capture_output=True, text=True, timeout=limit)  # fmt: skip
            rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc = None
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
            stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        secs = time.perf_counter() - t0
        (out / f"cli_{name}.log").write_text(f"$ {' '.join(args)} {env}\nrc={rc} {secs:.1f}s\n--- stdout\n{stdout}"
                                             f"\n--- stderr\n{stderr}")  # fmt: skip
        warns = [ln for ln in stderr.splitlines() if "torch reference" in ln or "cuBLAS runs" in ln]
        answer = _answer(name, stdout) if rc == 0 else None
        matches = None if want is None or answer is None else answer == want
        tail = (
            (stdout.strip().splitlines() or [""])[-1][:300]
            if name.startswith("eval")
            else stderr.replace("\r", "\n")[-600:]
        )
        if rc != 0:
            tail = stderr.replace("\r", "\n")[-1500:]
        results.append(CliRun(name, args, env, rc, round(secs, 1), answer, want, matches, warns, tail))
        print(
            f"   rc={rc} {secs:.1f}s answer={answer!r} matches={matches} fallbacks={len(warns)}", flush=True
        )
        write_cli(out, info, results)
    write_cli(out, info, results)
    return 0 if all(r.rc == 0 for r in results) else 1


def write_cli(out: Path, info: dict, results: list[CliRun]) -> None:
    data = {"meta": info, "runs": [asdict(r) for r in results]}
    (out / "cli_check.json").write_text(json.dumps(data, indent=1))
    lines = [f"# CLI on {info['device']} — {info['date']}", "",
             "| run | rc | s | answer | expected | matches | fallback warnings |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        lines.append(f"| {r.name} | {r.rc} | {r.seconds} | {r.answer!r} | {r.expected!r} | {r.matches} | "
                     f"{len(r.fallback_warnings)} |")  # fmt: skip
    (out / "cli_check.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--parts", default="kernels", help="comma-separated: kernels, cli")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    ap.add_argument("--device", default="cuda", help="the cli part's --device")
    ap.add_argument("--cli-timeout-s", type=int, default=150, help="per CLI run")
    ap.add_argument("--cli-budget-s", type=float, default=1e9, help="all CLI runs together")
    ap.add_argument("--cli-runs", default=None, help="only these cli runs (comma-separated names)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="kernels: start no section after this")
    a = ap.parse_args(argv)
    parts = {p for p in a.parts.split(",") if p}
    rc = 0
    if "cli" in parts:
        only = set(a.cli_runs.split(",")) if a.cli_runs else None
        rc |= run_cli(a.out, a.device, a.cli_timeout_s, a.cli_budget_s, only)
    if "kernels" in parts:
        rc |= run_kernels(a.out, a.smoke, a.budget_s)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
