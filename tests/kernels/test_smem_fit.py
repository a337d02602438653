"""Launch configs fitted to shared memory per dtype, and the torch fallbacks where nothing fits or Triton
refuses a launch. The selection functions are pure (dtype, shape, limit) and run here with an H100's limit
and smaller ones; the launchers run with stand-in kernels (the real kernels' numerics under those configs:
interpreter_cases.case_fitted_configs; on the GPU: benchmarks/kernel_check.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
import torch

from pdllm.kernels import resources
from pdllm.kernels import retention_scores as rs
from pdllm.kernels import skinny_gemm as sg
from pdllm.kernels import split_s_tuning as st
from pdllm.kernels.split_s_reference import SplitSConfig

from .helpers import make_problem

H100 = resources.H100_SMEM  # 232448
SM86 = 101376  # an RTX 30xx / A10's opt-in limit: where fp32 tiles must shrink
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (hidden, intermediate, Hq, Hkv, head_dim): the shipped model (shared/checkpoints/pdllm-needle), Dream-7B.
MODELS = {"shipped": (256, 768, 8, 2, 32), "dream7b": (3584, 18944, 28, 4, 128)}


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(st.TABLE_ENV, raising=False)
    resources.reset()
    st.clear_caches()
    yield
    resources.reset()
    st.clear_caches()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "pdllm.kernels" and r.levelno == logging.WARNING
    ]


class _Kernel:
    """Stands in for a Triton kernel: counts launches, optionally raising Triton's OutOfResources."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse, self.launches = refuse, []

    def __getitem__(self, grid: tuple) -> Callable[..., None]:
        def launch(*args: object, **kw: object) -> None:
            self.launches.append(kw)
            if self.refuse:
                from triton.runtime.errors import OutOfResources

                raise OutOfResources(294912, H100, "shared memory")

        return launch


# --- the device's limit ---------------------------------------------------------------------------------


def test_smem_limit_from_device_properties(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def props(index: int) -> SimpleNamespace:
        calls.append(index)
        return SimpleNamespace(shared_memory_per_block_optin=SM86, shared_memory_per_block=49152)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    assert resources.smem_limit("cuda:1") == SM86 and resources.smem_limit(torch.device("cuda", 1)) == SM86
    assert calls == [1]  # read once per device
    assert resources.smem_limit("cpu") == H100  # the interpreter picks what an H100 would
    # No opt-in field: Triton's driver query, else the per-block default.
    resources.reset()
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: SimpleNamespace(shared_memory_per_block=49152)
    )
    monkeypatch.setattr(resources, "_triton_smem", lambda i: 166912)
    assert resources.smem_limit("cuda:0") == 166912
    resources.reset()
    monkeypatch.setattr(resources, "_triton_smem", lambda i: None)
    assert resources.smem_limit("cuda:0") == 49152


# --- split-S ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("limit", [H100, SM86])
def test_split_s_choice_fits(model: str, dtype: torch.dtype, limit: int) -> None:
    _, _, hq, hkv, d = MODELS[model]
    for lq in (1, 32, 96, 256):
        for page in (16, 64):
            sel = st.select_config(
                torch.device("cpu"), dtype, lq * hq // hkv, 4096 + lq, 4 * hkv, d, page, smem=limit
            )
            assert sel.config is not None and st.smem_estimate(sel.config, dtype, d) <= limit, sel
            assert sel.smem_limit == limit


def test_split_s_fp32_gets_smaller_tiles_where_bf16_ones_do_not_fit() -> None:
    # The committed H100 table's bf16 configs all fit as tuned: fitting never changes them.
    for (_, bucket), cfg in st.load_table(st.DEFAULT_TABLE).entries.items():
        assert st.fit_config(cfg, torch.bfloat16, bucket.head_dim, H100) is cfg
    big = SplitSConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, programs_per_sm=1.0)
    bf16 = st.fit_config(big, torch.bfloat16, 128, H100)
    fp32 = st.fit_config(big, torch.float32, 128, H100)
    assert st.smem_estimate(big, torch.float32, 128) > H100
    assert bf16 is not None and fp32 is not None and fp32 != bf16
    assert (fp32.num_stages, fp32.block_n, fp32.block_m) <= (bf16.num_stages, bf16.block_n, bf16.block_m)
    assert st.smem_estimate(fp32, torch.float32, 128) <= H100
    # A smaller device: the heuristic's default tiles fit bf16 but not fp32 at d = 128.
    dflt = SplitSConfig()
    assert st.fit_config(dflt, torch.bfloat16, 128, SM86) is dflt
    small = st.fit_config(dflt, torch.float32, 128, SM86)
    assert small is not None and small != dflt and st.smem_estimate(small, torch.float32, 128) <= SM86
    assert st.fit_config(dflt, torch.float32, 128, 16 * 1024) is None


def _split_s_problem(dtype: torch.dtype):
    return make_problem(torch.Generator().manual_seed(0), [5, 3], [[40, 9], [20]], 2, 4, 32, 16, dtype=dtype)


def test_split_s_falls_back_where_nothing_fits(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("triton")
    from pdllm.kernels import split_s_attention as sa

    kernel = _Kernel()
    monkeypatch.setattr(sa, "_split_s_kernel", kernel)
    monkeypatch.setattr(st, "smem_limit", lambda device: 2048)
    p = _split_s_problem(torch.float32)
    with caplog.at_level(logging.WARNING, logger="pdllm.kernels"):
        for _ in range(2):
            got = sa.split_s_attention(*p.args())
            torch.testing.assert_close(got, sa.split_s_attention_reference(*p.args()))
    assert kernel.launches == []
    assert len(_warnings(caplog)) == 1 and "2048 bytes" in _warnings(caplog)[0]
    # A fitting device launches the kernel again.
    monkeypatch.setattr(st, "smem_limit", lambda device: H100)
    st.clear_caches()
    sa.split_s_attention(*p.args())
    assert len(kernel.launches) == 1


def test_split_s_out_of_resources_falls_back_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("triton")
    from pdllm.kernels import split_s_attention as sa

    kernel = _Kernel(refuse=True)
    monkeypatch.setattr(sa, "_split_s_kernel", kernel)
    p = _split_s_problem(torch.float32)
    with caplog.at_level(logging.WARNING, logger="pdllm.kernels"):
        for _ in range(3):
            torch.testing.assert_close(
                sa.split_s_attention(*p.args()), sa.split_s_attention_reference(*p.args())
            )
    assert len(kernel.launches) == 1  # the refusal is remembered: later calls go straight to the reference
    assert len(_warnings(caplog)) == 1 and "out of resource" in _warnings(caplog)[0]
    # An explicit config is launched as given: the error reaches the caller.
    from triton.runtime.errors import OutOfResources

    with pytest.raises(OutOfResources):
        sa.split_s_attention(*p.args(), config=SplitSConfig(block_m=16, block_n=16))


# --- skinny GEMMs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("limit", [H100, SM86])
def test_skinny_choice_fits(model: str, dtype: torch.dtype, limit: int) -> None:
    hidden, inter, *_ = MODELS[model]
    for m in (1, 16, 17, 40, 64):
        for n, k, glu in ((inter, hidden, True), (hidden, inter, False)):
            cfg = sg.pick_config(m, n, k, glu, dtype, limit)
            if cfg is not None:
                assert sg.smem_estimate(cfg, m, dtype, glu) <= limit, (m, n, k, cfg)
                assert n % cfg.block_n == 0 and k % (cfg.block_k * cfg.split) == 0


def test_skinny_fp32_gets_fewer_stages_than_bf16() -> None:
    hidden, inter, *_ = MODELS["shipped"]
    bf16 = sg.pick_config(40, inter, hidden, True, torch.bfloat16, H100)
    fp32 = sg.pick_config(40, inter, hidden, True, torch.float32, H100)
    assert bf16 == sg.SkinnyConfig(block_n=64, block_k=128, split=1, num_stages=4)  # measured, unchanged
    assert fp32 is not None and fp32.num_stages < bf16.num_stages
    # bf16's config in fp32 is what failed on an H100 (Triton: 294912 bytes needed, 232448 available).
    assert sg.smem_estimate(bf16, 40, torch.float32, True) > H100
    hidden, inter, *_ = MODELS["dream7b"]
    down16 = sg.pick_config(56, hidden, inter, False, torch.bfloat16, H100)
    down32 = sg.pick_config(56, hidden, inter, False, torch.float32, H100)
    assert down16 is not None and down16.num_stages == 6
    assert down32 is not None and down32.num_stages < 6 and down32.split == down16.split
    # Smaller devices: tiles shrink after stages.
    tight = sg.pick_config(64, inter, hidden, True, torch.float32, 64 * 1024)
    assert (
        tight is not None
        and tight.block_k < 128
        and sg.smem_estimate(tight, 64, torch.float32, True) <= 65536
    )


def test_skinny_no_fit_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pdllm.kernels"):
        assert sg.pick_config(40, 768, 256, True, torch.float32, 4096) is None
        assert sg.pick_config(40, 768, 256, True, torch.float32, 4096) is None
    assert len(_warnings(caplog)) == 1 and "cuBLAS" in _warnings(caplog)[0]


def test_skinny_launch_fits_the_given_config_and_falls_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("triton")
    kernel = _Kernel()
    monkeypatch.setattr(sg, "_skinny_kernel", kernel)
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(40, 256, generator=gen), torch.randn(2 * 768, 256, generator=gen)
    bf16_cfg = sg.SkinnyConfig(block_n=64, block_k=128, num_stages=4)
    sg.skinny_silu_mul(x, w, bf16_cfg)  # an fp32 input with bf16's config (a caller that did not fit it)
    assert kernel.launches[-1]["num_stages"] < 4
    # Nothing fits: the reference, logged once, no launch.
    monkeypatch.setattr(sg, "smem_limit", lambda device: 4096)
    with caplog.at_level(logging.WARNING, logger="pdllm.kernels"):
        for _ in range(2):
            torch.testing.assert_close(sg.skinny_silu_mul(x, w, bf16_cfg), sg.skinny_silu_mul_reference(x, w))
    assert len(kernel.launches) == 1 and len(_warnings(caplog)) == 1
    # Triton refuses: the reference, logged once.
    monkeypatch.setattr(sg, "smem_limit", lambda device: H100)
    monkeypatch.setattr(sg, "_skinny_kernel", _Kernel(refuse=True))
    wd, res = torch.randn(256, 768, generator=gen), torch.randn(40, 256, generator=gen)
    h = torch.randn(40, 768, generator=gen)
    cfg = sg.SkinnyConfig(block_n=64, block_k=128, split=2, num_stages=6)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pdllm.kernels"):
        for _ in range(2):
            got = sg.skinny_linear(h, wd, residual=res, config=cfg)
            torch.testing.assert_close(got, sg.skinny_linear_reference(h, wd, residual=res))
    assert len(_warnings(caplog)) == 1


# --- retention scores and the elementwise kernels ----------------------------------------------------------


def test_retention_fit() -> None:
    assert rs.fit_config(64, 64, torch.bfloat16, 128, H100) == (64, 64, 3)  # Triton's default, unchanged
    fp32 = rs.fit_config(64, 64, torch.float32, 256, H100)
    assert fp32 is not None and fp32 != (64, 64, 3) and rs.smem_estimate(*fp32, torch.float32, 256) <= H100
    assert rs.fit_config(64, 64, torch.float32, 128, 4096) is None


def test_retention_falls_back(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(50, 4, 32, generator=gen), torch.randn(50, 2, 32, generator=gen)
    cu, ql = torch.tensor([0, 50], dtype=torch.int32), torch.tensor([10], dtype=torch.int32)
    want = rs.retention_scores_reference(q, k, cu, ql)
    for limit, kernel in ((1024, _Kernel()), (H100, _Kernel(refuse=True))):
        resources.reset()
        caplog.clear()
        monkeypatch.setattr(rs, "smem_limit", lambda device, limit=limit: limit)
        monkeypatch.setattr(rs, "_retention_kernel", kernel)
        with caplog.at_level(logging.WARNING, logger="pdllm.kernels"):
            for _ in range(2):
                torch.testing.assert_close(rs.retention_scores(q, k, cu, ql, lse=torch.zeros(50, 4)), want)
        assert len(kernel.launches) == (1 if kernel.refuse else 0) and len(_warnings(caplog)) == 1


def test_elementwise_kernels_fall_back_on_out_of_resources(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("triton")
    from pdllm.kernels import rms_norm, rope, silu_mul

    from .test_fused_elementwise import rope_inputs

    for mod, name in ((rms_norm, "_rms_norm_kernel"), (rope, "_rope_kernel"), (silu_mul, "_silu_mul_kernel")):
        monkeypatch.setattr(mod, name, _Kernel(refuse=True))
    gen = torch.Generator().manual_seed(3)
    x, r, w = (
        torch.randn(3, 256, generator=gen),
        torch.randn(3, 256, generator=gen),
        torch.randn(256, generator=gen),
    )
    q, k, cos, sin = rope_inputs(gen, 1, 8, 2, 5, 32, torch.float32)
    gu = torch.randn(3, 2 * 768, generator=gen)
    with caplog.at_level(logging.WARNING, logger="pdllm.kernels"):
        for _ in range(2):
            torch.testing.assert_close(rms_norm.rms_norm(x, w, 1e-6), rms_norm.rms_norm_reference(x, w, 1e-6))
            for got, want in zip(
                rms_norm.rms_norm(x, w, 1e-6, residual=r), rms_norm.rms_norm_reference(x, w, 1e-6, residual=r)
            ):
                torch.testing.assert_close(got, want)
            for got, want in zip(rope.apply_rope(q, k, cos, sin), rope.apply_rope_reference(q, k, cos, sin)):
                torch.testing.assert_close(got, want)
            torch.testing.assert_close(silu_mul.silu_mul_fused(gu), silu_mul.silu_mul_fused_reference(gu))
    assert len(_warnings(caplog)) == 4  # one per kernel and case (rms_norm with and without the residual)
