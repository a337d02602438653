"""Ragged decode batches for ``benchmarks/attention.py``: the ragged entry point against SDPA and FlexAttention
on the same gathered inputs.

A cell is ``n`` decode entries, each with its own number of query rows and its own KV length (drawn
uniformly, seeded), its KV scattered over a shared page pool in shuffled order with a partial last page, and
its own rows' fresh K/V as local keys (bidirectional over both, as decode rows attend). Timed per cell:

- ``ragged``: ``kernels.ragged_attention.ragged_attention`` over the pool (one split-S call for the batch);
- ``sdpa_gathered``: each entry's keys gathered into contiguous tensors beforehand (not timed), then one
  ``scaled_dot_product_attention`` per entry with GQA in the kernel, outputs left per entry (the loop is
  captured in the CUDA graph with the rest, so its launches cost what a graph replay costs);
- ``flex_packed``: every entry's rows packed into one sequence and ``flex_attention`` with a document mask
  (compiled; CUDA only), the keys gathered and packed beforehand.

Roofline as in ``attention.py``: max(bytes read / HBM peak, 4 x sum(rows x keys) x Hq x d / GEMM peak), bytes
= every entry's K/V (its KV slots and its own rows) read once. Errors: each output against a float32 SDPA
over the gathered keys.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdllm.kernels.ragged_attention import DecodeEntry, RaggedBatch, ragged_attention

PAGE = 64


@dataclass(frozen=True)
class RaggedCell:
    name: str
    rows: tuple[int, ...]  # query rows per entry
    kv: tuple[int, ...]  # KV slots per entry (before its own rows)


def ragged_cell(n: int, rows: tuple[int, int], kv: tuple[int, int], seed: int) -> RaggedCell:
    rnd = random.Random(seed)
    r = tuple(rnd.randint(*rows) for _ in range(n))
    k = tuple(rnd.randint(*kv) for _ in range(n))
    return RaggedCell(f"ragged {n} x Lq {rows[0]}-{rows[1]}, KV {kv[0]}-{kv[1]}", r, k)


# The issue's cells: 16-64 requests, rows drawn from 8-280, 4K-32K KV each.
RAGGED_CELLS = [
    ragged_cell(16, (8, 280), (4096, 32768), 0),
    ragged_cell(32, (8, 280), (4096, 16384), 1),
    ragged_cell(64, (8, 96), (4096, 8192), 2),
    ragged_cell(64, (8, 280), (4096, 32768), 3),
]
SMOKE_CELLS = [ragged_cell(3, (2, 9), (20, 150), 0), ragged_cell(4, (1, 5), (1, 70), 1)]


class RaggedCase:
    """One cell's inputs: the pool, the packed rows, their fresh K/V, and the gathered keys per entry."""

    def __init__(self, cell: RaggedCell, hq: int, hkv: int, d: int, dtype: torch.dtype, dev: str,
                 page: int) -> None:  # fmt: skip
        g = torch.Generator(device=dev).manual_seed(0)
        pages_per = [-(-k // page) for k in cell.kv]
        perm = torch.randperm(sum(pages_per), generator=g, device=dev).tolist()
        entries, at = [], 0
        for r, k, p in zip(cell.rows, cell.kv, pages_per, strict=True):
            entries.append(DecodeEntry(r, tuple(perm[at : at + p]), k))
            at += p
        self.batch = RaggedBatch.of(entries, page, torch.device(dev))
        rnd = lambda *s: torch.randn(*s, device=dev, dtype=dtype, generator=g)  # noqa: E731
        t = sum(cell.rows)
        self.q, self.k, self.v = rnd(t, hq, d), rnd(t, hkv, d), rnd(t, hkv, d)
        self.k_pages, self.v_pages = rnd(max(1, at), hkv, page, d), rnd(max(1, at), hkv, page, d)
        self.cell, self.hq, self.hkv = cell, hq, hkv
        self.keys, self.values, starts = [], [], [0]
        for e in entries:
            starts.append(starts[-1] + e.rows)
            slots = torch.arange(e.kv_len, device=dev)
            pg = torch.tensor(e.pages, device=dev, dtype=torch.long)[slots // page] if e.kv_len else slots
            own = slice(starts[-2], starts[-1])
            # [keys, Hkv, d]: the entry's KV slots in logical order, then its own rows
            self.keys.append(torch.cat([self.k_pages[pg, :, slots % page], self.k[own]]))
            self.values.append(torch.cat([self.v_pages[pg, :, slots % page], self.v[own]]))
        self.starts = starts
        # [1, H, rows or keys, d] per entry, made before any timing
        self.per_entry = [
            (self.q[a:b].transpose(0, 1)[None].contiguous(), k.transpose(0, 1)[None].contiguous(),
             v.transpose(0, 1)[None].contiguous())
            for a, b, k, v in zip(starts[:-1], starts[1:], self.keys, self.values, strict=True)
        ]  # fmt: skip

    def ragged(self, kernel: str) -> torch.Tensor:
        return ragged_attention(self.q, self.k, self.v, self.batch, self.k_pages, self.v_pages, kernel=kernel)

    def sdpa_calls(self) -> list[torch.Tensor]:
        """One SDPA call per entry over its gathered keys (GQA in the kernel, as the grid's baseline)."""
        return [F.scaled_dot_product_attention(q, k, v, enable_gqa=True) for q, k, v in self.per_entry]

    def sdpa(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The per-entry SDPA outputs packed ``[T, Hq, D]``, computed in ``dtype`` (None: the inputs')."""
        out = torch.empty(self.q.shape, dtype=dtype or self.q.dtype, device=self.q.device)
        for i, (q, k, v) in enumerate(self.per_entry):
            if dtype is not None:
                q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
            o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            out[self.starts[i] : self.starts[i + 1]] = o[0].transpose(0, 1)
        return out

    def flex(self) -> Callable[[], torch.Tensor]:
        """A compiled FlexAttention call over the packed rows and packed keys (document mask)."""
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        dev = self.q.device
        doc_q = torch.repeat_interleave(torch.arange(len(self.keys), device=dev),
                                        torch.tensor(self.cell.rows, device=dev))  # fmt: skip
        doc_k = torch.repeat_interleave(torch.arange(len(self.keys), device=dev),
                                        torch.tensor([k.shape[0] for k in self.keys], device=dev))  # fmt: skip
        # compiled: built block by block (eagerly the dense [rows, keys] mask of the largest cell needs 82 GB)
        mask = create_block_mask(lambda b, h, qi, ki: doc_q[qi] == doc_k[ki], None, None, doc_q.numel(),
                                 doc_k.numel(), device=str(dev), _compile=True)  # fmt: skip
        q = self.q.transpose(0, 1)[None]
        k = torch.cat(self.keys).transpose(0, 1)[None]
        v = torch.cat(self.values).transpose(0, 1)[None]
        fn = torch.compile(flex_attention, dynamic=False)
        return lambda: fn(q, k, v, block_mask=mask, enable_gqa=True)[0].transpose(0, 1)

    def cost(self, d: int) -> tuple[float, float]:
        """Bytes read (every entry's K/V once, bf16/fp16) and FLOPs (QK^T and PV)."""
        keys = [k.shape[0] for k in self.keys]
        size = self.q.element_size()
        kv_bytes = sum(keys) * self.hkv * d * 2 * size
        q_bytes = 2 * self.q.numel() * size  # read q, write the output
        flops = 4 * sum(r * k for r, k in zip(self.cell.rows, keys, strict=True)) * self.hq * d
        return float(kv_bytes + q_bytes), float(flops)


def ragged_rows(dev: str, dtype: torch.dtype, cells: list[RaggedCell], hq: int, hkv: int, d: int,
                hbm_gbps: float, gemm_tflops: float, time_us: Callable, reps: int,
                page: int = PAGE) -> list[dict]:  # fmt: skip
    """One row per cell: latency per implementation, roofline fraction, speedups, errors."""
    out = []
    for cell in cells:
        case = RaggedCase(cell, hq, hkv, d, dtype, dev, page)
        ref = case.sdpa(torch.float32)
        kernel = "triton" if dev == "cuda" else "torch"
        impls: dict[str, Callable[[], object]] = {
            "ragged": lambda c=case, k=kernel: c.ragged(k),
            "sdpa_gathered": case.sdpa_calls,
        }
        errors: dict[str, str] = {}
        if dev == "cuda":
            try:
                impls["flex_packed"] = case.flex()
            except Exception as exc:  # flex needs a compiler and a recent torch: recorded, not fatal
                errors["flex_packed"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        lat, err = {}, {}
        for name, fn in impls.items():
            try:
                got = case.sdpa() if name == "sdpa_gathered" else fn()  # the same calls, packed
                err[name] = float((got.float() - ref).abs().max())  # type: ignore[union-attr]
                lat[name], _ = time_us(fn, reps, target_s=0.1)
            except Exception as exc:  # a failing implementation is recorded per cell
                errors[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
        nbytes, flops = case.cost(d)
        roof_us = max(nbytes / (hbm_gbps * 1e3), flops / (gemm_tflops * 1e6)) if dev == "cuda" else math.nan
        mine = lat.get("ragged", math.nan)
        out.append({
            "cell": cell.name, "entries": len(cell.rows), "rows": sum(cell.rows), "kv_tokens": sum(cell.kv),
            "bytes": nbytes, "flops": flops, "latency_us": lat, "max_abs_err": err, "errors": errors,
            "roofline_us": roof_us, "roofline_fraction": roof_us / mine if mine == mine else math.nan,
            "speedup_vs_sdpa": lat.get("sdpa_gathered", math.nan) / mine,
            "speedup_vs_flex": lat.get("flex_packed", math.nan) / mine,
        })  # fmt: skip
        del case
        if dev == "cuda":
            torch.cuda.empty_cache()
    return out


def ragged_markdown(rows: list[dict]) -> list[str]:
    def f(v: object, spec: str = ".1f") -> str:
        return "—" if not isinstance(v, float | int) or v != v else format(v, spec)

    lines = ["", "## Ragged decode batches (µs per layer call)", "",
             "Each entry its own rows and KV length over a shared page pool (`attention_ragged.py`); SDPA and "
             "FlexAttention on the same keys gathered beforehand (not timed). Errors: max |out - fp32 SDPA|.", "",
             "| cell | rows | KV tokens | MB read | ragged | sdpa_gathered | flex_packed | roofline frac | x SDPA | "
             "x flex | max err ragged / sdpa / flex |", "|" + "---|" * 11]  # fmt: skip
    for r in rows:
        lat, err = r["latency_us"], r["max_abs_err"]
        lines.append(
            f"| {r['cell']} | {r['rows']} | {r['kv_tokens']} | {r['bytes'] / 1e6:.1f} | {f(lat.get('ragged'))} | "
            f"{f(lat.get('sdpa_gathered'))} | {f(lat.get('flex_packed'))} | {f(r['roofline_fraction'], '.2f')} | "
            f"{f(r['speedup_vs_sdpa'], '.2f')} | {f(r['speedup_vs_flex'], '.2f')} | "
            + " / ".join(f(err.get(n), ".1e") for n in ("ragged", "sdpa_gathered", "flex_packed"))
            + " |"
        )
    errs = [(r["cell"], r["errors"]) for r in rows if r["errors"]]
    if errs:
        lines += ["", "Implementations that could not run:", *[f"- {c}: {e}" for c, e in errs]]
    return lines
