"""A chunk-prefill forward carried in a decode round (``decode_service/prefill_rows.py``): one forward.

Oracles: for the chunks' KV, the chunk prefill run on its own (``chunk_prefill``: a padded batch, its own
attention backends); for the requests, each decoded alone. Planted by hand: the chunk rows' positions
counting on across chunks instead of restarting at 0 -> the bank test fails; the chunks' causal flag
dropped -> the causal cases fail; the scheduler dropping a carried piece instead of running it in the
next round -> the scheduler test fails; the failed round's error not thrown into the prefill steps -> the
failure test fails.
"""

from __future__ import annotations

import threading

import pytest
import torch

from pdllm.decode_service.rounds import EagerRoundForward, decode_round
from pdllm.decode_service.scheduler import DecodeScheduler, SchedulerConfig
from pdllm.shared.chunk_prefill import ChunkForward, chunk_prefill, chunk_prefill_steps
from pdllm.shared.stepwise import drain
from tests.decode.helpers import CASES, Forwards, alone, pool_for, round_forward, session
from tests.decode.test_scheduler import _job
from tests.engine.helpers import model, tokens

CHUNKS = [[1, *tokens(8, 1)], [1, *tokens(15, 2)], [1, *tokens(4, 3)], [1, *tokens(15, 4)]]


def _bank_equal(a: torch.Tensor, b: torch.Tensor, lens: list[int]) -> None:
    for i, n in enumerate(lens):
        torch.testing.assert_close(a[:, :, i, :, :n], b[:, :, i, :, :n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["causal", "bidirectional"])
@pytest.mark.parametrize("forward_kind", ["eager", "padded"])
def test_a_round_carrying_a_chunk_forward_writes_its_kv_and_decodes_exactly(
    attention: str, forward_kind: str
) -> None:
    m = model("dream")
    expected, _ = chunk_prefill(m, CHUNKS, attention, chunk_size=16, batch=8)
    pool = pool_for(m)
    sessions = [session(m, pool, CASES[i], i) for i in (0, 1)]
    forward = round_forward(forward_kind, m, pool)
    forwards = Forwards(m)
    steps = chunk_prefill_steps(m, CHUNKS, attention, 16, 8, hand_over=True)
    work = next(steps)
    assert isinstance(work, ChunkForward) and sorted(work.group) == [0, 1, 2, 3]
    decode_round(forward, sessions, work)
    assert forwards.n == 1  # the chunks and both requests in one forward
    bank, stats = drain(steps)
    assert stats.forwarded == 4
    _bank_equal(bank.kv, expected.kv, expected.lens)
    while any(not s.done for s in sessions):
        decode_round(forward, [s for s in sessions if not s.done])
    for i, s in zip((0, 1), sessions, strict=True):
        assert s.result().raw_tokens == alone(m, CASES[i], i)


def test_a_round_whose_policy_changes_rows_inside_the_forward_runs_the_piece_alone_first() -> None:
    """FOCUS-style rounds cannot carry chunk rows; the piece still runs, as its own forward."""
    m = model("dream")
    expected, _ = chunk_prefill(m, CHUNKS, "causal", chunk_size=16, batch=8)
    pool = pool_for(m)
    sessions = [session(m, pool, CASES[0], 0)]
    forward = EagerRoundForward(m, pool, "torch")
    steps = chunk_prefill_steps(m, CHUNKS, "causal", 16, 8, hand_over=True)
    work = next(steps)
    assert isinstance(work, ChunkForward)
    seen: list[bool] = []
    calls = forward.__call__

    def spy(packed):  # type: ignore[no-untyped-def]
        packed.stores.append((0, lambda *a: None))  # a per-layer store: the round cannot carry the piece
        seen.append(packed.carries_piece)
        return calls(packed)

    forwards = Forwards(m)
    decode_round(spy, sessions, work)
    assert seen == [False] and forwards.n == 2
    bank, _ = drain(steps)
    _bank_equal(bank.kv, expected.kv, expected.lens)


def _prefill_thread(sched: DecodeScheduler, m, results: list) -> threading.Thread:  # type: ignore[no-untyped-def]
    def run() -> None:
        try:
            steps = chunk_prefill_steps(m, CHUNKS, "causal", 16, 8, max_tokens=16, hand_over=True)
            results.append(sched.run_between_rounds(steps))
        except Exception as exc:
            results.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    while not sched._foreign:  # the caller has handed its work over
        pass
    return thread


@pytest.mark.parametrize("forward_kind", ["eager", "padded"])
def test_the_scheduler_carries_each_chunk_forward_in_the_next_round(forward_kind: str) -> None:
    """Padded: chunks of 9, 16, 5 and 16 tokens share one bucket of piece rows, so one bucket replays
    pieces of other lengths (its sequence offsets refreshed on every call)."""
    m = model("dream")
    expected, _ = chunk_prefill(m, CHUNKS, "causal", chunk_size=16, batch=8)
    pool = pool_for(m)
    forward = round_forward(forward_kind, m, pool)
    sched = DecodeScheduler(m, pool, forward, SchedulerConfig(), start_thread=False)
    jobs = [sched.submit(_job(m, seed)) for seed in (1, 3)]  # 8 and 10 steps: outlast the four pieces
    sched.run_once()  # the builds, the first round
    forwards = Forwards(m)
    results: list = []
    thread = _prefill_thread(sched, m, results)
    rounds = sched.rounds
    for _ in range(40):
        if not (sched.active or sched._foreign):
            break
        sched.run_once()
    thread.join(timeout=5)
    (result,) = results
    bank, stats = result
    assert stats.forwarded == 4  # max_tokens=16: one chunk per forward
    _bank_equal(bank.kv, expected.kv, expected.lens)
    assert forwards.n == sched.rounds - rounds  # every piece rode in a round: no forward of its own
    if forward_kind == "padded":
        shapes = [shape for shape in sched.forward._graphs if shape.piece_rows]  # type: ignore[attr-defined]
        assert {shape.piece_rows for shape in shapes} == {32}
    for seed, job in zip((1, 3), jobs, strict=True):
        final = [e for e in list(job.events.queue) if hasattr(e, "result")][-1]
        assert final.result.raw_tokens == alone(m, CASES[seed], seed)


def test_a_failed_round_fails_the_prefill_it_carried_and_idle_pieces_run_alone() -> None:
    m = model("dream")
    pool = pool_for(m)
    forward = EagerRoundForward(m, pool, "torch")
    sched = DecodeScheduler(m, pool, forward, SchedulerConfig(), start_thread=False)
    job = sched.submit(_job(m, 1))
    sched.run_once()
    results: list = []
    thread = _prefill_thread(sched, m, results)
    sched.run_once()  # hands the first chunk forward over for the next round

    def broken(packed):  # type: ignore[no-untyped-def]
        raise RuntimeError("device lost")

    sched.forward = broken  # type: ignore[method-assign]
    sched.run_once()  # the round carrying it fails: the request and the prefill both hear of it
    thread.join(timeout=5)
    assert len(results) == 1 and isinstance(results[0], RuntimeError)
    assert isinstance(job.events.queue[-1], RuntimeError)
    # nothing decoding: a prefill's forwards run alone, at once
    sched.forward = forward  # type: ignore[method-assign]
    expected, _ = chunk_prefill(m, CHUNKS, "causal", chunk_size=16, batch=8)
    thread = _prefill_thread(sched, m, results)
    sched.run_once()
    thread.join(timeout=5)
    bank, _ = results[1]
    _bank_equal(bank.kv, expected.kv, expected.lens)
