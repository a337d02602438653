"""Split planning, input checks and the two torch implementations of split-S decode attention.

``split_s_attention_reference`` follows the kernel's algorithm (same split plan, per-split partial output
and log-sum-exp, LSE merge) in fp32 torch; ``naive_attention`` is the independent check: gather each
request's valid KV into one contiguous tensor and take ``softmax(QK^T)V`` in float64. Shapes and layouts
are documented in :mod:`pdllm.kernels.split_s_attention`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
# A 512 x 128 fp32 accumulator alone would fill an SM's whole 256 KB register file.
MAX_BLOCK = 256


@dataclass(frozen=True)
class SplitSConfig:
    """Tiling and split policy. ``num_splits`` forces a split count; otherwise it comes from the work."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    num_splits: int | None = None
    # Splits shorter than this are never planned (loop prologue/epilogue would dominate).
    min_split_tokens: int = 128
    # Programs of this tiling resident at once per SM (64x64 tiles, 4 warps, 2 stages: ~80 KB smem -> 2).
    programs_per_sm: float = 2.0
    # Relative cost of writing + merging one fp32 partial row vs reading one token's K and V (see plan).
    partial_cost: float = 0.5
    # Merge the splits inside the main kernel (last program per row block) instead of a second launch.
    fused_merge: bool = False
    num_sms: int | None = None
    # ptxas register cap per thread (Triton's ``maxnreg`` launch option, NVIDIA only); None = no cap. A
    # lower count can fit more programs per SM at the price of spills. The interpreter and reference ignore it.
    maxnreg: int | None = None
    # Store each split's partial output in the input's 16-bit dtype (bf16 / fp16 inputs; fp32 inputs keep
    # fp32 partials) instead of fp32: half the partial traffic; the merge still accumulates in fp32. The
    # reference ignores it (its partials are exact).
    partials_16bit: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if max(self.block_m, self.block_n) > MAX_BLOCK:
            raise ValueError(f"block_m/block_n must be <= {MAX_BLOCK}, got {self.block_m}/{self.block_n}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps}")
        if not 1 <= self.num_stages <= 6:
            raise ValueError(f"num_stages must be in 1..6, got {self.num_stages}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")
        cap = self.maxnreg
        if cap is not None and (type(cap) is not int or not 1 <= cap <= 255):  # 255: sm_90's per-thread limit
            raise ValueError(f"maxnreg must be None or an int in 1..255, got {cap!r}")
        if self.min_split_tokens < 1:
            raise ValueError("min_split_tokens must be >= 1")
        if self.programs_per_sm <= 0 or self.partial_cost < 0:
            raise ValueError(
                f"programs_per_sm must be > 0 and partial_cost >= 0, got {self.programs_per_sm}, "
                f"{self.partial_cost}"
            )


@dataclass(frozen=True)
class SplitPlan:
    num_splits: int
    split_size: int  # logical KV slots per split, a multiple of block_n
    m_blocks: int  # query-row blocks per (request, kv head)


def _round_plan(max_total: int, n: int, block_n: int) -> tuple[int, int]:
    size = -(-max_total // n)
    size = -(-size // block_n) * block_n
    return -(-max_total // size), size


def plan_splits(
    max_total: int, batch: int, num_kv_heads: int, max_rows: int, config: SplitSConfig, num_sms: int
) -> SplitPlan:
    """Flash-decoding split choice from the work, minimising a small wave model.

    With ``P`` programs per split and ``slots = programs_per_sm * num_sms``, ``n`` splits take
    ``ceil(P n / slots)`` waves of programs that each do ``1/n`` of a request's KV; every extra split also
    writes and merges ``max_rows`` fp32 partial rows per KV head, ``n * max_rows / max_total`` of the KV
    traffic. Measured on an H100 (benchmarks/results/attention_notes.md), wave quantisation decides most.
    """
    m_blocks = max(1, -(-max_rows // config.block_m))
    max_total = max(1, max_total)
    if config.num_splits is not None:
        n, size = _round_plan(max_total, config.num_splits, config.block_n)
        return SplitPlan(num_splits=n, split_size=size, m_blocks=m_blocks)
    per_split = batch * num_kv_heads * m_blocks
    slots = max(1.0, config.programs_per_sm * num_sms)
    n_max = max(1, max_total // config.min_split_tokens)
    best: tuple[float, int, int] | None = None
    for want in range(1, min(n_max, 256) + 1):
        n, size = _round_plan(max_total, want, config.block_n)
        waves = math.ceil(per_split * n / slots)
        partial = 0.0 if n == 1 else config.partial_cost * n * max_rows / max_total
        cost = waves * size / max_total * (1.0 + partial)
        if best is None or cost < best[0] - 1e-9:
            best = (cost, n, size)
    assert best is not None
    return SplitPlan(num_splits=best[1], split_size=best[2], m_blocks=m_blocks)


def check_inputs(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    q_offsets: torch.Tensor,
    k_local: torch.Tensor | None,
    v_local: torch.Tensor | None,
    page_fill: torch.Tensor | None,
) -> None:
    """Shape/dtype/device checks that need no device sync; raise ValueError with the offending shape."""
    if q.dim() != 3:
        raise ValueError(f"q must be [total_q, Hq, D], got {tuple(q.shape)}")
    total_q, hq, d = q.shape
    if k_pages.dim() != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages/v_pages must both be [num_pages, Hkv, page_size, D], got {tuple(k_pages.shape)} "
            f"and {tuple(v_pages.shape)}"
        )
    _, hkv, page, dk = k_pages.shape
    if dk != d:
        raise ValueError(f"head dim mismatch: q has {d}, pages have {dk}")
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim {d} not supported (need one of {SUPPORTED_HEAD_DIMS})")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if page & (page - 1):
        raise ValueError(f"page size must be a power of two, got {page}")
    if k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        raise ValueError(f"dtype mismatch: q {q.dtype}, k_pages {k_pages.dtype}, v_pages {v_pages.dtype}")
    if page_table.dim() != 2 or page_table.dtype != torch.int32:
        raise ValueError(
            f"page_table must be int32 [B, max_pages], got {page_table.dtype} {tuple(page_table.shape)}"
        )
    b = page_table.shape[0]
    if kv_lens.shape != (b,) or kv_lens.dtype != torch.int32:
        raise ValueError(f"kv_lens must be int32 [B={b}], got {kv_lens.dtype} {tuple(kv_lens.shape)}")
    if q_offsets.shape != (b + 1,) or q_offsets.dtype != torch.int32:
        raise ValueError(
            f"q_offsets must be int32 [B+1={b + 1}], got {q_offsets.dtype} {tuple(q_offsets.shape)}"
        )
    if page_fill is not None and (page_fill.shape != page_table.shape or page_fill.dtype != torch.int32):
        raise ValueError("page_fill must be int32 with the page table's shape")
    if (k_local is None) != (v_local is None):
        raise ValueError("k_local and v_local must both be given or both be None")
    if k_local is not None and (
        k_local.shape != (total_q, hkv, d) or v_local.shape != k_local.shape or k_local.dtype != q.dtype
    ):
        raise ValueError(
            f"k_local/v_local must be [{total_q}, {hkv}, {d}] {q.dtype}, got {tuple(k_local.shape)}"
        )
    tensors = [q, k_pages, v_pages, page_table, kv_lens, q_offsets, k_local, v_local, page_fill]
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")


def check_lse_out(q: torch.Tensor, lse_out: torch.Tensor | None) -> None:
    """``lse_out`` None, or contiguous float32 ``[total_q, Hq]`` on ``q``'s device (the kernels index it
    as one row of ``Hq`` per query token)."""
    if lse_out is None:
        return
    want = tuple(q.shape[:2])
    if tuple(lse_out.shape) != want or lse_out.dtype != torch.float32 or not lse_out.is_contiguous():
        raise ValueError(f"lse_out must be contiguous float32 {list(want)}, got {lse_out.dtype} "
                         f"{tuple(lse_out.shape)} (contiguous: {lse_out.is_contiguous()})")  # fmt: skip
    if lse_out.device != q.device:
        raise ValueError(f"lse_out must be on {q.device}, got {lse_out.device}")


def gather_request(
    b: int,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    kv_len: int,
    page_fill: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Request ``b``'s logical paged KV, ``[Hkv, kv_len, D]`` each, plus its validity mask ``[kv_len]``."""
    page = k_pages.shape[2]
    n_pages = -(-kv_len // page)
    ids = page_table[b, :n_pages].long()
    hkv, d = k_pages.shape[1], k_pages.shape[3]  # explicit: a request with no paged KV has 0 pages
    k = k_pages[ids].permute(1, 0, 2, 3).reshape(hkv, n_pages * page, d)[:, :kv_len]
    v = v_pages[ids].permute(1, 0, 2, 3).reshape(hkv, n_pages * page, d)[:, :kv_len]
    slot = torch.arange(n_pages * page, device=k.device)
    if page_fill is None:
        valid = torch.ones(n_pages * page, dtype=torch.bool, device=k.device)
    else:
        valid = (slot % page) < page_fill[b, :n_pages].long().repeat_interleave(page)
    return k, v, valid[:kv_len]


def naive_attention(
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
) -> torch.Tensor:
    """``softmax(QK^T)V`` in float64 over each request's gathered valid KV (paged, then local)."""
    check_inputs(q, k_pages, v_pages, page_table, kv_lens, q_offsets, k_local, v_local, page_fill)
    total_q, hq, d = q.shape
    hkv = k_pages.shape[1]
    scale = d**-0.5 if scale is None else scale
    out = torch.zeros(total_q, hq, d, dtype=torch.float64, device=q.device)
    offs = q_offsets.tolist()
    for b, kv_len in enumerate(kv_lens.tolist()):
        q0, q1 = offs[b], offs[b + 1]
        k, v, valid = gather_request(b, k_pages, v_pages, page_table, kv_len, page_fill)
        k, v = k[:, valid], v[:, valid]
        if k_local is not None:
            k = torch.cat([k, k_local[q0:q1].transpose(0, 1)], 1)
            v = torch.cat([v, v_local[q0:q1].transpose(0, 1)], 1)
        k = k.double().repeat_interleave(hq // hkv, 0)  # [Hq, L, D]
        v = v.double().repeat_interleave(hq // hkv, 0)
        qb = q[q0:q1].double().transpose(0, 1)  # [Hq, lq, D]
        p = torch.softmax(qb @ k.transpose(1, 2) * scale, -1)
        out[q0:q1] = (p @ v).transpose(0, 1)
    return out.to(q.dtype)


def split_s_attention_reference(
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
    lse_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel's algorithm in torch: per-split partial attention (fp32) merged by log-sum-exp; the
    merged natural-log LSE ``[total_q, Hq]`` written into ``lse_out`` when given (-inf: no key)."""
    check_inputs(q, k_pages, v_pages, page_table, kv_lens, q_offsets, k_local, v_local, page_fill)
    check_lse_out(q, lse_out)
    config = config or SplitSConfig()
    total_q, hq, d = q.shape
    hkv = k_pages.shape[1]
    g = hq // hkv
    scale = d**-0.5 if scale is None else scale
    offs = q_offsets.tolist()
    lens = kv_lens.tolist()
    lqs = [offs[i + 1] - offs[i] for i in range(len(lens))]
    local = k_local is not None
    max_total = max(n + (lq if local else 0) for n, lq in zip(lens, lqs))
    plan = plan_splits(max_total, len(lens), hkv, max(lqs) * g, config, config.num_sms or 1)
    n, size = plan.num_splits, plan.split_size
    out = torch.zeros(total_q, hq, d, dtype=q.dtype, device=q.device)
    for b, kv_len in enumerate(lens):
        q0, q1 = offs[b], offs[b + 1]
        if q1 == q0:
            continue
        k, v, valid = gather_request(b, k_pages, v_pages, page_table, kv_len, page_fill)
        if local:
            k = torch.cat([k, k_local[q0:q1].transpose(0, 1)], 1)
            v = torch.cat([v, v_local[q0:q1].transpose(0, 1)], 1)
            valid = torch.cat([valid, valid.new_ones(q1 - q0)])
        pad = n * size - k.shape[1]
        k = torch.nn.functional.pad(k.float(), (0, 0, 0, pad)).view(hkv, n, size, d)
        v = torch.nn.functional.pad(v.float(), (0, 0, 0, pad)).view(hkv, n, size, d)
        valid = torch.nn.functional.pad(valid, (0, pad)).view(n, size)
        qb = q[q0:q1].float().view(q1 - q0, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, G, lq, D]
        s = torch.einsum("hgqd,hnkd->hgqnk", qb, k) * scale
        s = s.masked_fill(~valid, float("-inf"))
        m = s.amax(-1)
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m_safe[..., None])
        l_split = p.sum(-1)
        o = torch.einsum("hgqnk,hnkd->hgqnd", p, v) / l_split.clamp_min(1e-30)[..., None]
        lse = torch.where(l_split > 0, m_safe + torch.log(l_split), torch.full_like(m, float("-inf")))
        top = lse.amax(-1, keepdim=True)
        w = torch.exp(lse - torch.where(torch.isinf(top), torch.zeros_like(top), top))
        merged = (w[..., None] * o).sum(-2) / w.sum(-1).clamp_min(1e-30)[..., None]  # [Hkv, G, lq, D]
        out[q0:q1] = merged.permute(2, 0, 1, 3).reshape(q1 - q0, hq, d).to(q.dtype)
        if lse_out is not None:  # top + log(sum w): -inf where no split saw a key (top and w.sum both 0)
            total = torch.where(torch.isinf(top), top, top + torch.log(w.sum(-1, keepdim=True)))[..., 0]
            lse_out[q0:q1] = total.permute(2, 0, 1).reshape(q1 - q0, hq)
    return out
