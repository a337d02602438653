"""The FlashInfer plan of a decode batch (``kernels/flashinfer_attention``), checked on the CPU.

The batch: GQA heads, several entries of different row counts whose chunks end mid-page (holes filled with
noise, so a read past a chunk's tokens changes the answer), page lists shuffled through the pool, an entry
without chunks, one with chunks ending on a page boundary, one without rows. :func:`reference_from_plan`
(what FlashInfer computes from the plan: per-segment softmax and base-2 LSE, then the merge) must equal
``ragged_attention``'s torch path (float64) on the same tokens packed without holes, outputs and LSE.

Planted by hand (each failed the tests named; reverted):
- a segment that runs past its chunk's filled slots (``segments`` closing a partial page with
  ``last_page_len = fill + 1``) -> ``test_plan_matches_ragged_attention`` (both cases),
  ``test_segments_of_holed_pages`` and ``test_entry_without_keys`` fail;
- segments merged without LSE weighting (``merge_segments`` weighting every segment 1) ->
  ``test_plan_matches_ragged_attention`` (both cases) fails;
- an entry's query rows offset by one in ``qo_indptr`` (``plan_decode`` appending ``len(q_index) + 1`` after
  the first segment) -> ``test_plan_matches_ragged_attention`` (both cases) and
  ``test_plan_is_a_valid_flashinfer_batch`` fail.
"""

from __future__ import annotations

import pytest
import torch

from pdllm.kernels.flashinfer_attention import (
    FlashInferPlan,
    attend,
    plan_decode,
    plan_rows,
    reference_from_plan,
    segment_attention,
    segments,
)
from pdllm.kernels.paged_kv import PagedKVConfig, PagedKVPool
from pdllm.kernels.ragged_attention import DecodeEntry, DecodeRows, RaggedBatch, ragged_attention

HKV, G, D, PAGE = 2, 3, 16, 8
# per entry: query rows, chunk token counts (chunks back to back in its page list)
ENTRIES = [(3, [5, 16, 9]), (1, [8, 8]), (7, []), (0, [4]), (12, [3, 1, 21]), (2, [17])]


def _pools(gen: torch.Generator, entries: list[tuple[int, list[int]]], local: bool) -> dict:
    """A holed pool (chunks written page-aligned, holes noise) with scratch pages for local K/V, and a packed
    pool with each entry's tokens back to back (no holes), for ``ragged_attention``."""
    pages = sum(-(-t // PAGE) for _, lens in entries for t in lens) + sum(-(-r // PAGE) for r, _ in entries)
    cfg = PagedKVConfig(1, HKV, D, num_pages=pages + 4, page_size=PAGE, dtype=torch.float64)
    holed, packed = PagedKVPool(cfg), PagedKVPool(cfg)
    holed.kv.zero_()  # the pool starts as torch.empty: a NaN there would fail the unchanged-pool check
    holed.allocate(1)  # page ids do not start at 0
    perm = torch.randperm(cfg.num_pages - 1, generator=gen).add(1).tolist()  # shuffled page lists
    requests, tokens = [], []
    for _, lens in entries:
        chunks = [torch.randn(1, 2, HKV, t, D, generator=gen, dtype=torch.float64) for t in lens]
        requests.append(
            [holed.write_chunk(c, [perm.pop() for _ in range(-(-c.shape[3] // PAGE))]) for c in chunks]
        )
        tokens.append(torch.cat(chunks, 3) if chunks else torch.zeros(1, 2, HKV, 0, D, dtype=torch.float64))
    table = holed.build_page_table(requests)
    for b in range(len(entries)):  # noise in every hole a wrong segment length would read
        for p, fill in enumerate(table.page_fill[b].tolist()):
            if 0 < fill < PAGE:
                page = int(table.page_table[b, p])
                holed.kv[0, :, page, :, fill:] = (
                    50 * torch.randn(2, HKV, PAGE - fill, D, generator=gen).double()
                )
    scratch = torch.zeros(len(entries), max(1, *(-(-r // PAGE) for r, _ in entries)), dtype=torch.int32)
    for b, (rows, _) in enumerate(entries):
        scratch[b, : -(-rows // PAGE)] = torch.tensor(
            [perm.pop() for _ in range(-(-rows // PAGE))], dtype=torch.int32
        )
    dec = []
    for (rows, _), t in zip(entries, tokens, strict=True):
        ids = tuple(packed.write_chunk(t).pages) if t.shape[3] else ()
        dec.append(DecodeEntry(rows, ids, t.shape[3]))
    batch = RaggedBatch.of(dec, PAGE, torch.device("cpu"))
    if not local:  # one decode group; the same rows without their own K/V
        g = batch.groups[0]
        assert isinstance(g, DecodeRows)
        batch = RaggedBatch((DecodeRows(g.start, g.rows, g.page_table, g.kv_lens, g.q_offsets, g.max_q_len,
                                        g.max_kv_len, local=False),))  # fmt: skip
    total = sum(r for r, _ in entries)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    return {"holed": holed, "packed": packed, "table": table, "scratch": scratch, "batch": batch,
            "q": rnd(total, HKV * G, D), "k": rnd(total, HKV, D), "v": rnd(total, HKV, D)}  # fmt: skip


def _plan(p: dict, local: bool) -> FlashInferPlan:
    """The plan of the holed pool's decode group (same rows as the packed batch's)."""
    g, t = p["batch"].groups[0], p["table"]
    holed = DecodeRows(
        0, g.rows, t.page_table, t.kv_lens, g.q_offsets, g.max_q_len, int(t.kv_lens.max()), local
    )
    return plan_rows(holed, PAGE, page_fill=t.page_fill, local_pages=p["scratch"] if local else None)


@pytest.mark.parametrize("local", [True, False], ids=["local", "paged-only"])
def test_plan_matches_ragged_attention(local: bool) -> None:
    entries = ENTRIES if local else [e for e in ENTRIES if e[1]]  # without local K/V every entry needs keys
    p = _pools(torch.Generator().manual_seed(0), entries, local)
    plan = _plan(p, local)
    k_pages, v_pages = p["holed"].layer(0)
    before = k_pages.clone()
    out, lse = reference_from_plan(p["q"], k_pages, v_pages, plan, p["k"], p["v"])
    assert torch.equal(k_pages, before), "the reference must not write the caller's pool"
    want_lse = torch.empty(p["q"].shape[:2], dtype=torch.float32)
    kp, vp = p["packed"].layer(0)
    want = ragged_attention(p["q"], p["k"], p["v"], p["batch"], kp, vp, kernel="torch", lse_out=want_lse)
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lse.float(), want_lse, rtol=1e-5, atol=1e-5)


def test_segments_of_holed_pages() -> None:
    # fills: a chunk of 2 whole pages + 3, a chunk ending on a boundary, an unused page, a final partial
    got = segments([10, 11, 12, 13, 14, 15, 16], [8, 8, 3, 8, 8, 0, 5], PAGE)
    assert got == [([10, 11, 12], 3), ([13, 14], 8), ([16], 5)]
    assert segments([4], [8], PAGE) == [([4], 8)]
    assert segments([], [], PAGE) == []


def test_plan_is_a_valid_flashinfer_batch() -> None:
    p = _pools(torch.Generator().manual_seed(1), ENTRIES, True)
    plan = _plan(p, True)
    qo, kv, last = plan.qo_indptr.tolist(), plan.kv_indptr.tolist(), plan.kv_last_page_len.tolist()
    assert plan.qo_indptr.dtype == plan.kv_indptr.dtype == plan.kv_indices.dtype == torch.int32
    assert qo[0] == kv[0] == 0 and qo[-1] == plan.q_index.numel() and kv[-1] == plan.kv_indices.numel()
    assert all(1 <= n <= PAGE for n in last) and all(b > a for a, b in zip(kv, kv[1:]))
    offs = p["batch"].groups[0].q_offsets.tolist()
    for s in range(plan.num_segments):  # a segment's rows are one entry's rows, in order
        rows = plan.q_index[qo[s] : qo[s + 1]].tolist()
        assert rows and rows == list(range(rows[0], rows[0] + len(rows)))
        assert rows[0] in offs and rows[-1] + 1 in offs
    # entries' segments: chunks (partial pages close one) + local rows; the entry without rows has none
    per_entry = [len(segments(*_entry_pages(p, b), PAGE)) + (r > 0) for b, (r, _) in enumerate(ENTRIES) if r]
    assert plan.num_segments == sum(per_entry) == 3 + 2 + 1 + 4 + 2
    assert plan.merge_index.shape == (plan.num_rows, max(per_entry))


def _entry_pages(p: dict, b: int) -> tuple[list[int], list[int]]:
    fill = p["table"].page_fill[b].tolist()
    n = sum(f > 0 for f in fill)
    return p["table"].page_table[b, :n].tolist(), fill[:n]


def test_entry_without_keys() -> None:
    """Rows with no paged keys and no local K/V: zero output and LSE -inf (FlashInfer gets no segment)."""
    table = torch.tensor([[1, 2], [0, 0]], dtype=torch.int32)
    plan = plan_decode(
        table, torch.tensor([10, 0], dtype=torch.int32), torch.tensor([0, 2, 3], dtype=torch.int32), PAGE
    )
    assert plan.num_segments == 1 and plan.merge_index[2].tolist() == [plan.q_index.numel()]
    gen = torch.Generator().manual_seed(2)
    pages = torch.randn(2, 3, HKV, PAGE, D, generator=gen, dtype=torch.float64)
    q = torch.randn(3, HKV * G, D, generator=gen, dtype=torch.float64)
    out, lse = reference_from_plan(q, pages[0], pages[1], plan)
    assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.isinf(lse[2]).all()
    k = pages[0][[1, 2]].permute(1, 0, 2, 3).reshape(HKV, 2 * PAGE, D)[:, :10].repeat_interleave(G, 0)
    v = pages[1][[1, 2]].permute(1, 0, 2, 3).reshape(HKV, 2 * PAGE, D)[:, :10].repeat_interleave(G, 0)
    s = torch.einsum("rhd,hnd->hrn", q[:2], k) * D**-0.5
    torch.testing.assert_close(out[:2], torch.einsum("hrn,hnd->rhd", s.softmax(-1), v))
    torch.testing.assert_close(lse[:2], torch.logsumexp(s, -1).T)


def test_plan_rows_needs_scratch_for_local_rows() -> None:
    g = DecodeRows(0, 2, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([4], dtype=torch.int32),
                   torch.tensor([0, 2], dtype=torch.int32), 2, 4)  # fmt: skip
    with pytest.raises(ValueError, match="scratch pages"):
        plan_rows(g, PAGE)
    with pytest.raises(ValueError, match="local rows"):
        plan_decode(
            g.page_table, g.kv_lens, g.q_offsets, PAGE, local_pages=torch.zeros(1, 0, dtype=torch.int32)
        )


class _StandIn:
    """Answers ``run`` as FlashInfer's wrapper would for its plan (:func:`segment_attention`)."""

    def __init__(self, plan: FlashInferPlan) -> None:
        self.plan, self.rows_seen = plan, 0

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], return_lse: bool = False) -> tuple:
        self.rows_seen = q.shape[0]
        out, lse2 = segment_attention(q, kv[0], kv[1], self.plan)
        return (out, lse2) if return_lse else out


def test_attend_through_a_stand_in_wrapper() -> None:
    """The call path around FlashInfer: local K/V into the scratch slots, gathered rows, merge, LSE out."""
    p = _pools(torch.Generator().manual_seed(3), ENTRIES, True)
    plan = _plan(p, True)
    k_pages, v_pages = p["holed"].layer(0)
    want, want_lse = reference_from_plan(p["q"], k_pages, v_pages, plan, p["k"], p["v"])
    lse = torch.empty(p["q"].shape[:2], dtype=torch.float64)
    wrapper = _StandIn(plan)
    out = attend(p["q"], k_pages, v_pages, plan, wrapper, p["k"], p["v"], lse_out=lse)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    assert wrapper.rows_seen == plan.q_index.numel()
    assert torch.equal(k_pages[plan.local_page, :, plan.local_slot], p["k"])  # attend writes the pool
    with pytest.raises(ValueError, match="merge"):
        attend(p["q"], k_pages, v_pages, plan, wrapper, p["k"], p["v"], merge="mean")
