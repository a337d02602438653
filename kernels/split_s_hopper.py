"""Experimental Hopper variant of split-S decode attention: K/V page tiles through TMA tensor descriptors,
the unmasked key loop warp-specialized where Triton compiles that. Off by default.

A drop-in for :func:`~pdllm.kernels.split_s_attention.split_s_attention`: same inputs, layouts, split plan,
``lse_out`` and torch reference (:func:`~pdllm.kernels.split_s_reference.split_s_attention_reference`).
Differences: the split merge always runs as the second launch (``fused_merge`` is ignored, ``workspace``
unused), and a program whose row block is empty runs zero-trip loops instead of skipping the body, so the
key loop is not nested in a branch (the warp-specialization pass wants a top-level loop).

TMA: one layer of the pool, ``[num_pages, Hkv, page_size, D]`` dense, is one 2-D descriptor over its
``[num_pages * Hkv * page_size, D]`` rows; the tile of logical slots ``n0 .. n0 + BLOCK_N`` (``BLOCK_N <=
page_size``, so it never leaves its page) is the box at row ``(page * Hkv + head) * page_size + n0 %
page_size``. Only whole tiles of tokens take it (no ``page_fill``, the serving path); the ragged tail, holed
pages and local K/V keep masked pointer loads, so no garbage slot is ever multiplied in.

Features (``mode``): ``"auto"`` asks for TMA + warp specialization, ``"tma"`` for TMA alone, ``"plain"``
for pointer loads. A feature the Triton build or device lacks, a pool layout TMA cannot address, or a
compile failure drops to the next mode down (logged once per cause); :class:`LaunchInfo` says what ran.

Compiled offline for sm_90 with Triton 3.6 (no GPU): ``tma`` builds; ``auto`` fails in the Hopper
warp-specialization pass (its producer hand-off takes only TMA loads) while the Q load, the masked tail or the
local K/V loop use pointer loads; with all three removed it emits a warp-specialized loop. So ``auto`` here
drops to ``tma`` on Triton 3.6 until those loads go through descriptors too.

Selection: :func:`paged_kernel` returns this launcher when ``$PDLLM_SPLIT_S`` is ``hopper``, else today's.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdllm.kernels.resources import guarded, warn_once
from pdllm.kernels.split_s_attention import LOG2E, _num_sms, split_s_attention
from pdllm.kernels.split_s_reference import (
    SplitSConfig,
    check_inputs,
    check_lse_out,
    plan_splits,
    split_s_attention_reference,
)
from pdllm.kernels.split_s_tuning import select_config

try:
    import triton
    import triton.language as tl

    from pdllm.kernels.split_s_attention import _attend, _merge_kernel, _page_rows
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - Triton before host tensor descriptors
    TensorDescriptor = None

__all__ = ["ENV", "MODES", "LaunchInfo", "paged_kernel", "split_s_attention_hopper", "tma_unsupported"]

ENV = "PDLLM_SPLIT_S"
MODES = ("auto", "tma", "plain")
_FAILED: dict[tuple, str] = {}  # (mode, shape key) -> why it failed


@dataclass
class LaunchInfo:
    """What the last launch really used: TMA loads, a warp-specialized loop, the compiled main kernel
    (Triton's object, with ``n_regs``/``n_spills`` on CUDA; None under the interpreter), and why a
    requested feature was dropped."""

    tma: bool = False
    ws: bool = False
    kernel: object | None = None
    dropped: str = ""


if triton is not None:

    @triton.jit
    def _tma_tile(KD, VD, pages, first, n0, h, HKV: tl.constexpr, PAGE: tl.constexpr, SPAN: tl.constexpr):
        # The box of slots n0 .. n0 + BLOCK_N of one request, head h: one page, so one descriptor load each.
        # Its page id comes out of the split's ids already in registers, not a load: a pointer load in the
        # loop is what Triton's Hopper warp specialization cannot hand from producer to consumers.
        page = tl.sum(tl.where(tl.arange(0, SPAN) == n0 // PAGE - first, pages, 0))
        row = (page * HKV + h) * PAGE + n0 % PAGE
        return KD.load([row, 0]), VD.load([row, 0])

    @triton.jit
    def _split_s_hopper_kernel(
        Q, KP, VP, KD, VD, PT, PF, KVL, QO, KL, VL, OP, LSE, OUT, RLSE,
        qk_scale, split_size,
        s_qt, s_qh, s_kp, s_kh, s_pt, s_lt, s_lh, s_vt, s_vh, s_ops, s_opt, s_oph, s_lss, s_lst, s_ot, s_oh,
        G: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_LOCAL: tl.constexpr, HAS_FILL: tl.constexpr, SINGLE: tl.constexpr,
        PRECISION: tl.constexpr, ROW_LSE: tl.constexpr, USE_TMA: tl.constexpr, WS: tl.constexpr,
        SPAN: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        pid_s = tl.program_id(1)
        pid_bh = tl.program_id(2)
        b = pid_bh // HKV
        h = pid_bh % HKV
        q_start = tl.load(QO + b)
        lq = tl.load(QO + b + 1) - q_start
        kv_len = tl.load(KVL + b)
        total = kv_len
        if HAS_LOCAL:
            total = kv_len + lq
        n_begin = pid_s * split_size
        # An empty row block gets an empty key range: zero-trip loops and masked stores, no branch.
        n_end = tl.where(pid_m * BLOCK_M < lq * G, tl.minimum(n_begin + split_size, total), n_begin)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < lq * G
        tok = (q_start + offs_m // G).to(tl.int64)
        head = h * G + offs_m % G
        offs_d = tl.arange(0, D)
        q = tl.load(
            Q + tok[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :], mask=row_ok[:, None], other=0.0
        )

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        arange_n = tl.arange(0, BLOCK_N)
        paged_end = tl.minimum(n_end, kv_len)
        full_end = n_begin
        if not HAS_FILL:
            # Whole tiles of tokens first, unmasked (most of the work), then the ragged rest.
            full_end = n_begin + tl.maximum(paged_end - n_begin, 0) // BLOCK_N * BLOCK_N
            if USE_TMA:
                # The page ids of this split's whole tiles, loaded once (SPAN >= pages a split touches).
                first = n_begin // PAGE
                slots = first + tl.arange(0, SPAN)
                pages = tl.load(PT + b * s_pt + slots, mask=slots * PAGE < full_end, other=0)
                if WS:
                    for n0 in tl.range(n_begin, full_end, BLOCK_N, warp_specialize=True):
                        k, v = _tma_tile(KD, VD, pages, first, n0, h, HKV, PAGE, SPAN)
                        m_i, l_i, acc = _attend(q, k, v, arange_n, m_i, l_i, acc, qk_scale, False, PRECISION)
                else:
                    for n0 in tl.range(n_begin, full_end, BLOCK_N):
                        k, v = _tma_tile(KD, VD, pages, first, n0, h, HKV, PAGE, SPAN)
                        m_i, l_i, acc = _attend(q, k, v, arange_n, m_i, l_i, acc, qk_scale, False, PRECISION)
            else:
                for n0 in tl.range(n_begin, full_end, BLOCK_N):
                    row, valid = _page_rows(PT, PF, b, h, n0, arange_n, paged_end, s_pt, s_kp, s_kh,
                                            D, PAGE, BLOCK_N, HAS_FILL)  # fmt: skip
                    k = tl.load(KP + row[:, None] + offs_d[None, :])
                    v = tl.load(VP + row[:, None] + offs_d[None, :])
                    m_i, l_i, acc = _attend(q, k, v, valid, m_i, l_i, acc, qk_scale, False, PRECISION)
        for n0 in range(full_end, paged_end, BLOCK_N):
            row, valid = _page_rows(PT, PF, b, h, n0, arange_n, paged_end, s_pt, s_kp, s_kh,
                                    D, PAGE, BLOCK_N, HAS_FILL)  # fmt: skip
            k = tl.load(KP + row[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(VP + row[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
            m_i, l_i, acc = _attend(q, k, v, valid, m_i, l_i, acc, qk_scale, True, PRECISION)
        if HAS_LOCAL:
            for n0 in range(tl.maximum(n_begin, kv_len), n_end, BLOCK_N):
                offs_n = n0 + arange_n
                valid = offs_n < n_end
                tok_n = (q_start + offs_n - kv_len).to(tl.int64)
                k = tl.load(
                    KL + (tok_n * s_lt + h * s_lh)[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0
                )
                v = tl.load(
                    VL + (tok_n * s_vt + h * s_vh)[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0
                )
                m_i, l_i, acc = _attend(q, k, v, valid, m_i, l_i, acc, qk_scale, True, PRECISION)

        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_i))
        if SINGLE:
            ptr = OUT + tok[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :]
            tl.store(ptr, o.to(OUT.dtype.element_ty), mask=row_ok[:, None])
            if ROW_LSE:  # natural log (x ln 2), as split_s_attention writes it
                tl.store(RLSE + tok * (G * HKV) + head, lse * 0.6931471805599453, mask=row_ok)
        else:
            ptr = OP + pid_s * s_ops + tok[:, None] * s_opt + head[:, None] * s_oph + offs_d[None, :]
            tl.store(ptr, o, mask=row_ok[:, None])
            tl.store(LSE + pid_s * s_lss + tok * s_lst + head, lse, mask=row_ok)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _ws_in_triton() -> bool:
    return triton is not None and "warp_specialize" in inspect.signature(tl.range.__init__).parameters


def tma_unsupported(device: torch.device, k_pages: torch.Tensor, block_n: int) -> str | None:
    """Why TMA loads cannot serve this call (None: they can). The interpreter emulates descriptor loads."""
    if TensorDescriptor is None:
        return "this Triton has no host TensorDescriptor"
    if not _interpreting():
        if device.type != "cuda":
            return f"TMA needs CUDA, got {device.type}"
        if torch.cuda.get_device_capability(device)[0] < 9:
            return "TMA needs sm_90 or newer"
    _, hkv, page, d = k_pages.shape
    if k_pages.stride() != (hkv * page * d, page * d, d, 1):
        return f"pool layer strides {k_pages.stride()} are not dense [pages, Hkv, page, D]"
    if k_pages.data_ptr() % 16 or (d * k_pages.element_size()) % 16:
        return "TMA needs 16-byte aligned pages and rows"
    if block_n > page:
        return f"block_n {block_n} > page {page}: a tile would cross pages"
    return None


def _modes(mode: str, device: torch.device, k_pages: torch.Tensor, block_n: int, holes: bool) -> list[str]:
    """The modes to try, best first, after dropping those the build, device or layout rule out."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    order = list(MODES[MODES.index(mode) :])
    if holes:  # every tile is masked: nothing for TMA to load (not worth a warning)
        return ["plain"]
    why = tma_unsupported(device, k_pages, block_n)
    if why is not None and order[0] != "plain":
        warn_once(("split_s_hopper", "tma", why), f"split_s_hopper: no TMA ({why}); pointer loads")
        return ["plain"]
    if order[0] == "auto" and not _ws_in_triton():
        warn_once(("split_s_hopper", "ws"), "split_s_hopper: tl.range has no warp_specialize; TMA alone")
        order.pop(0)
    return order


def split_s_attention_hopper(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    q_offsets: torch.Tensor,
    k_local: torch.Tensor | None = None,
    v_local: torch.Tensor | None = None,
    page_fill: torch.Tensor | None = None,
    scale: float | None = None,
    config: SplitSConfig | None = None,
    max_q_len: int | None = None,
    max_kv_len: int | None = None,
    workspace: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    mode: str = "auto",
    info: LaunchInfo | None = None,
) -> torch.Tensor:
    """:func:`~pdllm.kernels.split_s_attention.split_s_attention`'s contract through the Hopper kernel;
    ``mode`` and ``info`` as in the module docstring. ``workspace`` is accepted for the drop-in and unused.
    Config None: the same tuned/heuristic pick as today's kernel; none fitting, or Triton refusing even
    the plain mode for lack of resources, gives the torch reference (logged once)."""
    del workspace  # the merge is always the second launch
    if triton is None:
        raise RuntimeError("split_s_attention_hopper needs triton; use split_s_attention_reference here")
    check_inputs(q, k_pages, v_pages, page_table, kv_lens, q_offsets, k_local, v_local, page_fill)
    check_lse_out(q, lse_out)
    total_q, hq, d = q.shape
    _, hkv, page, _ = k_pages.shape
    batch = page_table.shape[0]
    if k_pages.stride()[2:] != (d, 1) or v_pages.stride() != k_pages.stride():
        raise ValueError("k_pages/v_pages must share strides with each page's [page_size, D] tile contiguous")
    if q.stride(2) != 1 or (k_local is not None and (k_local.stride(2) != 1 or v_local.stride(2) != 1)):
        raise ValueError("q and k_local/v_local need a contiguous last dim")
    if max_q_len is None:
        max_q_len = int((q_offsets[1:] - q_offsets[:-1]).max()) if batch else 0
    if max_kv_len is None:
        max_kv_len = int(kv_lens.max()) if batch else 0
    if total_q == 0 or max_q_len == 0:
        return torch.empty(total_q, hq, d, dtype=q.dtype, device=q.device)
    args = (q, k_pages, v_pages, page_table, kv_lens, q_offsets, k_local, v_local, page_fill, scale)

    def reference() -> torch.Tensor:
        return split_s_attention_reference(*args, lse_out=lse_out)

    cfg = config
    if cfg is None:
        max_total = max_kv_len + (max_q_len if k_local is not None else 0)
        sel = select_config(q.device, q.dtype, max_q_len * (hq // hkv), max_total, batch * hkv, d, page)
        if sel.config is None:
            warn_once(("split_s_hopper", q.dtype, sel.bucket), f"split_s_hopper: no tile config fits at "
                      f"{sel.bucket}; using the torch reference")  # fmt: skip
            return reference()
        cfg = sel.config
    info = info if info is not None else LaunchInfo()
    info.dropped = ""
    shape_key = (q.dtype, d, page, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages,
                 k_local is not None, page_fill is not None, lse_out is not None)  # fmt: skip
    modes = _modes(mode, q.device, k_pages, cfg.block_n, page_fill is not None)
    for m in modes:
        key = (m, *shape_key)
        if key in _FAILED:
            info.dropped = _FAILED[key]
            continue
        if m == "plain":  # the last resort: Triton refusing it for resources means the reference
            launch = lambda: _launch(*args, cfg, max_q_len, max_kv_len, lse_out, "plain", info)  # noqa: E731
            return guarded(("split_s_hopper", *key), launch, reference)
        try:
            return _launch(*args, cfg, max_q_len, max_kv_len, lse_out, m, info)
        except Exception as err:  # noqa: BLE001 - a compile failure of an optional feature drops it
            info.dropped = _FAILED[key] = f"{m}: {type(err).__name__}: {str(err)[:300]}"
            warn_once(("split_s_hopper", "failed", key), f"split_s_hopper: mode {m} failed at {shape_key} "
                      f"({info.dropped}); trying the next")  # fmt: skip
    raise AssertionError("unreachable: the plain mode returns or raises")  # pragma: no cover


def _launch(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    q_offsets: torch.Tensor,
    k_local: torch.Tensor | None,
    v_local: torch.Tensor | None,
    page_fill: torch.Tensor | None,
    scale: float | None,
    config: SplitSConfig,
    max_q_len: int,
    max_kv_len: int,
    lse_out: torch.Tensor | None,
    mode: str,
    info: LaunchInfo,
) -> torch.Tensor:
    total_q, hq, d = q.shape
    _, hkv, page, _ = k_pages.shape
    g = hq // hkv
    batch = page_table.shape[0]
    page_table = page_table.contiguous()
    if page_fill is not None:
        page_fill = page_fill.contiguous()
    has_local = k_local is not None
    max_total = max_kv_len + (max_q_len if has_local else 0)
    out = torch.empty(total_q, hq, d, dtype=q.dtype, device=q.device)
    plan = plan_splits(max_total, batch, hkv, max_q_len * g, config, _num_sms(q.device, config))
    single = plan.num_splits == 1
    if single:
        o_part = lse = out  # unused by the kernel when SINGLE
        ops = opt = oph = lss = lst = 0
    else:
        o_part = torch.empty(plan.num_splits, total_q, hq, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(plan.num_splits, total_q, hq, dtype=torch.float32, device=q.device)
        ops, opt, oph, _ = o_part.stride()
        lss, lst, _ = lse.stride()
    use_tma = mode != "plain"
    if use_tma:
        kd = TensorDescriptor.from_tensor(k_pages.view(-1, d), [config.block_n, d])
        vd = TensorDescriptor.from_tensor(v_pages.view(-1, d), [config.block_n, d])
    else:
        kd, vd = k_pages, v_pages  # unused by the kernel without USE_TMA
    kl = k_local if has_local else q
    vl = v_local if has_local else q
    fill = page_fill if page_fill is not None else page_table
    row_lse = lse_out if lse_out is not None else lse  # unused by the kernels without ROW_LSE
    scale = d**-0.5 if scale is None else scale
    grid = (plan.m_blocks, plan.num_splits, batch * hkv)
    kernel = _split_s_hopper_kernel[grid](
        q, k_pages, v_pages, kd, vd, page_table, fill, kv_lens, q_offsets, kl, vl, o_part, lse, out, row_lse,
        scale * LOG2E, plan.split_size,
        q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), page_table.stride(0),
        kl.stride(0), kl.stride(1), vl.stride(0), vl.stride(1), ops, opt, oph, lss, lst, out.stride(0), out.stride(1),
        G=g, HKV=hkv, D=d, PAGE=page, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        HAS_LOCAL=has_local, HAS_FILL=page_fill is not None, SINGLE=single,
        # fp32 inputs get exact fp32 dots, as in split_s_attention
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", ROW_LSE=lse_out is not None,
        USE_TMA=use_tma, WS=mode == "auto", SPAN=span_pages(plan.split_size, page), num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    info.tma, info.ws, info.kernel = use_tma, mode == "auto", kernel
    if not single:
        n_rows = total_q * hq
        block_r = 16
        _merge_kernel[(triton.cdiv(n_rows, block_r),)](
            o_part, lse, out, row_lse, plan.num_splits, n_rows, ops, lss,
            BLOCK_R=block_r, D=d, ROW_LSE=lse_out is not None, num_warps=4,
        )  # fmt: skip
    return out


def span_pages(split_size: int, page: int) -> int:
    """A power of two >= the pages one split's slots can touch (a split need not start on a page)."""
    return triton.next_power_of_2(-(-split_size // page) + 1)


def paged_kernel() -> Callable[..., torch.Tensor]:
    """The split-S launcher ``$PDLLM_SPLIT_S`` names: unset/empty/``default`` today's kernel, ``hopper``
    this variant (mode ``auto``). Read per call so a process can switch; anything else raises."""
    choice = os.environ.get(ENV, "").strip().lower()
    if choice in ("", "default"):
        return split_s_attention
    if choice == "hopper":
        return split_s_attention_hopper
    raise ValueError(f"${ENV} must be 'default' or 'hopper', got {choice!r}")


def reset() -> None:
    """Forget failed modes (tests)."""
    _FAILED.clear()
