"""Split-S decode attention over a paged chunk-KV pool plus each request's own local KV (Triton).

Layout (all tensors on one device; ``B`` requests, ragged query lengths):

- ``q``: ``[total_q, Hq, D]``, request ``b``'s queries are rows ``q_offsets[b]:q_offsets[b+1]``; RoPE applied.
- ``k_pages, v_pages``: one layer of the pool, ``[num_pages, Hkv, page_size, D]`` with the last two dims
  contiguous (one page of one head is a contiguous ``page_size x D`` tile), ``page_size`` a power of two.
- ``page_table``: int32 ``[B, max_pages]``; request ``b``'s logical KV slot ``j`` (``j < kv_lens[b]``) is slot
  ``j % page_size`` of page ``page_table[b, j // page_size]``.
- ``page_fill``: optional int32 ``[B, max_pages]``: only the first ``page_fill[b, p]`` slots of a page are
  tokens (chunks that end mid-page leave holes); None = every slot below ``kv_lens[b]`` is a token.
- ``k_local, v_local``: ``[total_q, Hkv, D]`` packed like ``q`` (the request's query + response tokens), or
  None. Attention is bidirectional: every query sees all of its request's paged tokens and local tokens.
- returns ``[total_q, Hq, D]`` in ``q``'s dtype. A request with no keys at all gets zeros.
- ``lse_out``: optional contiguous float32 ``[total_q, Hq]``, written with each row's natural-log
  log-sum-exp of its scaled scores over every key it attends to (-inf where it has none): the normalizer
  the salient-column update (:mod:`.salient_attention`) takes as ``lse``. Not given: nothing is written.

GQA: a program owns one (request, KV head) and stacks the ``G = Hq / Hkv`` query heads of that KV head
as extra query rows (row ``r`` = token ``r // G``, head ``h*G + r % G``), so each K/V tile is loaded once
for the whole group and never repeated in memory.

Split-S / flash-decoding: the logical KV range (paged slots, then local tokens) is cut into splits of a
common size; programs are (row block, split, request x KV head). Each writes its fp32 partial output and
base-2 log-sum-exp; a second small kernel merges the splits. With one split the first kernel writes the
final output directly. The split count comes from the work (:func:`plan_splits`), so a batch of one still
spreads over all SMs. fp32 accumulation throughout; bf16/fp16 (or fp32) inputs.

Tiles, warps, stages and the split policy come per call from ``config``; left None, from the tuned table by
device name and shape bucket, or a heuristic where the table has no entry, fitted to the device's shared
memory for the input dtype (:mod:`.split_s_tuning`); the torch reference where nothing fits.
"""

from __future__ import annotations

import torch

from pdllm.kernels.resources import guarded, warn_once
from pdllm.kernels.split_s_reference import (
    SplitPlan,
    SplitSConfig,
    check_inputs,
    check_lse_out,
    naive_attention,
    plan_splits,
    split_s_attention_reference,
)
from pdllm.kernels.split_s_tuning import select_config

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None

__all__ = [
    "SplitPlan",
    "SplitSConfig",
    "naive_attention",
    "plan_splits",
    "split_s_attention",
    "split_s_attention_reference",
]

LOG2E = 1.4426950408889634

if triton is not None:
    from pdllm.kernels.split_s_blocks import (
        _attend,
        _merge_splits,
        _merge_splits_unrolled,
        _page_rows,
        _store_rows,
    )

    @triton.jit
    def _split_s_kernel(
        Q, KP, VP, PT, PF, KVL, QO, KL, VL, OP, LSE, OUT, CNT, RLSE,
        qk_scale, split_size,
        s_qt, s_qh, s_kp, s_kh, s_pt, s_lt, s_lh, s_vt, s_vh, s_ops, s_opt, s_oph, s_lss, s_lst, s_ot, s_oh,
        G: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_LOCAL: tl.constexpr, HAS_FILL: tl.constexpr, SINGLE: tl.constexpr, FUSED: tl.constexpr,
        PRECISION: tl.constexpr, ROW_LSE: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        pid_s = tl.program_id(1)
        pid_bh = tl.program_id(2)
        b = pid_bh // HKV
        h = pid_bh % HKV
        q_start = tl.load(QO + b)
        lq = tl.load(QO + b + 1) - q_start
        if pid_m * BLOCK_M < lq * G:
            kv_len = tl.load(KVL + b)
            total = kv_len
            if HAS_LOCAL:
                total = kv_len + lq
            n_begin = pid_s * split_size
            n_end = tl.minimum(n_begin + split_size, total)

            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = offs_m < lq * G
            tok = (q_start + offs_m // G).to(tl.int64)
            head = h * G + offs_m % G
            offs_d = tl.arange(0, D)
            q = tl.load(
                Q + tok[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :],
                mask=row_ok[:, None],
                other=0.0,
            )

            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, D], tl.float32)
            arange_n = tl.arange(0, BLOCK_N)
            paged_end = tl.minimum(n_end, kv_len)
            full_end = n_begin
            if not HAS_FILL:
                # Whole blocks of tokens first, without masks (most of the work), then the ragged rest.
                full_end = n_begin + tl.maximum(paged_end - n_begin, 0) // BLOCK_N * BLOCK_N
                for n0 in range(n_begin, full_end, BLOCK_N):
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
                    row_k = tok_n * s_lt + h * s_lh
                    row_v = tok_n * s_vt + h * s_vh
                    k = tl.load(KL + row_k[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
                    v = tl.load(VL + row_v[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
                    m_i, l_i, acc = _attend(q, k, v, valid, m_i, l_i, acc, qk_scale, True, PRECISION)

            _store_rows(acc, m_i, l_i, OUT, OP, LSE, RLSE, tok, head, offs_d, row_ok, pid_s,
                        s_ot, s_oh, s_ops, s_opt, s_oph, s_lss, s_lst, G, HKV, SINGLE, ROW_LSE)  # fmt: skip
            if not SINGLE and FUSED:
                # The last split program of this (request, head, row block) to finish merges; the
                # barrier + acq_rel atomic publish every thread's partial stores first.
                tl.debug_barrier()
                idx = pid_bh * tl.num_programs(0) + pid_m
                done = tl.atomic_add(CNT + idx, 1, sem="acq_rel", scope="gpu")
                if done == tl.num_programs(1) - 1:
                    res, merged_lse = _merge_splits(
                        OP, LSE, tok[:, None] * s_opt + head[:, None] * s_oph + offs_d[None, :],
                        tok * s_lst + head, row_ok, tl.num_programs(1), s_ops, s_lss, BLOCK_M, D, ".cg",
                    )  # fmt: skip
                    # (new names: `total` is the int key count; Triton refuses a name rebound to another
                    # type)
                    out_ptr = OUT + tok[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :]
                    tl.store(out_ptr, res.to(OUT.dtype.element_ty), mask=row_ok[:, None])
                    if ROW_LSE:  # natural log (x ln 2)
                        tl.store(RLSE + tok * (G * HKV) + head, merged_lse * 0.6931471805599453, mask=row_ok)
                    tl.atomic_xchg(CNT + idx, 0)  # leave the workspace zeroed for the next call

    @triton.jit
    def _merge_kernel(OP, LSE, OUT, RLSE, n_split, n_rows, s_ops, s_lss, BLOCK_R: tl.constexpr,
                      D: tl.constexpr, ROW_LSE: tl.constexpr, NSP: tl.constexpr = 0):  # fmt: skip
        # Rows are (token, head) pairs in [total_q, Hq] order, which is also ``lse_out``'s.
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        ok = rows < n_rows
        offs_d = tl.arange(0, D)
        o_off = rows[:, None] * D + offs_d[None, :]
        if NSP > 0:
            out, total = _merge_splits_unrolled(
                OP, LSE, o_off, rows, ok, n_split, s_ops, s_lss, BLOCK_R, D, NSP
            )
        else:
            out, total = _merge_splits(OP, LSE, o_off, rows, ok, n_split, s_ops, s_lss, BLOCK_R, D, "")
        tl.store(OUT + rows[:, None] * D + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=ok[:, None])
        if ROW_LSE:  # natural log (x ln 2)
            tl.store(RLSE + rows, total * 0.6931471805599453, mask=ok)


def _num_sms(device: torch.device, config: SplitSConfig) -> int:
    if config.num_sms is not None:
        return config.num_sms
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def split_s_attention(
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
) -> torch.Tensor:
    """Launch the split-S kernel (see the module docstring for layouts; ``lse_out`` there).

    ``config`` None: the tuned table's config for this device and shape bucket, else the heuristic's, fitted
    to the device's shared memory for this dtype (:func:`pdllm.kernels.split_s_tuning.select_config`, host
    integers only). Where no config fits, or Triton still refuses the launch for lack of resources, the
    result comes from :func:`split_s_attention_reference` (logged once per dtype and shape class; it reads
    lengths on the host, so it is not capturable in a CUDA graph). An explicit config is launched as given.

    ``workspace`` (``config.fused_merge`` only): a zeroed int32 tensor of at least ``B * Hkv * m_blocks``
    counters, reused across calls (the kernel leaves it zeroed); omitted, one is allocated per call.

    ``max_q_len``/``max_kv_len`` (per-request maxima) size the grid; pass them to avoid a device->host sync
    and to keep the call capturable in a CUDA graph. Omitted, they are read from ``q_offsets``/``kv_lens``.
    """
    if triton is None:
        raise RuntimeError("split_s_attention needs triton; use split_s_attention_reference on this machine")
    max_q_len, max_kv_len = launch_sizes(
        q, k_pages, v_pages, page_table, kv_lens, q_offsets, k_local, v_local, page_fill, lse_out,
        max_q_len, max_kv_len,
    )  # fmt: skip
    total_q, hq, d = q.shape
    _, hkv, page, _ = k_pages.shape
    g = hq // hkv
    batch = page_table.shape[0]
    args = (q, k_pages, v_pages, page_table, kv_lens, q_offsets, k_local, v_local, page_fill, scale)
    if total_q == 0 or max_q_len == 0:
        return torch.empty(total_q, hq, d, dtype=q.dtype, device=q.device)
    if config is not None:
        return _launch(*args, config, max_q_len, max_kv_len, workspace, lse_out)
    max_total = max_kv_len + (max_q_len if k_local is not None else 0)
    sel = select_config(q.device, q.dtype, max_q_len * g, max_total, batch * hkv, d, page)

    def reference() -> torch.Tensor:
        return split_s_attention_reference(*args, lse_out=lse_out)

    if sel.config is None:
        warn_once(
            ("split_s_attention", q.dtype, sel.bucket),
            f"split_s_attention: no tile config fits {sel.smem_limit} bytes of shared memory for {q.dtype} "
            f"at {sel.bucket}; using the torch reference",
        )
        return reference()
    cfg = sel.config
    key = launch_key(q.dtype, d, page, cfg)
    return guarded(key, lambda: _launch(*args, cfg, max_q_len, max_kv_len, workspace, lse_out), reference)


def launch_sizes(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    q_offsets: torch.Tensor,
    k_local: torch.Tensor | None,
    v_local: torch.Tensor | None,
    page_fill: torch.Tensor | None,
    lse_out: torch.Tensor | None,
    max_q_len: int | None,
    max_kv_len: int | None,
) -> tuple[int, int]:
    """A split-S launcher's input checks (shapes, the strides the kernels read with) and its grid sizes:
    ``max_q_len`` / ``max_kv_len`` as given, else read from ``q_offsets`` / ``kv_lens`` (a host sync)."""
    check_inputs(q, k_pages, v_pages, page_table, kv_lens, q_offsets, k_local, v_local, page_fill)
    check_lse_out(q, lse_out)
    d = q.shape[2]
    batch = page_table.shape[0]
    if k_pages.stride()[2:] != (d, 1) or v_pages.stride() != k_pages.stride():
        raise ValueError("k_pages/v_pages must share strides with each page's [page_size, D] tile contiguous")
    if q.stride(2) != 1 or (k_local is not None and (k_local.stride(2) != 1 or v_local.stride(2) != 1)):
        raise ValueError("q and k_local/v_local need a contiguous last dim")
    if max_q_len is None:
        max_q_len = int((q_offsets[1:] - q_offsets[:-1]).max()) if batch else 0
    if max_kv_len is None:
        max_kv_len = int(kv_lens.max()) if batch else 0
    return max_q_len, max_kv_len


def partial_dtype(dtype: torch.dtype, cfg: SplitSConfig) -> torch.dtype:
    """The dtype of the split partials: the input's with ``partials_16bit`` and 16-bit inputs, else fp32."""
    return dtype if cfg.partials_16bit and dtype in (torch.bfloat16, torch.float16) else torch.float32


def launch_key(dtype: torch.dtype, head_dim: int, page: int, cfg: SplitSConfig) -> tuple:
    """Key of a refused launch in :func:`~pdllm.kernels.resources.guarded`: every config field the compiled
    kernel depends on (``maxnreg`` too: a capped and an uncapped config are different kernels)."""
    tiles = (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.fused_merge, cfg.maxnreg,
             partial_dtype(dtype, cfg))  # fmt: skip
    return ("split_s_attention", dtype, head_dim, page, *tiles)


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
    workspace: torch.Tensor | None,
    lse_out: torch.Tensor | None = None,
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
        o_part = torch.empty(
            plan.num_splits, total_q, hq, d, dtype=partial_dtype(q.dtype, config), device=q.device
        )
        lse = torch.empty(plan.num_splits, total_q, hq, dtype=torch.float32, device=q.device)
        ops, opt, oph, _ = o_part.stride()
        lss, lst, _ = lse.stride()
    fused = config.fused_merge and not single
    cnt_size = batch * hkv * plan.m_blocks
    if not fused:
        counters = page_table
    elif workspace is None:
        counters = torch.zeros(cnt_size, dtype=torch.int32, device=q.device)
    elif workspace.dtype != torch.int32 or workspace.numel() < cnt_size or workspace.device != q.device:
        raise ValueError(f"workspace must be int32 with >= {cnt_size} elements on {q.device}")
    else:
        counters = workspace
    kl = k_local if has_local else q
    vl = v_local if has_local else q
    fill = page_fill if page_fill is not None else page_table
    row_lse = lse_out if lse_out is not None else lse  # unused by the kernels without ROW_LSE
    scale = d**-0.5 if scale is None else scale
    grid = (plan.m_blocks, plan.num_splits, batch * hkv)
    _split_s_kernel[grid](
        q, k_pages, v_pages, page_table, fill, kv_lens, q_offsets, kl, vl, o_part, lse, out, counters,
        row_lse, scale * LOG2E, plan.split_size,
        q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), page_table.stride(0),
        kl.stride(0), kl.stride(1), vl.stride(0), vl.stride(1), ops, opt, oph, lss, lst, out.stride(0), out.stride(1),
        G=g, HKV=hkv, D=d, PAGE=page, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        HAS_LOCAL=has_local, HAS_FILL=page_fill is not None, SINGLE=single, FUSED=fused,
        # fp32 inputs (tests, small fp32 models) get exact fp32 dots; tf32 would cost them ~1e-3 relative
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", ROW_LSE=lse_out is not None,
        num_warps=config.num_warps, num_stages=config.num_stages, maxnreg=config.maxnreg,
    )  # fmt: skip
    if not single and not fused:
        launch_merge(o_part, lse, out, row_lse, plan.num_splits, total_q * hq, ops, lss, lse_out is not None)
    return out


MERGE_UNROLL_MAX = 32  # splits merged by the unrolled loop; more: the rolled one (its code would grow)
MERGE_UNROLLED_ROWS = 4  # (token, head) rows per unrolled merge program


def launch_merge(o_part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, row_lse: torch.Tensor,
                 num_splits: int, n_rows: int, ops: int, lss: int, want_lse: bool) -> None:  # fmt: skip
    """The second launch of a multi-split call: each row's split partials merged by log-sum-exp into ``out``
    (and ``row_lse`` when ``want_lse``). Up to ``MERGE_UNROLL_MAX`` splits the loop over them is unrolled
    (to the next power of two, masked), 4 rows a program, so every split's loads can issue at once: on an
    H100 the batch-1 call (Lq 32, 4,096 keys, 13 splits) took 16.4 µs against 21.9 split by split, 16 rows a
    program (``benchmarks/results/attention_notes.md``)."""
    nsp = 1 << max(0, num_splits - 1).bit_length() if num_splits <= MERGE_UNROLL_MAX else 0
    block_r = MERGE_UNROLLED_ROWS if nsp else 16
    _merge_kernel[(triton.cdiv(n_rows, block_r),)](
        o_part, lse, out, row_lse, num_splits, n_rows, ops, lss,
        BLOCK_R=block_r, D=out.shape[-1], ROW_LSE=want_lse, NSP=nsp, num_warps=4,
    )  # fmt: skip
