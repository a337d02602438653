"""Experimental Hopper variant of split-S decode attention: K/V page tiles through TMA tensor descriptors,
the unmasked key loop warp-specialized where Triton compiles that. Off by default.

A drop-in for :func:`~pdllm.kernels.split_s_attention.split_s_attention`: same inputs, layouts, split plan,
``lse_out`` and torch reference (:func:`~pdllm.kernels.split_s_reference.split_s_attention_reference`).
Differences: the split merge always runs as the second launch (``fused_merge`` is ignored, ``workspace``
unused), and a program whose row block is empty runs zero-trip loops instead of skipping the body, so the
key loop is not nested in a branch (the warp-specialization pass wants a top-level loop).

Kernels: ``auto`` runs the all-TMA kernel of :mod:`.split_s_hopper_ws` (Q, every paged tile, tails and
holes included, and local K/V through descriptors; its key loop warp-specialized), the only layout Triton
3.6's Hopper warp-specialization pass compiles (offline for sm_90: a ``ttg.warp_specialize`` op at
64x64 tiles, 4 warps), its stage count capped before launch to what fits the device's shared memory.
``tma`` and ``plain`` run :mod:`.split_s_hopper_tma` (pointer loads for Q, the ragged tail and local K/V;
whole tiles through TMA or pointer loads; no ``page_fill`` under ``tma``).

Features (``mode``): a feature the Triton build or device lacks, a layout TMA cannot address, or a compile
failure drops to the next mode down (logged once per cause); :class:`LaunchInfo` says what ran.

Measured against today's kernel on an H200 (``benchmarks/results/split_s_hopper_ab.md``): ``auto``
1.33-1.55x slower, and wrong on a ragged cell (max abs error 1.5e-2 against 4.9e-4) though right under the
interpreter, so a warp-specialized schedule is suspect; ``tma`` 0.97-1.04x and right everywhere. The
default mode is therefore ``tma``; ``auto`` runs only when asked for by name.

Selection: :func:`paged_kernel` returns this launcher (mode ``tma``) when ``$PDLLM_SPLIT_S`` is
``hopper``, else today's.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdllm.kernels.resources import guarded, smem_limit, warn_once
from pdllm.kernels.split_s_attention import LOG2E, _num_sms, launch_merge, launch_sizes, split_s_attention
from pdllm.kernels.split_s_hopper_ws import fit_stages, group_pad, ws_descriptors, ws_unsupported
from pdllm.kernels.split_s_reference import (
    SplitSConfig,
    plan_splits,
    split_s_attention_reference,
)
from pdllm.kernels.split_s_tuning import select_config

try:
    import triton
    import triton.language as tl

    from pdllm.kernels.split_s_hopper_tma import _split_s_hopper_kernel, launch_pointer_q  # noqa: F401
    from pdllm.kernels.split_s_hopper_ws import _split_s_ws_kernel
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
_STAGES: dict[tuple, int] = {}  # (device, constexprs, warps, requested stages) -> stages that fit


@dataclass
class LaunchInfo:
    """What the last launch really used: TMA loads, a warp-specialized loop, the compiled main kernel
    (Triton's object, with ``n_regs``/``n_spills`` on CUDA; None under the interpreter), its pipeline
    stages (``auto`` may take fewer than the config asks, to fit shared memory), and why a requested feature
    was dropped."""

    tma: bool = False
    ws: bool = False
    kernel: object | None = None
    num_stages: int = 0
    dropped: str = ""


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
    if holes:  # the tma mode's unmasked tiles need whole pages; the all-TMA kernel masks holes
        order = [m for m in order if m != "tma"]
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
    mode: str = "tma",
    info: LaunchInfo | None = None,
) -> torch.Tensor:
    """:func:`~pdllm.kernels.split_s_attention.split_s_attention`'s contract through the Hopper kernel;
    ``mode`` and ``info`` as in the module docstring. ``workspace`` is accepted for the drop-in and unused.
    Config None: the same tuned/heuristic pick as today's kernel; none fitting, or Triton refusing even
    the plain mode for lack of resources, gives the torch reference (logged once)."""
    del workspace  # the merge is always the second launch
    if triton is None:
        raise RuntimeError("split_s_attention_hopper needs triton; use split_s_attention_reference here")
    max_q_len, max_kv_len = launch_sizes(
        q, k_pages, v_pages, page_table, kv_lens, q_offsets, k_local, v_local, page_fill, lse_out,
        max_q_len, max_kv_len,
    )  # fmt: skip
    total_q, hq, d = q.shape
    _, hkv, page, _ = k_pages.shape
    batch = page_table.shape[0]
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
    why = ws_unsupported(cfg.block_m, cfg.block_n, page, hq // hkv, q, k_local, v_local)
    if modes[0] == "auto" and why is not None:
        warn_once(("split_s_hopper", "ws", why), f"split_s_hopper: no all-TMA kernel ({why}); next mode")
        modes.pop(0)
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
    rows = group_pad(g) if mode == "auto" else g  # query rows per token in a row block
    plan = plan_splits(max_total, batch, hkv, max_q_len * rows, config, _num_sms(q.device, config))
    single = plan.num_splits == 1
    if single:
        o_part = lse = out  # unused by the kernel when SINGLE
        ops = opt = oph = lss = lst = 0
    else:
        o_part = torch.empty(plan.num_splits, total_q, hq, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(plan.num_splits, total_q, hq, dtype=torch.float32, device=q.device)
        ops, opt, oph, _ = o_part.stride()
        lss, lst, _ = lse.stride()
    scale = d**-0.5 if scale is None else scale
    grid = (plan.m_blocks, plan.num_splits, batch * hkv)
    fill = page_fill if page_fill is not None else page_table
    row_lse = lse_out if lse_out is not None else lse  # unused by the kernels without ROW_LSE
    span = span_pages(plan.split_size, page)
    stages = config.num_stages
    if mode == "auto":
        descs = ws_descriptors(q, k_pages, v_pages, k_local, v_local, config.block_m, config.block_n, g)
        call = (*descs, page_table, fill, kv_lens, q_offsets, o_part, lse, out, row_lse, scale * LOG2E,
                plan.split_size, page_table.stride(0), ops, opt, oph, lss, lst, out.stride(0), out.stride(1))  # fmt: skip
        meta = dict(
            G=g, GP=group_pad(g), HKV=hkv, D=d, PAGE=page, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            HAS_LOCAL=has_local, HAS_FILL=page_fill is not None, SINGLE=single,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", ROW_LSE=lse_out is not None, WS=True,
            SPAN=span, num_warps=config.num_warps,
        )  # fmt: skip

        def shared_of(num_stages: int) -> int:  # compiles (cached), launches nothing
            compiled = _split_s_ws_kernel.warmup(*call, grid=grid, num_stages=num_stages, **meta)
            return (compiled.result() if hasattr(compiled, "result") else compiled).metadata.shared

        if not _interpreting():  # the interpreter has no shared memory to run out of
            key = (q.device, q.dtype, *sorted(meta.items()), config.num_stages)
            stages = ws_stages(key, config.num_stages, q.device, shared_of)
        kernel = _split_s_ws_kernel[grid](*call, num_stages=stages, **meta)
    else:
        kernel = launch_pointer_q(q, k_pages, v_pages, page_table, fill, kv_lens, q_offsets, k_local, v_local,
                                   o_part, lse, out, row_lse, scale, plan.split_size, grid, config, mode, span,
                                   (ops, opt, oph, lss, lst), single, lse_out is not None)  # fmt: skip
    info.tma, info.ws, info.kernel, info.num_stages = mode != "plain", mode == "auto", kernel, stages
    if not single:
        launch_merge(o_part, lse, out, row_lse, plan.num_splits, total_q * hq, ops, lss, lse_out is not None)
    return out


def ws_stages(key: tuple, requested: int, device: torch.device, shared_of: Callable[[int], int]) -> int:
    """Pipeline stages for the warp-specialized kernel: the most, up to ``requested``, whose compile
    (``shared_of``) fits the device's shared memory, chosen before any launch and cached per ``key``. None
    fitting raises, which drops ``auto`` to the next mode for this shape (logged once)."""
    if key not in _STAGES:
        limit = smem_limit(device)
        stages = fit_stages(requested, shared_of, limit)
        if stages is None:
            raise RuntimeError(
                f"the warp-specialized kernel needs more than {limit} B of shared memory at 1 stage"
            )
        if stages < requested:
            warn_once(("split_s_hopper", "stages", key), f"split_s_hopper: auto at {stages} stages instead of "
                      f"{requested} (shared memory limit {limit} B)")  # fmt: skip
        _STAGES[key] = stages
    return _STAGES[key]


def span_pages(split_size: int, page: int) -> int:
    """A power of two >= the pages one split's slots can touch (a split need not start on a page)."""
    return triton.next_power_of_2(-(-split_size // page) + 1)


def paged_kernel() -> Callable[..., torch.Tensor]:
    """The split-S launcher ``$PDLLM_SPLIT_S`` names: unset/empty/``default`` today's kernel, ``hopper``
    this variant (mode ``tma``). Read per call so a process can switch; anything else raises."""
    choice = os.environ.get(ENV, "").strip().lower()
    if choice in ("", "default"):
        return split_s_attention
    if choice == "hopper":
        return split_s_attention_hopper
    raise ValueError(f"${ENV} must be 'default' or 'hopper', got {choice!r}")


def reset() -> None:
    """Forget failed modes and chosen stage counts (tests)."""
    _FAILED.clear()
    _STAGES.clear()
