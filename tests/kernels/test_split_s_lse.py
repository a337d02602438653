"""The split-S attention's optional row log-sum-exp (``lse_out``) against a float64 oracle written here: each
row's ``logsumexp`` of its scaled scores over every key it attends to, gathered slot by slot through the page
table (holes skipped), then its request's local rows. Checked for the torch reference (the kernel's
algorithm), the rounds' CPU path (``gathered_attention``) and the Triton kernel under the interpreter (one
split, split + merge kernel, split + in-kernel merge); asking for it leaves the attention output unchanged
bit for bit. This file doubles as its interpreter case script (see the bottom).

Planted by hand (each made these tests fail, then was reverted):
- the kernel's one-split store in base 2 (``lse`` for ``lse * ln 2``): ``test_kernel_under_interpreter``
  fails (and the Triton DyLLM rounds case);
- the merged LSE without the splits' weights (``total = m``, the largest split's LSE, in
  ``_merge_splits``): ``test_kernel_under_interpreter`` fails;
- ``gathered_attention``'s LSE over the static pages only (before the local rows are appended):
  ``test_gathered_attention_lse_equals_the_oracle`` fails (and the DyLLM rounds' LSE test).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # as a script: `tests` importable

from pdllm.decode_service.round_attention import gathered_attention, row_lse  # noqa: E402
from pdllm.kernels.split_s_reference import SplitSConfig, split_s_attention_reference  # noqa: E402
from tests.interpreter import run_under_interpreter  # noqa: E402
from tests.kernels.helpers import Problem, float64_attention, make_problem  # noqa: E402


def oracle_lse(p: Problem) -> torch.Tensor:
    """``[T, Hq]`` float64: per row and head, ``logsumexp(q·k / sqrt(D))`` over the request's paged slots
    below ``kv_len`` that are tokens (``page_fill``), then its own rows' local keys; -inf with no key."""
    return float64_attention(p)[1]


def problems(gen: torch.Generator) -> list[Problem]:
    """Ragged requests with partial pages (holes), GQA 1/4/7, a request with no queries, one with no paged
    KV, and one with no keys at all (no local rows)."""
    return [
        make_problem(gen, [5, 3, 0, 4], [[20, 7], [33], [9], []], 2, 4, 16, 16),
        make_problem(gen, [6, 2], [[64, 30], [16, 16, 1]], 1, 7, 32, 8),
        make_problem(gen, [4, 3, 2], [[40], [], [17, 9]], 2, 1, 16, 16, local=False),
    ]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 3, None])
def test_reference_lse_equals_the_oracle(splits: int | None) -> None:
    for p in problems(torch.Generator().manual_seed(0)):
        lse = torch.empty(p.q.shape[:2])
        cfg = SplitSConfig(block_n=16, num_splits=splits)
        out = split_s_attention_reference(*p.args(), config=cfg, lse_out=lse)
        _close(lse, oracle_lse(p))
        assert torch.equal(out, split_s_attention_reference(*p.args(), config=cfg))


def test_gathered_attention_lse_equals_the_oracle() -> None:
    """The rounds' CPU path (every slot below ``kv_len`` a token there, as the rounds' pool gives it)."""
    for p in problems(torch.Generator().manual_seed(1)):
        p = dataclasses.replace(p, page_fill=None)
        if p.k_local is None:
            continue  # the rounds always pass the rows' own K/V
        lse = torch.empty(p.q.shape[:2])
        out = gathered_attention(*p.args()[:8], lse_out=lse)
        _close(lse, oracle_lse(p))
        assert torch.equal(out, gathered_attention(*p.args()[:8]))


def test_row_lse_in_slices_equals_one_pass() -> None:
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(37, 8, 16, generator=gen), torch.randn(2, 50, 16, generator=gen)
    torch.testing.assert_close(row_lse(q, k, max_scores=3 * 8 * 50), row_lse(q, k), rtol=0, atol=1e-6)


def test_lse_out_must_be_contiguous_float32_rows_by_heads() -> None:
    p = problems(torch.Generator().manual_seed(3))[0]
    t, hq = p.q.shape[:2]
    for bad in (torch.empty(t, hq, dtype=torch.float64), torch.empty(hq, t).T, torch.empty(t, hq + 1)):
        with pytest.raises(ValueError, match="lse_out"):
            split_s_attention_reference(*p.args(), lse_out=bad)


def test_kernel_under_interpreter() -> None:
    run_under_interpreter(Path(__file__), "kernel", timeout_s=300)


def _case_kernel() -> None:
    """The Triton kernel's ``lse_out`` equals the oracle with one split, with splits merged by the merge
    kernel and in the kernel, and with the launcher's own config; the output equals the call without it."""
    from pdllm.kernels.split_s_attention import split_s_attention

    gen = torch.Generator().manual_seed(4)
    for i, p in enumerate(problems(gen)):
        want = oracle_lse(p)
        nofill = dataclasses.replace(p, page_fill=None)
        cfgs = [SplitSConfig(block_m=16, block_n=16, num_splits=1),
                SplitSConfig(block_m=16, block_n=16, num_splits=3),
                SplitSConfig(block_m=32, block_n=16, num_splits=3, fused_merge=True), None]  # fmt: skip
        for cfg in cfgs:
            for case, oracle in ((p, want), (nofill, oracle_lse(nofill))):
                lse = torch.full(p.q.shape[:2], float("nan"))
                out = split_s_attention(*case.args(), config=cfg, lse_out=lse)
                _close(lse, oracle)
                assert torch.equal(out, split_s_attention(*case.args(), config=cfg)), (i, cfg)
        print(f"problem {i}: lse ok")


if __name__ == "__main__":  # run_under_interpreter: TRITON_INTERPRET=1 python <this file> CASE
    {"kernel": _case_kernel}[sys.argv[1]]()
    print("ok")
