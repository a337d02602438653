"""Random paged-KV problems shared by the kernel tests and the interpreter cases."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdllm.kernels.paged_kv import PagedKVConfig, PagedKVPool


@dataclass
class Problem:
    q: torch.Tensor
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    page_table: torch.Tensor
    kv_lens: torch.Tensor
    q_offsets: torch.Tensor
    k_local: torch.Tensor | None
    v_local: torch.Tensor | None
    page_fill: torch.Tensor | None

    def args(self) -> tuple:
        return (
            self.q, self.k_pages, self.v_pages, self.page_table, self.kv_lens, self.q_offsets,
            self.k_local, self.v_local, self.page_fill,
        )  # fmt: skip


def make_problem(
    gen: torch.Generator,
    q_lens: list[int],
    chunk_lens: list[list[int]],
    hkv: int,
    group: int,
    head_dim: int,
    page_size: int,
    local: bool = True,
    dtype: torch.dtype = torch.float32,
) -> Problem:
    """Each request ``b`` has ``q_lens[b]`` queries and chunks of ``chunk_lens[b]`` tokens in a shared pool."""
    n_pages = sum(-(-t // page_size) for lens in chunk_lens for t in lens) + 3
    pool = PagedKVPool(PagedKVConfig(1, hkv, head_dim, num_pages=n_pages, page_size=page_size, dtype=dtype))
    pool.allocate(2)  # so a request's pages are not simply 0..n: the table must be followed
    requests = [
        [pool.write_chunk(torch.randn(1, 2, hkv, t, head_dim, generator=gen).to(dtype)) for t in lens]
        for lens in chunk_lens
    ]
    table = pool.build_page_table(requests)
    total_q = sum(q_lens)
    offsets = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    k_pages, v_pages = pool.layer(0)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(dtype)
    return Problem(
        q=rnd(total_q, hkv * group, head_dim),
        k_pages=k_pages,
        v_pages=v_pages,
        page_table=table.page_table,
        kv_lens=table.kv_lens,
        q_offsets=offsets,
        k_local=rnd(total_q, hkv, head_dim) if local else None,
        v_local=rnd(total_q, hkv, head_dim) if local else None,
        page_fill=table.page_fill,
    )


def float64_attention(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-S oracle, float64: per row and head, softmax attention over its request's paged slots below
    ``kv_len`` that are tokens (``page_fill``), gathered slot by slot through the page table, then its own
    rows' local keys (query head h reading KV head h // group); returns the outputs ``[T, Hq, D]`` (zeros
    with no key) and each row's natural-log log-sum-exp of its scaled scores ``[T, Hq]`` (-inf with none)."""
    t, hq, d = p.q.shape
    hkv, page = p.k_pages.shape[1], p.k_pages.shape[2]
    out = torch.zeros(t, hq, d, dtype=torch.float64)
    lse = torch.full((t, hq), float("-inf"), dtype=torch.float64)
    offs = p.q_offsets.tolist()
    for b, kv_len in enumerate(p.kv_lens.tolist()):
        q0, q1 = offs[b], offs[b + 1]
        fill = p.page_fill
        slots = [(int(p.page_table[b, j // page]), j % page) for j in range(kv_len)
                 if fill is None or j % page < int(fill[b, j // page])]  # fmt: skip
        for h in range(hq):
            g = h // (hq // hkv)
            ks = [p.k_pages[pg, g, s] for pg, s in slots]
            vs = [p.v_pages[pg, g, s] for pg, s in slots]
            if p.k_local is not None and p.v_local is not None:
                ks += [p.k_local[r, g] for r in range(q0, q1)]
                vs += [p.v_local[r, g] for r in range(q0, q1)]
            if ks and q1 > q0:
                scores = p.q[q0:q1, h].double() @ torch.stack(ks).double().T / d**0.5
                lse[q0:q1, h] = torch.logsumexp(scores, -1)
                out[q0:q1, h] = torch.softmax(scores, -1) @ torch.stack(vs).double()
    return out, lse
