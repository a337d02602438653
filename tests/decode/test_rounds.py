"""Batched decode rounds: one forward for many sessions gives each session's own tokens, exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdllm.decode_service.device_state import DeviceBatch
from pdllm.decode_service.graph_buckets import eighths, fine, pow2, query_bucket, token_bucket
from pdllm.decode_service.round_graphs import GraphedRoundForward, RoundShape
from pdllm.decode_service.round_packing import PackedRound
from pdllm.decode_service.rounds import EagerRoundForward, decode_round
from tests.decode.helpers import CASES, alone, pool_for, round_forward, run_rounds, session
from tests.engine.helpers import model
from tests.interpreter import run_under_interpreter


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("kind", ["eager", "padded"])
def test_batched_rounds_equal_each_session_alone(family: str, kind: str) -> None:
    m = model(family)
    want = [alone(m, case, seed) for seed, case in enumerate(CASES)]
    pool = pool_for(m)
    forward = round_forward(kind, m, pool)
    sessions = [session(m, pool, case, seed) for seed, case in enumerate(CASES)]
    rounds = run_rounds(forward, sessions)
    for s, expected, case in zip(sessions, want, CASES, strict=True):
        assert s.state.tokens.tolist() == expected, case
    assert rounds < sum(s.state.steps_taken for s in sessions)  # rounds were shared


def test_round_with_one_session_equals_alone_and_rows_cover_masked_positions() -> None:
    m = model("dream")
    pool = pool_for(m)
    case = CASES[1]
    for device_sampler in (False, True):
        s = session(m, pool, case, 1, device_sampler)
        packed = PackedRound.pack([s])
        q = len(s.query)
        first_block = [q + p for p in range(case.gen.block)]  # all masked
        if device_sampler:  # the rows are found on the device
            assert packed.rows == [-1] * case.gen.block
            assert DeviceBatch([s.state], packed.starts).rows.tolist() == first_block  # type: ignore[list-item]
        else:
            assert packed.rows == first_block
        assert packed.positions[0] == s.query_start and len(packed.ids) == q + case.gen.gen_length
        while not s.done:
            decode_round(EagerRoundForward(m, pool, "torch"), [s])
        assert s.state.tokens.tolist() == alone(m, case, 1)
        pool.release(s.pages)


def test_shape_buckets_pad_little_and_reuse_graphs() -> None:
    assert [pow2(n) for n in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]
    for n in range(1, 5000):
        b = eighths(n)
        assert b >= n and (n <= 16 or b <= n * 1.125 + 1)
        assert n <= fine(n) <= n * 1.0625 + 1 and n <= token_bucket(n) <= max(32, n + 31, n * 1.0625 + 1)
        assert n <= query_bucket(n) <= max(n + 3, n * 1.125 + 1)
    assert [query_bucket(n) for n in (1, 33, 65, 300)] == [4, 36, 72, 304]
    m = model("dream")
    pool = pool_for(m)
    forward = GraphedRoundForward(m, pool, "torch", capture=False)
    a = [session(m, pool, CASES[0], 0), session(m, pool, CASES[0], 1)]
    decode_round(forward, a)
    decode_round(forward, a)  # fewer masked rows, same bucket
    assert (forward.captures, forward.replays) == (1, 1)
    assert RoundShape.of(PackedRound.pack(a)).batch == 2


def test_triton_rounds_match_torch_rounds_under_interpreter() -> None:
    run_under_interpreter(Path(__file__).with_name("triton_rounds_case.py"))


def test_pool_pages_hold_the_static_kv_exactly() -> None:
    from tests.decode.helpers import random_static

    m = model("llada")
    pool = pool_for(m, pages=8, page_size=16)
    kv = random_static(m, 37, 0)
    pages = pool.reserve(37)
    assert pages is not None and len(pages) == 3 and pool.num_free == 5
    pool.write(pages, kv)
    from pdllm.kernels.paged_kv import ChunkPages

    torch.testing.assert_close(pool.pool.read_chunk(ChunkPages(tuple(pages), 37)), kv, rtol=0, atol=0)
    assert pool.reserve(6 * 16) is None  # 6 pages asked, 5 free: wait
    pool.release(pages)
    assert pool.num_free == 8
