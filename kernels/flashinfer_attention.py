"""Decode rows over a paged pool through FlashInfer's paged-KV batch prefill (optional: CUDA + flashinfer).

FlashInfer lets only the last page of a sequence be partly filled, while a decode entry's page list has a
partial page wherever one of its chunks ends (``page_fill``, :mod:`.paged_kv`). So :func:`plan_decode` cuts
each entry into segments, runs of whole pages that end in at most one partial page (one per chunk), plus one
segment for the entry's local K/V, which :func:`write_local` copies into scratch pages of the pool. Every
segment is one FlashInfer request: its query rows are its entry's rows again (``q_index`` gathers them,
``qo_indptr`` counts them), its keys its pages (``kv_indptr`` / ``kv_indices`` / ``kv_last_page_len``).
FlashInfer returns each segment's output and base-2 log-sum-exp (``lse_base="log2"``, its default);
:func:`merge_segments` combines an entry's segments by log-sum-exp. The pool layout
``[num_pages, Hkv, page_size, D]`` is FlashInfer's ``HND`` layout, passed as the tuple ``(k_pages, v_pages)``.

- :func:`plan_decode` / :func:`plan_rows`: the plan from what a decode group takes (page table, KV lengths,
  row offsets; :class:`~pdllm.kernels.ragged_attention.DecodeRows`), plus ``page_fill`` and scratch pages.
- :func:`reference_from_plan`: what FlashInfer computes from a plan, in torch (any device and dtype).
- :func:`make_wrapper` and :func:`attend`: the FlashInfer call path; it needs CUDA and an importable
  ``flashinfer`` (:func:`import_flashinfer`; ``benchmarks/flashinfer_carry.py`` builds a tarball of it).
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from pdllm.kernels.ragged_attention import DecodeRows

LN2 = math.log(2.0)
MERGES = ("torch", "flashinfer")


@dataclass(frozen=True)
class FlashInferPlan:
    """Segments of a decode batch as FlashInfer requests (int tensors on the batch's device).

    ``qo_indptr`` int32 ``[S + 1]``: segment ``s`` owns rows ``qo_indptr[s]:qo_indptr[s + 1]`` of the
    gathered queries ``q[q_index]`` (``q_index`` int64 ``[R]``: packed row of each gathered row).
    ``kv_indptr`` int32 ``[S + 1]``, ``kv_indices`` int32 (pool page ids), ``kv_last_page_len`` int32 ``[S]``
    (``1..page_size``): segment ``s`` reads ``(n - 1) * page_size + kv_last_page_len[s]`` slots of its ``n``
    pages. ``merge_index`` int64 ``[T, M]``: packed row ``t``'s gathered rows, one per segment of its entry,
    padded with ``R`` (an empty state). ``local_page`` / ``local_slot`` int64 ``[T]``: where packed row ``t``'s
    local K/V goes in the pool (None: no local K/V)."""

    page_size: int
    qo_indptr: torch.Tensor
    q_index: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    merge_index: torch.Tensor
    local_page: torch.Tensor | None = None
    local_slot: torch.Tensor | None = None

    @property
    def num_segments(self) -> int:
        return self.kv_last_page_len.shape[0]

    @property
    def num_rows(self) -> int:
        return self.merge_index.shape[0]


def segments(pages: list[int], fills: list[int], page_size: int) -> list[tuple[list[int], int]]:
    """``(pages, last_page_len)`` runs of one entry's pages: whole pages, closed by a partial page or the
    entry's last page; pages with no token (fill 0) are skipped."""
    out: list[tuple[list[int], int]] = []
    run: list[int] = []
    for i, (page, fill) in enumerate(zip(pages, fills, strict=True)):
        if fill <= 0:
            if run:  # the run's last page was whole
                out.append((run, page_size))
            run = []
            continue
        run.append(page)
        if fill < page_size or i == len(pages) - 1:
            out.append((run, fill))
            run = []
    return out


def plan_decode(
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    q_offsets: torch.Tensor,
    page_size: int,
    page_fill: torch.Tensor | None = None,
    local_pages: torch.Tensor | None = None,
) -> FlashInferPlan:
    """The plan of a decode batch (host work; reads the tensors once).

    Entry ``b`` owns rows ``q_offsets[b]:q_offsets[b + 1]`` and its first ``kv_lens[b]`` slots through
    ``page_table[b]``; of page ``p`` only the first ``page_fill[b, p]`` slots are tokens (None: every slot
    below ``kv_lens[b]``). ``local_pages`` int ``[B, >= ceil(rows / page_size)]``: scratch pool pages that
    receive entry ``b``'s local K/V (row ``i`` at slot ``i % page_size`` of ``local_pages[b, i // page_size]``);
    None: the rows attend to the paged keys only. An entry with no keys gets a zero row and LSE -inf."""
    table, lens, offs = page_table.tolist(), kv_lens.tolist(), q_offsets.tolist()
    fill_rows = page_fill.tolist() if page_fill is not None else None
    scratch = local_pages.tolist() if local_pages is not None else None
    qo, q_index, kv_ptr, kv_idx, last = [0], [], [0], [], []
    per_row: list[list[int]] = [[] for _ in range(offs[-1])]
    local_page, local_slot = [0] * offs[-1], [0] * offs[-1]
    for b, kv_len in enumerate(lens):
        r0, r1 = offs[b], offs[b + 1]
        if r1 == r0:
            continue
        n = -(-kv_len // page_size)
        fills = [min(page_size, kv_len - p * page_size) for p in range(n)]
        if fill_rows is not None:
            fills = [min(f, fill_rows[b][p]) for p, f in enumerate(fills)]
        segs = segments(table[b][:n], fills, page_size)
        if scratch is not None:
            need = -(-(r1 - r0) // page_size)
            if len(scratch[b]) < need:
                raise ValueError(f"entry {b} has {r1 - r0} local rows, {len(scratch[b])} scratch pages")
            segs.append((scratch[b][:need], r1 - r0 - (need - 1) * page_size))
            for i in range(r1 - r0):
                local_page[r0 + i], local_slot[r0 + i] = scratch[b][i // page_size], i % page_size
        for pages, last_len in segs:
            for i in range(r1 - r0):
                per_row[r0 + i].append(len(q_index) + i)
            q_index.extend(range(r0, r1))
            qo.append(len(q_index))
            kv_idx.extend(pages)
            kv_ptr.append(len(kv_idx))
            last.append(last_len)
    width = max([1, *map(len, per_row)])
    merge = [row + [len(q_index)] * (width - len(row)) for row in per_row]
    dev = page_table.device

    def i32(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int32, device=dev)

    def i64(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64, device=dev)

    return FlashInferPlan(
        page_size, i32(qo), i64(q_index), i32(kv_ptr), i32(kv_idx), i32(last),
        i64(merge).view(len(per_row), width),
        i64(local_page) if scratch is not None else None, i64(local_slot) if scratch is not None else None,
    )  # fmt: skip


def plan_rows(
    g: DecodeRows,
    page_size: int,
    page_fill: torch.Tensor | None = None,
    local_pages: torch.Tensor | None = None,
) -> FlashInferPlan:
    """:func:`plan_decode` of a ragged batch's decode group (rows relative to ``g.start``); ``local_pages``
    is required when the group attends to its local K/V."""
    if g.local and local_pages is None:
        raise ValueError("a decode group with local K/V needs scratch pages for it")
    scratch = local_pages if g.local else None
    return plan_decode(g.page_table, g.kv_lens, g.q_offsets, page_size, page_fill, scratch)


def write_local(
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    k_local: torch.Tensor,
    v_local: torch.Tensor,
    plan: FlashInferPlan,
) -> None:
    """Copy packed rows' local K/V ``[T, Hkv, D]`` into the plan's scratch slots of the pool."""
    if plan.local_page is None or plan.local_slot is None:
        raise ValueError("the plan has no local segments")
    k_pages[plan.local_page, :, plan.local_slot] = k_local
    v_pages[plan.local_page, :, plan.local_slot] = v_local


def merge_segments(
    out: torch.Tensor, lse2: torch.Tensor, plan: FlashInferPlan
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per packed row, its segments' outputs ``[R, Hq, D]`` weighted by ``2 ** lse2`` (``[R, Hq]``, base 2)
    and renormalized: ``([T, Hq, D]`` in ``out``'s dtype, natural-log LSE ``[T, Hq]`` float32 or float64)."""
    acc = torch.promote_types(out.dtype, torch.float32)
    o = torch.cat([out.to(acc), out.new_zeros(1, *out.shape[1:], dtype=acc)])[plan.merge_index]
    s = torch.cat([lse2.to(acc), lse2.new_full((1, lse2.shape[1]), -math.inf, dtype=acc)])[plan.merge_index]
    top = s.amax(1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w = torch.exp2(s - top)  # [T, M, Hq]
    den = w.sum(1)
    merged = (w[..., None] * o).sum(1) / den.clamp_min(1e-30)[..., None]
    lse = torch.where(den > 0, (top[:, 0] + torch.log2(den)) * LN2, torch.full_like(den, -math.inf))
    return merged.to(out.dtype), lse


def segment_attention(
    qe: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    plan: FlashInferPlan,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What FlashInfer's run returns for ``plan``, in torch: each segment's softmax attention of its gathered
    query rows ``qe`` ``[R, Hq, D]`` over its pages' first slots (scores in fp32, fp64 for fp64 inputs),
    ``(out [R, Hq, D]`` in ``qe``'s dtype, base-2 LSE ``[R, Hq])``."""
    _, hkv, page, d = k_pages.shape
    hq, acc = qe.shape[1], torch.promote_types(qe.dtype, torch.float32)
    scale = d**-0.5 if scale is None else scale
    out = torch.zeros_like(qe)
    lse2 = torch.full(qe.shape[:2], -math.inf, dtype=acc, device=qe.device)
    qo, kv_ptr = plan.qo_indptr.tolist(), plan.kv_indptr.tolist()
    kv_idx, last = plan.kv_indices.long(), plan.kv_last_page_len.tolist()
    for s in range(plan.num_segments):
        if not 1 <= last[s] <= page:
            raise ValueError(f"segment {s}: last page length {last[s]} outside 1..{page}")
        ids = kv_idx[kv_ptr[s] : kv_ptr[s + 1]]
        n = (ids.numel() - 1) * page + last[s]
        k = k_pages[ids].permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :n].to(acc)
        v = v_pages[ids].permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :n].to(acc)
        k, v = k.repeat_interleave(hq // hkv, 0), v.repeat_interleave(hq // hkv, 0)  # [Hq, n, D]
        scores = torch.einsum("rhd,hnd->hrn", qe[qo[s] : qo[s + 1]].to(acc), k) * scale
        out[qo[s] : qo[s + 1]] = torch.einsum("hrn,hnd->rhd", torch.softmax(scores, -1), v).to(qe.dtype)
        lse2[qo[s] : qo[s + 1]] = (torch.logsumexp(scores, -1) / LN2).transpose(0, 1)
    return out, lse2


def reference_from_plan(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    plan: FlashInferPlan,
    k_local: torch.Tensor | None = None,
    v_local: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's result for ``plan`` in torch: local K/V into a copy of the pool, the gathered rows'
    :func:`segment_attention`, then :func:`merge_segments`: ``(out [T, Hq, D]``, natural-log LSE
    ``[T, Hq])``. The caller's pool is not modified."""
    if plan.local_page is not None:
        if k_local is None or v_local is None:
            raise ValueError("the plan has local segments: pass k_local and v_local")
        k_pages, v_pages = k_pages.clone(), v_pages.clone()
        write_local(k_pages, v_pages, k_local, v_local, plan)
    return merge_segments(*segment_attention(q[plan.q_index], k_pages, v_pages, plan, scale), plan)


def available() -> bool:
    """Whether :func:`attend` can run here (CUDA and an importable flashinfer)."""
    return torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


def import_flashinfer() -> ModuleType:
    """``flashinfer``; for the tarball of ``benchmarks/flashinfer_carry.py`` (its ``site`` on ``PYTHONPATH``)
    its ``fallback`` folder goes to the end of ``sys.path`` and ``fallback/bin`` to ``PATH`` if no ninja."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or spec.origin is None:
        raise ImportError(
            "flashinfer is not importable: extract the slim tarball and put its site/ on PYTHONPATH"
        )
    fallback = Path(spec.origin).parents[2] / "fallback"
    if fallback.is_dir() and str(fallback) not in sys.path:
        sys.path.append(str(fallback))
        if shutil.which("ninja") is None:
            os.environ["PATH"] += os.pathsep + str(fallback / "bin")
    import flashinfer

    return flashinfer


def make_wrapper(
    plan: FlashInferPlan,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    backend: str = "auto",
    workspace: torch.Tensor | None = None,
    scale: float | None = None,
) -> Any:
    """A ``BatchPrefillWithPagedKVCacheWrapper`` (``HND``, bidirectional) planned for ``plan``; ``backend``
    "auto", "fa2" or "fa3" (sm90). Planning compiles the module on first use (nvcc, minutes)."""
    fi = import_flashinfer()
    device = plan.qo_indptr.device
    if workspace is None:
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND", backend=backend)
    wrapper.plan(
        plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len, num_qo_heads, num_kv_heads,
        head_dim, plan.page_size, causal=False, sm_scale=scale, q_data_type=dtype, kv_data_type=dtype,
    )  # fmt: skip
    return wrapper


def attend(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    plan: FlashInferPlan,
    wrapper: Any,
    k_local: torch.Tensor | None = None,
    v_local: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    merge: str = "torch",
) -> torch.Tensor:
    """Attention ``[T, Hq, D]`` of packed rows ``q`` through ``wrapper`` (:func:`make_wrapper` of ``plan``):
    local K/V into the scratch pages (this writes the pool), one FlashInfer call over every segment, the
    merge ("torch": :func:`merge_segments`; "flashinfer": its ``merge_states``). ``lse_out`` (float32
    ``[T, Hq]``) receives each row's natural-log LSE. Capturable in a CUDA graph after the first call."""
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
    if plan.local_page is not None:
        if k_local is None or v_local is None:
            raise ValueError("the plan has local segments: pass k_local and v_local")
        write_local(k_pages, v_pages, k_local, v_local, plan)
    out, lse2 = wrapper.run(q.index_select(0, plan.q_index), (k_pages, v_pages), return_lse=True)
    if merge == "torch":
        merged, lse = merge_segments(out, lse2, plan)
    else:
        o = torch.cat([out, out.new_zeros(1, *out.shape[1:])])[plan.merge_index]
        s = torch.cat([lse2, lse2.new_full((1, lse2.shape[1]), -math.inf)])[plan.merge_index]
        merged, lse = import_flashinfer().merge_states(o, s)
        lse = lse * LN2
    if lse_out is not None:
        lse_out.copy_(lse)
    return merged
