"""Triton kernels under the interpreter; run as a script by test_triton_interpreter.py.

TRITON_INTERPRET must be set before ``@triton.jit`` runs (triton reads it at decoration time), and other
test modules may already have imported the kernels, so each case runs in a fresh process:
``TRITON_INTERPRET=1 python tests/kernels/interpreter_cases.py CASE``. Exit 0 = pass.
bf16 is not checked here: the interpreter's numpy backend has no bf16 matmul; the GPU check covers it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.kernels.helpers import make_problem  # noqa: E402


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def case_split_s() -> None:
    from pdllm.kernels.split_s_attention import SplitSConfig, split_s_attention, split_s_attention_reference

    gen = torch.Generator().manual_seed(0)
    cases = [
        # (q_lens, chunk lens, hkv, group, page, local, dtype, block_n, splits, tol)
        ([5, 3], [[20, 7], [33]], 2, 3, 16, True, torch.float32, 16, None, 1e-5),
        ([4, 1, 6], [[9], [3, 3, 3], [17, 1]], 1, 4, 8, True, torch.float32, 16, 3, 1e-5),  # block > page
        ([3], [[16, 16]], 1, 7, 16, True, torch.float32, 16, 3, 1e-5),  # last split: one token
        ([7, 2], [[40], [12, 12]], 2, 1, 32, False, torch.float16, 16, 1, 2e-3),  # single split, no local
        ([6], [[64, 30]], 1, 4, 64, True, torch.float16, 32, 4, 2e-3),
    ]
    for q_lens, chunks, hkv, group, page, local, dtype, block_n, splits, tol in cases:
        p = make_problem(gen, q_lens, chunks, hkv, group, 32, page, local=local, dtype=dtype)
        cfg = SplitSConfig(block_m=16, block_n=block_n, num_splits=splits)
        want = split_s_attention_reference(*p.args(), config=cfg)
        got = split_s_attention(*p.args(), config=cfg)
        err = _rel(got, want)
        assert err < tol, (q_lens, chunks, err)
        assert torch.isfinite(got).all()
        if splits != 1:
            # In-kernel merge through a reused counter workspace: same answer, workspace left zeroed.
            ws = torch.zeros(64, dtype=torch.int32)
            fused = SplitSConfig(block_m=16, block_n=block_n, num_splits=splits, fused_merge=True)
            for _ in range(2):
                assert _rel(split_s_attention(*p.args(), config=fused, workspace=ws), want) < tol
                assert int(ws.abs().sum()) == 0


def case_retention() -> None:
    from pdllm.kernels.chunk_prefill_attention import chunk_prefill_attention_reference
    from pdllm.kernels.retention_scores import retention_scores, retention_scores_reference

    gen = torch.Generator().manual_seed(1)
    for lens, qlens, hq, hkv, causal, block in [
        ([40, 70, 9], [8, 21, 9], 8, 2, False, 16),
        ([33, 50], [5, 17], 7, 1, True, 32),
        ([90], [30], 4, 4, False, 32),
    ]:
        total = sum(lens)
        q = torch.randn(total, hq, 32, generator=gen)
        k = torch.randn(total, hkv, 32, generator=gen)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        ql = torch.tensor(qlens, dtype=torch.int32)
        lse = chunk_prefill_attention_reference(q, k, k, cu, causal=causal, return_lse=True)[1]
        want = retention_scores_reference(q, k, cu, ql, causal=causal)
        got = retention_scores(q, k, cu, ql, lse=lse, causal=causal, block_n=block, block_m=16)
        assert _rel(got, want) < 1e-5, (lens, _rel(got, want))
        assert bool((got[cu[1] - ql[0] : cu[1]] == 0).all())


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1")
    globals()[f"case_{sys.argv[1]}"]()
    print("ok")


if __name__ == "__main__":
    main()
