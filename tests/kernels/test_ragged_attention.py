"""The ragged attention entry point (``kernels/ragged_attention``) against a float64 oracle written here.

The batch mixes decode entries of varied rows and KV lengths (no KV, a partial last page, several pages
in shuffled pool order; two decode groups) with two prefill pieces (one causal, one bidirectional, each of
several chunks). Oracle, per decode entry: its keys gathered slot by slot from its page list (slot ``j`` at
``pages[j // page_size]``, offset ``j % page_size``), then its own rows' fresh K/V, one bidirectional softmax
per row; per piece chunk: a softmax over the chunk's rows only, causal where the piece is. Checked for the
torch path, for the Triton path under the interpreter (this file is its case script, see the bottom) and
through the round attention (``PagedBatchAttention`` with a carried piece: one entry-point call per layer).

Planted by hand (each made the three oracle tests fail, the torch, interpreter and round ones; reverted):
- a page off by one in a decode entry's page list (``_decode_group`` writing ``pages + 1`` into the table);
- a wrong row range (``ragged_attention`` writing a decode group's output one row late, its last row into
  the next group's first);
- a missed causal mask in a prefill piece (``_attend`` passing ``causal=False`` to the chunk kernel).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # as a script: `tests` importable

from pdllm.decode_service import round_attention as ra  # noqa: E402
from pdllm.decode_service.prefill_rows import PrefillRows  # noqa: E402
from pdllm.kernels.ragged_attention import (  # noqa: E402
    DecodeEntry,
    DecodeRows,
    PieceEntry,
    PieceRows,
    RaggedBatch,
    ragged_attention,
)
from tests.interpreter import run_under_interpreter  # noqa: E402

HKV, G, D, PAGE, POOL = 2, 2, 16, 8, 24


def _entries(gen: torch.Generator) -> list[DecodeEntry | PieceEntry]:
    """Decode entries in two runs around a causal piece, then a bidirectional piece."""
    # pages far from 0..n, so the list must be followed; the pool's last page stays unused, so a page id
    # off by one still names a page (a wrong answer, not an index error)
    perm = torch.randperm(POOL - 1, generator=gen).tolist()

    def dec(rows: int, kv_len: int) -> DecodeEntry:
        n = -(-kv_len // PAGE)
        return DecodeEntry(rows, tuple(perm.pop() for _ in range(n)), kv_len)

    return [
        dec(3, 17),
        dec(1, 0),
        PieceEntry((5, 3), causal=True),
        dec(6, 33),
        dec(2, 8),
        dec(4, 5),
        PieceEntry((4, 6, 1), causal=False),
    ]


def _inputs(gen: torch.Generator, rows: int) -> tuple[torch.Tensor, ...]:
    """q/k/v as the round's strided views of ``[1, H, T, D]`` projections, and a pool layer."""
    q, k, v = (torch.randn(1, h, rows, D, generator=gen)[0].transpose(0, 1) for h in (HKV * G, HKV, HKV))
    kp, vp = torch.randn(2, POOL, HKV, PAGE, D, generator=gen)
    return q, k, v, kp, vp


def oracle(entries: list, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kp: torch.Tensor,
           vp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Float64 ``[T, Hq, D]`` output and ``[T, Hq]`` LSE (NaN on piece rows), entry by entry."""
    t, hq, _ = q.shape
    out = torch.zeros(t, hq, D, dtype=torch.float64)
    lse = torch.full((t, hq), float("nan"), dtype=torch.float64)
    at = 0

    def attend(rows: range, keys: torch.Tensor, vals: torch.Tensor, causal: bool) -> torch.Tensor:
        # keys/vals [L, Hkv, D]; query head h reads KV head h // G
        s = torch.einsum("qhd,khd->hqk", q[rows.start : rows.stop].double(),
                         keys.double().repeat_interleave(G, 1)) / D**0.5  # fmt: skip
        if causal:
            s = s.masked_fill(~torch.ones(len(rows), len(rows), dtype=torch.bool).tril(), float("-inf"))
        p = torch.softmax(s, -1)
        out[rows.start : rows.stop] = torch.einsum("hqk,khd->qhd", p, vals.double().repeat_interleave(G, 1))
        return torch.logsumexp(s, -1).T

    for e in entries:
        if isinstance(e, DecodeEntry):
            rows = range(at, at + e.rows)
            slots = [(e.pages[j // PAGE], j % PAGE) for j in range(e.kv_len)]
            keys = torch.stack([kp[p, :, s] for p, s in slots] + [k[r] for r in rows])
            vals = torch.stack([vp[p, :, s] for p, s in slots] + [v[r] for r in rows])
            if e.rows:
                lse[rows.start : rows.stop] = attend(rows, keys, vals, False)
            at += e.rows
        else:
            for n in e.chunks:
                rows = range(at, at + n)
                attend(rows, k[at : at + n], v[at : at + n], e.causal)
                at += n
    return out, lse


def _check(kernel: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    entries = _entries(gen)
    batch = RaggedBatch.of(entries, PAGE, torch.device("cpu"))
    assert [type(g) for g in batch.groups] == [DecodeRows, PieceRows, DecodeRows, PieceRows]
    q, k, v, kp, vp = _inputs(gen, batch.rows)
    want, want_lse = oracle(entries, q, k, v, kp, vp)
    lse = torch.full(q.shape[:2], float("nan"))
    out = ragged_attention(q, k, v, batch, kp, vp, kernel, lse_out=lse)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=1e-5, equal_nan=True)


def test_torch_path_equals_the_oracle() -> None:
    for seed in range(3):
        _check("torch", seed)


def test_triton_path_under_interpreter() -> None:
    run_under_interpreter(Path(__file__), "triton", timeout_s=300)


def test_round_attention_calls_the_entry_point_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A round carrying a causal piece: one entry-point call per layer for both, the piece's K/V staged,
    the outputs the oracle's (the round's decode entries first, then the piece)."""
    gen = torch.Generator().manual_seed(7)
    entries = [e for e in _entries(gen) if isinstance(e, DecodeEntry)] + [PieceEntry((5, 3), causal=True)]
    batch = RaggedBatch.of(entries, PAGE, torch.device("cpu"))
    dec, piece = batch.groups
    assert isinstance(dec, DecodeRows) and isinstance(piece, PieceRows)
    q, k, v, kp, vp = _inputs(gen, batch.rows)
    kv = torch.stack([torch.zeros_like(kp), torch.zeros_like(kp), kp, vp]).view(2, 2, *kp.shape)  # layer 1
    calls: list[RaggedBatch] = []

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(args[3])  # type: ignore[arg-type]
        return ragged_attention(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ra, "ragged_attention", counted)
    att = ra.PagedBatchAttention(
        kv, dec.page_table, dec.kv_lens, dec.q_offsets, dec.max_q_len, dec.max_kv_len, "torch"
    )
    staging = torch.zeros(2, 2, piece.rows, HKV, D)
    att.prefill = PrefillRows(dec.rows, piece.cu_seqlens, piece.max_len, True, staging)
    out = att(1, *(x.transpose(0, 1)[None] for x in (q, k, v)))[0].transpose(0, 1)
    assert len(calls) == 1 and [g.rows for g in calls[0].groups] == [dec.rows, piece.rows]
    torch.testing.assert_close(out.double(), oracle(entries, q, k, v, kp, vp)[0], atol=2e-5, rtol=1e-5)
    assert torch.equal(staging[1, 0], k[dec.rows :]) and torch.equal(staging[1, 1], v[dec.rows :])


def test_batch_groups_must_tile_the_rows() -> None:
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="tile"):
        RaggedBatch((PieceRows(0, 4, cu, 4, True), PieceRows(5, 4, cu, 4, True)))
    batch = RaggedBatch((PieceRows(0, 4, cu, 4, True),))
    q = torch.zeros(5, 4, D)
    with pytest.raises(ValueError, match="covers 4 rows"):
        ragged_attention(q, q[:, :2], q[:, :2], batch, torch.zeros(1, 2, PAGE, D), torch.zeros(1, 2, PAGE, D))


if __name__ == "__main__":  # run_under_interpreter: TRITON_INTERPRET=1 python <this file> CASE
    assert sys.argv[1] == "triton"
    for s in range(2):
        _check("triton", s)
    print("ok")
