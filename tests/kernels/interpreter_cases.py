"""Triton kernels under the interpreter; run as a script by test_triton_interpreter.py.

TRITON_INTERPRET must be set before ``@triton.jit`` runs (triton reads it at decoration time), and other
test modules may already have imported the kernels, so each case runs in a fresh process:
``TRITON_INTERPRET=1 python tests/kernels/interpreter_cases.py CASE``. Exit 0 = pass.
bf16 is not checked for the attention kernels: the interpreter's numpy backend has no bf16 matmul; the GPU
check covers it. The elementwise kernels (rms_norm, rope, silu_mul) are checked in fp32 and bf16.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.kernels.helpers import make_problem  # noqa: E402


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def case_split_s() -> None:
    from pdllm.kernels.split_s_attention import SplitSConfig, split_s_attention, split_s_attention_reference

    gen = torch.Generator().manual_seed(0)
    cases = [
        # (q_lens, chunk lens, hkv, group, page, local, dtype, block_n, splits, tol)
        ([5, 3], [[20, 7], [33]], 2, 3, 16, True, torch.float32, 16, None, 1e-5),
        ([4, 1, 6], [[9], [3, 3, 3], [17, 1]], 1, 4, 8, True, torch.float32, 16, 3, 1e-5),  # block > page
        ([3], [[16, 16]], 1, 7, 16, True, torch.float32, 16, 3, 1e-5),  # last split: one token
        ([7, 2], [[40], [12, 12]], 2, 1, 32, False, torch.float16, 16, 1, 2e-3),  # single split, no local
        ([6], [[64, 30]], 1, 4, 64, True, torch.float16, 32, 4, 2e-3),
    ]
    for q_lens, chunks, hkv, group, page, local, dtype, block_n, splits, tol in cases:
        p = make_problem(gen, q_lens, chunks, hkv, group, 32, page, local=local, dtype=dtype)
        cfg = SplitSConfig(block_m=16, block_n=block_n, num_splits=splits)
        want = split_s_attention_reference(*p.args(), config=cfg)
        got = split_s_attention(*p.args(), config=cfg)
        err = _rel(got, want)
        assert err < tol, (q_lens, chunks, err)
        assert torch.isfinite(got).all()
        # Scores 8x wider: row maxima jump between blocks, so every block rescales what came before.
        wide = dataclasses.replace(p, q=p.q * 8)
        want_wide = split_s_attention_reference(*wide.args(), config=cfg)
        assert _rel(split_s_attention(*wide.args(), config=cfg), want_wide) < tol, q_lens
        if local:
            # Local K/V as the model hands them over: strided views, K and V with different row strides
            # (V a column slice of a packed q/k/v output), nothing copied.
            t, hkv_, d = p.k_local.shape
            packed = torch.randn(t, 5 * hkv_ * d, generator=gen, dtype=dtype)
            v_view = packed[:, 2 * hkv_ * d : 3 * hkv_ * d].view(t, hkv_, d)
            v_view.copy_(p.v_local)
            k_view = torch.empty(hkv_, t, d, dtype=dtype).transpose(0, 1)
            k_view.copy_(p.k_local)
            strided = dataclasses.replace(p, k_local=k_view, v_local=v_view)
            assert _rel(split_s_attention(*strided.args(), config=cfg), want) < tol, q_lens
        if splits != 1:
            # In-kernel merge through a reused counter workspace: same answer, workspace left zeroed.
            ws = torch.zeros(64, dtype=torch.int32)
            fused = SplitSConfig(block_m=16, block_n=block_n, num_splits=splits, fused_merge=True)
            for _ in range(2):
                assert _rel(split_s_attention(*p.args(), config=fused, workspace=ws), want) < tol
                assert int(ws.abs().sum()) == 0


def case_split_s_merge() -> None:
    """The split merge with the row LSE, unrolled (the default up to 32 splits, padded to a power of two)
    and split by split: requests whose later splits see no key (-inf partials), rows that see no key at all,
    rows not a multiple of the merge's row block, many splits (9 -> 16 unrolled)."""
    from pdllm.kernels import split_s_attention as sa

    gen = torch.Generator().manual_seed(3)
    cases = [
        # (q_lens, chunk lens, hkv, group, page, dtype, splits, tol, local)
        ([5, 3, 1], [[70, 20], [9], [33, 33]], 2, 3, 16, torch.float32, 9, 1e-5, True),
        ([7], [[100]], 1, 5, 16, torch.float16, 3, 2e-3, True),
        ([2, 6], [[1], [64, 64, 64]], 2, 2, 32, torch.float32, 5, 1e-5, True),
        ([3, 2], [[40], []], 1, 2, 16, torch.float32, 3, 1e-5, False),  # no key at all: -inf rows
    ]
    for q_lens, chunks, hkv, group, page, dtype, splits, tol, local in cases:
        p = make_problem(gen, q_lens, chunks, hkv, group, 32, page, local=local, dtype=dtype)
        cfg = sa.SplitSConfig(block_m=16, block_n=16, num_splits=splits)
        want_lse = torch.empty(p.q.shape[:2], dtype=torch.float32)
        want = sa.split_s_attention_reference(*p.args(), config=cfg, lse_out=want_lse)
        for unroll_max in (sa.MERGE_UNROLL_MAX, 0):  # 0: every call merges split by split
            default, sa.MERGE_UNROLL_MAX = sa.MERGE_UNROLL_MAX, unroll_max
            lse = torch.full(p.q.shape[:2], 7.0)
            got = sa.split_s_attention(*p.args(), config=cfg, lse_out=lse)
            sa.MERGE_UNROLL_MAX = default
            tag = (q_lens, splits, unroll_max)
            assert torch.isfinite(got).all(), tag
            assert _rel(got, want) < tol, (tag, _rel(got, want))
            assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)), tag
            fin = torch.isfinite(want_lse)
            assert (lse[fin] - want_lse[fin]).abs().max() < tol * 10, tag


def kernel_variants() -> list[tuple[int, int, bool]]:
    """Every (block_m, block_n, fused_merge) the tuner can write into the table or the heuristic can pick:
    the other fields (warps, stages, split policy) do not change what the kernel computes."""
    from pdllm.kernels.split_s_tuner import candidates
    from pdllm.kernels.split_s_tuning import ShapeBucket, heuristic_config

    buckets = [
        ShapeBucket(rows, 4096, 16, 128, page, "bfloat16") for rows in (16, 32, 256) for page in (16, 64)
    ]
    cfgs = [c for b in buckets for c in [*candidates(b), heuristic_config(b)]]
    return sorted({(c.block_m, c.block_n, c.fused_merge) for c in cfgs})


class _Recorder:
    """Wraps the Triton kernel so a case can see which tiles the launcher really used."""

    def __init__(self, kernel: object) -> None:
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid: tuple) -> Callable[..., object]:  # as triton's kernel[grid](...)
        def launch(*args: object, **kw: object) -> object:
            self.calls.append(kw)
            return self.kernel[grid](*args, **kw)

        return launch


def case_split_s_configs() -> None:
    """Each kernel variant at pages 16 and 64 against the reference (same split plan) and the float64 gather:
    ragged batches (a request with no queries, one with no paged KV), GQA 1/4/7/8, full pages, partial pages,
    an all-hole page poisoned with garbage, S = 1 and S = 64 chunks, the planner's splits and a single split.
    Then config=None through a table file: the launcher must run the table's tiles."""
    import dataclasses
    import json
    import tempfile

    from pdllm.kernels import split_s_attention as sa
    from pdllm.kernels import split_s_tuning as st

    gen = torch.Generator().manual_seed(5)
    variants = kernel_variants()
    assert {(128, 32, False), (128, 128, False), (64, 16, False), (16, 64, False), (64, 64, True)} <= set(
        variants
    )
    groups = (1, 4, 7, 8)
    problems = {}
    for page in (16, 64):
        for group in groups:
            c = page // 8  # S = 64 chunks of c tokens: 64 partial pages
            p = make_problem(
                gen, [5, 0, 3, 20, 2], [[page, page, page], [c] * 64, [9], [], [40]], 2, group, 16, page
            )
            p.page_fill[0, 1] = 0  # a page of holes only, and garbage in it
            p.k_pages[p.page_table[0, 1].long()] = 1e4
            problems[page, group] = p
            # No page_fill: every slot below kv_len is a token, the kernel's unmasked whole-block loop;
            # kv_lens cut mid-page so a ragged last block follows it.
            q = make_problem(gen, [4, 3, 6], [[page, page, page], [page] * 9, [2 * page]], 2, group, 16, page)
            problems["nofill", page, group] = dataclasses.replace(
                q, page_fill=None, kv_lens=q.kv_lens - torch.tensor([3, 0, page // 2 + 1], dtype=torch.int32)
            )
    for i, (bm, bn, fused) in enumerate(variants):
        for page in (16, 64):
            group = groups[(i + page // 16) % 4]
            for p in (problems[page, group], problems["nofill", page, group]):
                want = sa.naive_attention(*p.args())
                for splits in (None, 1):
                    cfg = sa.SplitSConfig(
                        block_m=bm, block_n=bn, fused_merge=fused, num_splits=splits, num_sms=4
                    )
                    got = sa.split_s_attention(*p.args(), config=cfg)
                    ref = sa.split_s_attention_reference(*p.args(), config=cfg)
                    fill = p.page_fill is not None
                    assert _rel(got, ref) < 1e-5 and _rel(got, want) < 1e-5, (
                        bm,
                        bn,
                        fused,
                        page,
                        splits,
                        fill,
                    )
        print(f"split_s bm={bm} bn={bn} fused={fused}: pages 16/64 ok")

    # config=None: a table entry for this device ("cpu") and bucket must reach the kernel launch.
    p = problems[64, 7]
    lqs = (p.q_offsets[1:] - p.q_offsets[:-1]).tolist()
    bucket = st.ShapeBucket.of(max(lqs) * 7, int(p.kv_lens.max()) + max(lqs), 5 * 2, 16, 64, p.q.dtype)
    entry_cfg = sa.SplitSConfig(block_m=128, block_n=32, fused_merge=True, num_warps=8)
    assert entry_cfg != st.heuristic_config(bucket)
    table = {"version": 1, "entries": [{"device": "cpu", "bucket": dataclasses.asdict(bucket),
                                        "config": st.config_to_dict(entry_cfg)}]}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "table.json"
        path.write_text(json.dumps(table))
        os.environ[st.TABLE_ENV] = str(path)
        st.clear_caches()
        sa._split_s_kernel = rec = _Recorder(sa._split_s_kernel)
        got = sa.split_s_attention(*p.args())
        assert _rel(got, sa.naive_attention(*p.args())) < 1e-5
        launched = rec.calls[-1]
        assert (launched["BLOCK_M"], launched["BLOCK_N"], launched["FUSED"], launched["num_warps"]) == (
            128, 32, True, 8), launched  # fmt: skip
        # An explicit config wins over the table.
        sa.split_s_attention(*p.args(), config=sa.SplitSConfig(block_m=16, block_n=16))
        assert (rec.calls[-1]["BLOCK_M"], rec.calls[-1]["BLOCK_N"]) == (16, 16)
    print("split_s config=None: table entry launched")


def case_split_s_tuner() -> None:
    """The tuner's per-bucket step on a tiny shape (real kernel runs, scripted timings): a candidate replaces
    the default only when >= 3% faster, a failing candidate is recorded, and the table it writes is what the
    lookup then returns."""
    import tempfile

    from pdllm.kernels import split_s_tuner as tuner
    from pdllm.kernels import split_s_tuning as st
    from pdllm.kernels.split_s_attention import SplitSConfig

    shape = tuner.TuneShape(batch=2, lq=3, kv_tokens=40, page=16, hq=8, hkv=2, head_dim=16)
    rows, kv = 3 * 4, 40 + 3
    bucket = st.ShapeBucket.of(rows, kv, 2 * 2, 16, 16, torch.float32)
    fast, broken = SplitSConfig(block_m=128, block_n=32, num_warps=8), SplitSConfig(block_n=128)
    tuner.candidates = lambda b: [SplitSConfig(), broken, fast]
    for speed, want in ((0.9, fast), (0.98, SplitSConfig())):
        script = iter([100.0, RuntimeError("out of resources: shared memory"), 100.0 * speed])

        def fake_time(fn: Callable[[], object], script: Iterator[float | Exception] = script) -> float:
            fn()
            t = next(script)
            if isinstance(t, Exception):
                raise t
            return t

        tuner.graph_time_us = fake_time
        entry = tuner.tune_bucket(shape, bucket, torch.float32, torch.device("cpu"))
        assert entry["config"] == st.config_to_dict(want) and entry["default_us"] == 100.0, entry
        assert entry["timings"][1][1] is None and "shared memory" in entry["timings"][1][2]
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "t.json"
            tuner.write_table(path, [entry])
            sel = st.select_config(
                torch.device("cpu"), torch.float32, rows, kv, 4, 16, 16, st.load_table(path)
            )
            assert (sel.source, sel.config) == ("table", want), sel
    print("split_s tuner: winner only when >= 3% faster; failures recorded; table round-trips")


def case_retention() -> None:
    from pdllm.kernels.chunk_prefill_attention import chunk_prefill_attention_reference
    from pdllm.kernels.retention_scores import retention_scores, retention_scores_reference

    gen = torch.Generator().manual_seed(1)
    for lens, qlens, hq, hkv, causal, block in [
        ([40, 70, 9], [8, 21, 9], 8, 2, False, 16),
        ([33, 50], [5, 17], 7, 1, True, 32),
        ([90], [30], 4, 4, False, 32),
    ]:
        total = sum(lens)
        q = torch.randn(total, hq, 32, generator=gen)
        k = torch.randn(total, hkv, 32, generator=gen)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        ql = torch.tensor(qlens, dtype=torch.int32)
        lse = chunk_prefill_attention_reference(q, k, k, cu, causal=causal, return_lse=True)[1]
        want = retention_scores_reference(q, k, cu, ql, causal=causal)
        got = retention_scores(q, k, cu, ql, lse=lse, causal=causal, block_n=block, block_m=16)
        assert _rel(got, want) < 1e-5, (lens, _rel(got, want))
        assert bool((got[cu[1] - ql[0] : cu[1]] == 0).all())


def _report(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: norm-wise relative error < 1e-5; bf16: within 1 ulp elementwise. Prints what was measured."""
    from tests.kernels.test_fused_elementwise import max_ulp

    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape, got.dtype)
    if got.dtype == torch.float32:
        err = _rel(got, want)
        assert err < 1e-5, (name, err)
        print(f"{name} fp32 rel={err:.2e}")
    else:
        ulp = max_ulp(got, want)
        assert ulp <= 1, (name, ulp)
        print(f"{name} {got.dtype} max_ulp={ulp}")


def case_rms_norm() -> None:
    from pdllm.kernels.rms_norm import rms_norm, rms_norm_reference

    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        for shape in [(2, 3, 100), (2, 3584)]:
            x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
            r = torch.randn(*shape, generator=gen).to(dtype)
            w = torch.randn(shape[-1], generator=gen).to(dtype)
            _report(f"rms_norm{shape}", rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))
            out, s = rms_norm(x, w, 1e-6, residual=r)
            want_out, want_s = rms_norm_reference(x, w, 1e-6, residual=r)
            assert torch.equal(s, want_s), shape  # one rounding of an exact fp32 sum: always exact
            _report(f"rms_norm+res{shape}", out, want_out)
        # Non-contiguous leading dims, and an fp32 weight promoting the output.
        xt = torch.randn(3, 2, 64, generator=gen).to(dtype).transpose(0, 1)
        w32 = torch.randn(64, generator=gen)
        _report("rms_norm(transposed)", rms_norm(xt, w32, 1e-5), rms_norm_reference(xt, w32, 1e-5))


def case_rope() -> None:
    from pdllm.kernels.rope import apply_rope, apply_rope_reference
    from tests.kernels.test_fused_elementwise import rope_inputs

    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        for b, hq, hk, t, d in [(2, 6, 2, 3, 96), (1, 28, 4, 2, 128)]:
            q, k, cos, sin = rope_inputs(gen, b, hq, hk, t, d, dtype)
            q0, k0 = q.clone(), k.clone()
            oq, ok = apply_rope(q, k, cos, sin)
            wq, wk = apply_rope_reference(q, k, cos, sin)
            assert torch.equal(q, q0) and torch.equal(k, k0)  # inputs untouched
            # Token-major memory viewed as [B, H, T, D]: the layout eager torch gives for these views.
            assert oq.transpose(1, 2).is_contiguous() and ok.transpose(1, 2).is_contiguous()
            _report(f"rope q{(b, hq, t, d)}", oq, wq)
            _report(f"rope k{(b, hk, t, d)}", ok, wk)
        # Contiguous [B, H, T, D] inputs and a batch-broadcast cos/sin (stride 0) work through strides too.
        q, k, cos, sin = rope_inputs(gen, 1, 4, 2, 3, 32, dtype)
        q, k = q.contiguous(), k.contiguous()
        cos, sin = cos.expand(2, -1, -1), sin.expand(2, -1, -1)
        q, k = q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1)
        for got, want in zip(apply_rope(q, k, cos, sin), apply_rope_reference(q, k, cos, sin)):
            _report("rope(expanded)", got, want)


def case_silu_mul() -> None:
    from pdllm.kernels.silu_mul import silu_mul, silu_mul_fused, silu_mul_fused_reference, silu_mul_reference

    gen = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16):
        for shape in [(3, 96), (2, 1, 1500)]:
            gate = (torch.randn(*shape, generator=gen) * 4).to(dtype)
            up = torch.randn(*shape, generator=gen).to(dtype)
            _report(f"silu_mul{shape}", silu_mul(gate, up), silu_mul_reference(gate, up))
            gu = torch.cat([gate, up], -1)
            _report(f"silu_mul_fused{shape}", silu_mul_fused(gu), silu_mul_fused_reference(gu))
        gt = torch.randn(40, 3, generator=gen).to(dtype).t()  # non-contiguous: copied to rows
        _report("silu_mul(transposed)", silu_mul(gt, gt), silu_mul_reference(gt, gt))


def case_model_fused() -> None:
    """The model's fused route (packed GEMMs + the three kernels, as taken on CUDA) == its eager ops: 38 rows
    (the skinny SwiGLU GEMM, as a decode step) and 76 (the cuBLAS GEMM + SiLU*up kernel)."""
    from pdllm.shared.model import transformer
    from tests.model.helpers import tiny_model

    transformer.fused_route = lambda module, x: module.fused and not torch.is_grad_enabled()  # CPU stands in
    for family in ("dream", "llada"):
        model = tiny_model(family, seed=8)
        model.pack_projections()
        ids = torch.randint(3, 90, (4, 19), generator=torch.Generator().manual_seed(5))
        one_row = torch.arange(3, 22)[None]  # one row of positions for the batch: eager broadcasts it
        with torch.no_grad():
            fused = torch.cat([model(ids[:2]), model(ids[:2], one_row), model(ids)])
            model.set_fused(False)
            eager = torch.cat([model(ids[:2]), model(ids[:2], one_row), model(ids)])
        err = _rel(fused, eager)
        assert err < 1e-5, (family, err)
        print(f"model {family} fused vs eager fp32 rel={err:.2e}")


def case_skinny_gemm() -> None:
    """Skinny GEMMs (bias, residual, K splits, the SwiGLU epilogue) == their references, ragged row counts
    (fp32: the interpreter has no bf16 matmul; the GPU check covers bf16)."""
    from pdllm.kernels.skinny_gemm import (
        SkinnyConfig,
        skinny_linear,
        skinny_linear_reference,
        skinny_silu_mul,
        skinny_silu_mul_reference,
    )

    gen = torch.Generator().manual_seed(3)
    for m in (1, 5, 17, 64):
        x = torch.randn(m, 128, generator=gen)
        w = torch.randn(96, 128, generator=gen) / 8
        bias, res = torch.randn(96, generator=gen), torch.randn(m, 96, generator=gen)
        for split in (1, 2, 4):
            cfg = SkinnyConfig(block_n=32, block_k=16, split=split, num_stages=2)
            for b, r in ((None, None), (bias, None), (None, res), (bias, res)):
                got = skinny_linear(x, w, b, r, config=cfg)
                assert _rel(got, skinny_linear_reference(x, w, b, r)) < 1e-6, (m, split, b is None, r is None)
        w_gu = torch.randn(2 * 48, 128, generator=gen) / 8
        got = skinny_silu_mul(x, w_gu, SkinnyConfig(block_n=16, block_k=32, num_stages=2))
        assert _rel(got, skinny_silu_mul_reference(x, w_gu)) < 1e-6, m
    print("skinny gemm ok")


def case_elementwise() -> None:
    """The three elementwise kernels and the model's fused route in one process (the interpreter start-up
    dominates their cost)."""
    case_rms_norm()
    case_rope()
    case_silu_mul()
    case_model_fused()


def case_fitted_configs() -> None:
    """Every kernel launched with the config its launcher picks (config=None) at the shipped model's shapes
    (hidden 256, intermediate 768, 8/2 heads, d = 32), in fp32 and fp16 (bf16 too for the elementwise
    kernels: the interpreter has no bf16 matmul), first at an H100's shared memory, then at a limit small
    enough that the tiles shrink: each against its reference."""
    from pdllm.kernels import resources
    from pdllm.kernels import retention_scores as rs
    from pdllm.kernels import skinny_gemm as sg
    from pdllm.kernels import split_s_attention as sa
    from pdllm.kernels import split_s_tuning as st
    from pdllm.kernels.chunk_prefill_attention import chunk_prefill_attention_reference
    from pdllm.kernels.rms_norm import rms_norm, rms_norm_reference
    from pdllm.kernels.rope import apply_rope, apply_rope_reference
    from pdllm.kernels.silu_mul import silu_mul_fused, silu_mul_fused_reference
    from tests.kernels.test_fused_elementwise import rope_inputs

    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
    gen = torch.Generator().manual_seed(6)
    for limit in (resources.H100_SMEM, 24 * 1024):
        for mod in (st, sg, rs):
            mod.smem_limit = lambda device, limit=limit: limit
        st.clear_caches()
        for dtype in (torch.float32, torch.float16):

            def rnd(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
                return torch.randn(*shape, generator=gen).to(dtype)

            p = make_problem(gen, [9, 2], [[64, 30], [17]], 2, 4, 32, 64, dtype=dtype)
            lqs = (p.q_offsets[1:] - p.q_offsets[:-1]).tolist()
            kv = int(p.kv_lens.max()) + max(lqs)
            sel = st.select_config(torch.device("cpu"), dtype, max(lqs) * 4, kv, 2 * 2, 32, 64)
            assert sel.config is not None and st.smem_estimate(sel.config, dtype, 32) <= limit, sel
            got = sa.split_s_attention(*p.args())
            assert _rel(got, sa.naive_attention(*p.args())) < tol[dtype], (limit, dtype)
            x, w_gu = rnd(40, 256), rnd(2 * 768, 256) / 16
            cfg = sg.pick_config(40, 768, 256, True, dtype, limit)
            assert cfg is not None and sg.smem_estimate(cfg, 40, dtype, True) <= limit, cfg
            assert _rel(sg.skinny_silu_mul(x, w_gu, cfg), sg.skinny_silu_mul_reference(x, w_gu)) < tol[dtype]
            h, w_d, res = rnd(40, 768), rnd(256, 768) / 16, rnd(40, 256)
            down = sg.SkinnyConfig(block_n=64, block_k=128, split=2, num_stages=6)  # fitted at launch
            got = sg.skinny_linear(h, w_d, residual=res, config=down)
            assert _rel(got, sg.skinny_linear_reference(h, w_d, residual=res)) < tol[dtype]
            q, k = rnd(70, 8, 32), rnd(70, 2, 32)
            cu, ql = torch.tensor([0, 50, 70], dtype=torch.int32), torch.tensor([12, 6], dtype=torch.int32)
            lse = chunk_prefill_attention_reference(q, k, k, cu, return_lse=True)[1]
            want = rs.retention_scores_reference(q, k, cu, ql)
            assert _rel(rs.retention_scores(q, k, cu, ql, lse=lse), want) < tol[dtype], (limit, dtype)
            print(f"limit {limit} {dtype}: split-S {sel.config.block_m}x{sel.config.block_n}, skinny {cfg}")
    assert not resources._FAILED  # nothing fell back to a reference
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x, r, w = (torch.randn(3, 256, generator=gen).to(dtype) for _ in range(3))
        w = w[0]
        assert _rel(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)) < tol[dtype]
        q, k, cos, sin = rope_inputs(gen, 1, 8, 2, 5, 32, dtype)
        for got, want in zip(apply_rope(q, k, cos, sin), apply_rope_reference(q, k, cos, sin)):
            assert _rel(got, want) < tol[dtype]
        gu = torch.randn(3, 2 * 768, generator=gen).to(dtype)
        assert _rel(silu_mul_fused(gu), silu_mul_fused_reference(gu)) < tol[dtype]
    print("elementwise fp32/fp16/bf16 ok")


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1")
    globals()[f"case_{sys.argv[1]}"]()
    print("ok")


if __name__ == "__main__":
    main()
