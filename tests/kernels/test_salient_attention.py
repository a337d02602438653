"""The salient-column attention update (``kernels/salient_attention.py``) against the full form it replaces:
``softmax(q K^T) V_t - softmax(q K^T) V_{t-1}``, the difference of two attentions over every key, computed
here from first principles in float64 (slot by slot through the page table). The Triton kernel runs under
the interpreter in a fresh process (this file doubles as its case script, see the bottom).

Planted by hand (each made these tests fail, then was reverted):
- the salient column list read one entry late (``salient[q0 + 1 : q0 + count + 1]`` in the reference):
  ``test_reference_equals_the_full_form`` and ``test_only_the_salient_columns_are_read`` fail;
- the Triton kernel's weights without the log-sum-exp rescale (``exp2(s)`` for ``exp2(s - lse2)``):
  ``test_kernel_under_interpreter`` and ``test_benchmark_smoke`` fail (and the Triton DyLLM rounds case).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # as a script: `tests` importable

from pdllm.kernels.salient_attention import salient_attention_reference, salient_columns  # noqa: E402
from tests.interpreter import run_under_interpreter  # noqa: E402


@dataclass
class Case:
    """Requests over a shared page pool: paged K/V (the same in both steps), local K after the update, local
    V before and after it (different at the salient rows only)."""

    q: torch.Tensor  # [T, Hq, D]
    k_pages: torch.Tensor  # [P, Hkv, page, D]
    v_pages: torch.Tensor
    page_table: torch.Tensor  # [B, max_pages] int32
    kv_lens: torch.Tensor  # [B]
    q_offsets: torch.Tensor  # [B + 1] int32
    k_local: torch.Tensor  # [T, Hkv, D]
    v_old: torch.Tensor
    v_new: torch.Tensor
    mask: torch.Tensor  # [T] bool: salient rows
    member: torch.Tensor  # [T] long

    def args(self, lse: torch.Tensor | None = None) -> tuple:
        order, counts = salient_columns(self.mask, self.member, self.kv_lens.numel())
        dv = self.v_new - self.v_old
        return (self.q, self.k_pages, self.page_table, self.kv_lens, self.q_offsets, self.k_local, dv, order,
                counts, lse)  # fmt: skip


def make_case(
    seed: int, q_lens: list[int], kv_lens: list[int], hkv: int, group: int, d: int, page: int, p: float
) -> Case:
    """Random requests; each row salient with probability ``p``; pages handed out in a shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // page) for n in kv_lens]
    pages = torch.randperm(sum(need) + 2, generator=gen)  # 2 spare: no request's pages are 0..n
    table = torch.zeros(len(q_lens), max([*need, 1]), dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = pages[start : start + n]
        start += n
    t = sum(q_lens)
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    v_old = rnd(t, hkv, d)
    mask = torch.rand(t, generator=gen) < p
    v_new = torch.where(mask[:, None, None], rnd(t, hkv, d), v_old)
    return Case(
        q=rnd(t, hkv * group, d),
        k_pages=rnd(len(pages), hkv, page, d),
        v_pages=rnd(len(pages), hkv, page, d),
        page_table=table,
        kv_lens=torch.tensor(kv_lens),
        q_offsets=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        k_local=rnd(t, hkv, d),
        v_old=v_old,
        v_new=v_new,
        mask=mask,
        member=torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens)),
    )


def full_form(c: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """``attn(q, K, V_t) - attn(q, K, V_{t-1})`` per row and head in float64, and each row's log-sum-exp
    ``[T, Hq]``: every key gathered slot by slot, then the request's own rows."""
    t, hq, d = c.q.shape
    hkv, page = c.k_pages.shape[1], c.k_pages.shape[2]
    out = torch.zeros(t, hq, d, dtype=torch.float64)
    lse = torch.zeros(t, hq, dtype=torch.float64)
    offs = c.q_offsets.tolist()
    for b in range(len(offs) - 1):
        q0, q1 = offs[b], offs[b + 1]
        slots = [(int(c.page_table[b, j // page]), j % page) for j in range(int(c.kv_lens[b]))]
        for h in range(hq):
            g = h // (hq // hkv)
            keys = [c.k_pages[p, g, s] for p, s in slots] + [c.k_local[r, g] for r in range(q0, q1)]
            paged_v = [c.v_pages[p, g, s] for p, s in slots]
            v_new = torch.stack(paged_v + [c.v_new[r, g] for r in range(q0, q1)]).double()
            v_old = torch.stack(paged_v + [c.v_old[r, g] for r in range(q0, q1)]).double()
            k = torch.stack(keys).double()
            for i in range(q0, q1):
                scores = k @ c.q[i, h].double() / d**0.5
                weights = torch.softmax(scores, 0)
                out[i, h] = weights @ v_new - weights @ v_old
                lse[i, h] = torch.logsumexp(scores, 0)
    return out, lse


SHAPES = [
    # (q_lens, kv_lens, hkv, group, d, page, salient probability)
    ([5, 3], [20, 33], 2, 2, 16, 16, 0.4),
    ([7, 1, 4], [0, 9, 40], 1, 4, 16, 8, 0.3),  # a request with no paged KV
    ([6, 5], [17, 64], 2, 1, 32, 32, 0.0),  # no salient row at all: the update is zero
    ([9], [25], 1, 2, 16, 4, 1.0),  # every row salient
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_reference_equals_the_full_form(shape: tuple) -> None:
    """Without the row's log-sum-exp (the reference forms it over every key) and with the oracle's."""
    c = make_case(0, *shape)
    want, lse = full_form(c)
    got = salient_attention_reference(*c.args())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    got = salient_attention_reference(*c.args(lse.float()))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    wide = replace(c, q=c.q * 8)  # scores 8x wider: the softmax is dominated by few keys
    torch.testing.assert_close(salient_attention_reference(*wide.args()).double(), full_form(wide)[0],
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_only_the_salient_columns_are_read() -> None:
    """Given the log-sum-exp, the non-salient rows' keys and value changes are never read (NaN there changes
    nothing); without it, their keys are (the normalizer) but their value changes are not."""
    c = make_case(1, [6, 8], [12, 30], 2, 2, 16, 8, 0.3)
    want, lse = full_form(c)
    nan = torch.full_like(c.v_old, float("nan"))
    stale = ~c.mask[:, None, None]
    poisoned = replace(c, v_old=torch.where(stale, nan, c.v_old), v_new=torch.where(stale, nan, c.v_new))
    torch.testing.assert_close(
        salient_attention_reference(*poisoned.args()).double(), want, rtol=1e-5, atol=1e-5
    )
    blind = replace(poisoned, k_local=torch.where(stale, nan, c.k_local))
    got = salient_attention_reference(*blind.args(lse.float()))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_salient_columns_lists_each_requests_salient_rows_at_its_start() -> None:
    mask = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1], dtype=torch.bool)
    member = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    order, counts = salient_columns(mask, member, 4)
    assert counts.tolist() == [2, 1, 1, 0]
    assert order[:2].tolist() == [1, 2] and order[3:4].tolist() == [4] and order[5:6].tolist() == [7]


def test_kernel_under_interpreter() -> None:
    run_under_interpreter(Path(__file__), "kernel", timeout_s=300)


def test_benchmark_smoke(tmp_path: Path) -> None:
    """The benchmark's tiny CPU run (interpreter): its update, without and with the attention's row LSE,
    equals the difference of two split-S passes."""
    import json

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "salient_attention.py"
    run_under_interpreter(script, "--smoke", "--out", str(tmp_path), timeout_s=300)
    rows = json.loads((tmp_path / "salient_attention.json").read_text())["rows"]
    assert rows and all(
        max(r["max_rel_err"], r["lse_rel_err"]) < 1e-5 and r["salient_rows"] > 0 for r in rows
    )


def _case_kernel() -> None:
    """The Triton kernel equals the float64 full form on every shape, with and without the log-sum-exp,
    with 8x wider scores, and with NaN in the columns it must not read."""
    from pdllm.kernels.salient_attention import salient_attention

    for i, shape in enumerate(SHAPES):
        c = make_case(i, *shape)
        want, lse = full_form(c)
        for args in (c.args(), c.args(lse.float())):
            torch.testing.assert_close(salient_attention(*args).double(), want, rtol=1e-5, atol=1e-5)
        wide = replace(c, q=c.q * 8)
        torch.testing.assert_close(salient_attention(*wide.args()).double(), full_form(wide)[0],
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
        stale = ~c.mask[:, None, None]
        nan = torch.full_like(c.v_old, float("nan"))
        blind = replace(c, k_local=torch.where(stale, nan, c.k_local), v_new=torch.where(stale, nan, c.v_new),
                        v_old=torch.where(stale, nan, c.v_old))  # fmt: skip
        torch.testing.assert_close(salient_attention(*blind.args(lse.float())).double(), want,
                                   rtol=1e-5, atol=1e-5)  # fmt: skip


if __name__ == "__main__":  # run_under_interpreter: TRITON_INTERPRET=1 python <this file> CASE
    {"kernel": _case_kernel}[sys.argv[1]]()
    print("ok")
