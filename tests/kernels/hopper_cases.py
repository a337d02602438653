"""The Hopper split-S variant under Triton's interpreter; run as a script by test_split_s_hopper.py.

``TRITON_INTERPRET=1 python tests/kernels/hopper_cases.py CASE``; exit 0 with a last line ending in "ok"
= pass. The interpreter emulates host tensor descriptors, so the TMA tile path itself runs here (the test
asserts ``LaunchInfo.tma``); warp specialization is a compiler transform the interpreter ignores, so the
``auto`` mode checks only that asking for it changes no numerics. fp32 and fp16 (no bf16 matmul in numpy).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.kernels.helpers import Problem, make_problem  # noqa: E402


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    fin = torch.isfinite(b)
    return ((a.double() - b.double())[fin].norm() / b.double()[fin].norm().clamp_min(1e-30)).item()


def poisoned(gen: torch.Generator, q_lens: list[int], kv_lens: list[int], hkv: int, group: int, page: int,
             local: bool, dtype: torch.dtype) -> Problem:  # fmt: skip
    """One chunk per request and no ``page_fill`` (the serving path); every pool slot that is not one of a
    request's first ``kv_len`` tokens (spare pages, the tail of each last page) holds NaN, so a tile read
    from a wrong page or past a request's end poisons the output."""
    p = make_problem(gen, q_lens, [[n] if n else [] for n in kv_lens], hkv, group, 32, page, local, dtype)
    live = torch.zeros(p.k_pages.shape[0], page, dtype=torch.bool)
    for b, n in enumerate(kv_lens):
        for j in range(n):
            live[p.page_table[b, j // page].long(), j % page] = True
    dead = ~live[:, None, :, None].expand_as(p.k_pages)
    p.k_pages[dead] = float("nan")
    p.v_pages[dead] = float("nan")
    # The table counts whole pages (page_fill marks the real end); without page_fill kv_lens must be exact.
    return dataclasses.replace(p, page_fill=None, kv_lens=torch.tensor(kv_lens, dtype=torch.int32))


def case_hopper() -> None:
    from pdllm.kernels.split_s_hopper import LaunchInfo, split_s_attention_hopper
    from pdllm.kernels.split_s_reference import SplitSConfig, naive_attention, split_s_attention_reference

    gen = torch.Generator().manual_seed(0)
    cases = [
        # (q_lens, kv_lens, hkv, group, page, local, dtype, block_n, splits, tol)
        ([5, 3], [70, 33], 2, 3, 16, True, torch.float32, 16, None, 1e-5),  # ragged tails after whole tiles
        ([4, 0, 6], [64, 40, 0], 1, 4, 16, True, torch.float32, 16, 3, 1e-5),  # no queries; no paged KV
        ([3], [128], 1, 7, 32, False, torch.float32, 32, 1, 1e-5),  # single split, whole pages only
        ([6, 2], [100, 64], 2, 1, 32, True, torch.float32, 16, 4, 1e-5),  # two tiles per page
        ([7, 2], [96, 50], 2, 4, 16, True, torch.float16, 16, 2, 2e-3),
        ([3], [200], 1, 2, 64, True, torch.float32, 16, 5, 1e-5),  # splits of 48 start mid-page
        ([4], [90], 1, 4, 16, True, torch.float32, 32, 2, 1e-5),  # block_n > page: no TMA, plain loads
    ]
    for q_lens, kv_lens, hkv, group, page, local, dtype, block_n, splits, tol in cases:
        p = poisoned(gen, q_lens, kv_lens, hkv, group, page, local, dtype)
        cfg = SplitSConfig(block_m=16, block_n=block_n, num_splits=splits)
        want_lse = torch.empty(p.q.shape[:2], dtype=torch.float32)
        want = split_s_attention_reference(*p.args(), config=cfg, lse_out=want_lse)
        naive = naive_attention(*p.args())
        for mode in ("auto", "tma", "plain"):
            info, lse = LaunchInfo(), torch.full(p.q.shape[:2], 7.0)
            got = split_s_attention_hopper(*p.args(), config=cfg, lse_out=lse, mode=mode, info=info)
            tag = (q_lens, kv_lens, page, block_n, mode)
            assert torch.isfinite(got).all(), tag
            assert _rel(got, want) < tol and _rel(got, naive) < tol, (tag, _rel(got, want))
            assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)), tag
            assert _rel(lse, want_lse) < tol, (tag, _rel(lse, want_lse))
            assert info.tma == (mode != "plain" and block_n <= page), (tag, info)
            assert info.ws == (mode == "auto" and block_n <= page), (tag, info)
        # Without lse_out nothing else changes; config=None takes today's pick (heuristic on CPU).
        plain = split_s_attention_hopper(*p.args(), config=cfg)
        assert _rel(plain, want) < tol
        assert _rel(split_s_attention_hopper(*p.args()), naive) < tol
        print(f"hopper {q_lens} {kv_lens} page={page} bn={block_n} {dtype}: auto/tma/plain ok")

    # page_fill given (holed pages): the tma mode's whole tiles need full pages, so it takes pointer loads.
    p = make_problem(gen, [3, 4], [[20, 7], [33]], 2, 2, 32, 16)
    cfg = SplitSConfig(block_m=16, block_n=16, num_splits=2)
    info = LaunchInfo()
    got = split_s_attention_hopper(*p.args(), config=cfg, mode="tma", info=info)
    assert not info.tma and not info.ws, info
    assert _rel(got, split_s_attention_reference(*p.args(), config=cfg)) < 1e-5
    print("hopper page_fill ok")


def case_hopper_all_tma() -> None:
    """The all-TMA kernel (``auto``) on partial tiles: holed pages (``page_fill``) and splits whose last
    tile is part of a page, every slot that is not a token NaN; shifted boxes must read none of them."""
    from pdllm.kernels.split_s_hopper import LaunchInfo, split_s_attention_hopper
    from pdllm.kernels.split_s_reference import SplitSConfig, split_s_attention_reference

    gen = torch.Generator().manual_seed(2)
    for chunks, page, block_n, splits, holes in [
        ([[20, 7], [33, 5, 16]], 16, 16, 2, True),  # holes: chunks ending mid-page
        ([[20, 7], [33, 5, 16]], 32, 16, 3, True),  # two tiles per page, holes in either
        ([[45], [70]], 32, 16, 4, False),  # no page_fill: the last split's tile ends inside a page
    ]:
        p = make_problem(gen, [3, 5], chunks, 2, 3, 32, page)
        if not holes:  # exact kv_lens instead of whole pages
            p = dataclasses.replace(p, page_fill=None, kv_lens=torch.tensor([sum(c) for c in chunks]).int())
        fill = p.page_fill
        for b in range(p.page_table.shape[0]):  # poison every pool slot that is not a token
            n = int(p.kv_lens[b])
            for j in range(-(-n // page)):
                used = int(fill[b, j]) if fill is not None else min(page, n - j * page)
                p.k_pages[p.page_table[b, j].long(), :, used:] = float("nan")
                p.v_pages[p.page_table[b, j].long(), :, used:] = float("nan")
        cfg = SplitSConfig(block_m=16, block_n=block_n, num_splits=splits)
        lse, want_lse = torch.empty(p.q.shape[:2]), torch.empty(p.q.shape[:2])
        want = split_s_attention_reference(*p.args(), config=cfg, lse_out=want_lse)
        info = LaunchInfo()
        got = split_s_attention_hopper(*p.args(), config=cfg, lse_out=lse, mode="auto", info=info)
        assert info.tma and info.ws and not info.dropped, info
        assert torch.isfinite(got).all() and _rel(got, want) < 1e-5, (chunks, _rel(got, want))
        assert _rel(lse, want_lse) < 1e-5, chunks
        print(f"all-TMA {chunks} page={page} bn={block_n} splits={splits} ok")


def case_hopper_drop() -> None:
    """A mode that fails to compile drops to the next one down, once per shape; LaunchInfo says so."""
    from pdllm.kernels import split_s_hopper as sh
    from pdllm.kernels.split_s_reference import SplitSConfig, split_s_attention_reference

    gen = torch.Generator().manual_seed(1)
    p = poisoned(gen, [4, 2], [80, 48], 2, 2, 16, True, torch.float32)
    cfg = SplitSConfig(block_m=16, block_n=16, num_splits=2)
    real = sh._launch
    tried = []

    def failing_ws(*args: object) -> torch.Tensor:
        tried.append(args[14])
        if args[14] == "auto":  # the mode argument
            raise RuntimeError("PassManager::run failed (simulated warp-specialization failure)")
        return real(*args)

    sh._launch = failing_ws
    info = sh.LaunchInfo()
    want = split_s_attention_reference(*p.args(), config=cfg)
    for _ in range(2):
        got = sh.split_s_attention_hopper(*p.args(), config=cfg, mode="auto", info=info)
        assert _rel(got, want) < 1e-5 and info.tma and not info.ws, info
    assert tried == ["auto", "tma", "tma"], tried  # the failed mode is not retried for this shape
    print("hopper drop ok")


if __name__ == "__main__":
    {"hopper": case_hopper, "hopper_drop": case_hopper_drop, "hopper_all_tma": case_hopper_all_tma}[
        sys.argv[1]
    ]()
    print("ok")
