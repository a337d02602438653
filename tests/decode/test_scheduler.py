"""The decode scheduler: batched rounds for every active request, admission, pool budget, cancellation.

Driven with ``run_once`` (no thread): each call is one scheduler iteration, so every assertion is about a
known round. Each of the scheduler's likely bugs (only some requests advance per round; ``max_waiting`` not
enforced; cancelled requests kept, their pages not freed) fails one of these tests. Planted by hand: the
round leaving out its first request -> the first test fails; cancelled requests not retired at the start
of an iteration -> the cancellation test fails.
"""

from __future__ import annotations

import threading

import grpc
import pytest

from pdllm.decode_service.request import DecodeRequest, Final, Partial, StaticDecode, Status
from pdllm.decode_service.rounds import EagerRoundForward
from pdllm.decode_service.scheduler import DecodeScheduler, SchedulerConfig
from pdllm.shared.layout import decode_layout
from pdllm.shared.rpc.errors import PdllmError
from tests.decode.helpers import CASES, alone, pool_for, prefill, static_decode
from tests.engine.helpers import model


def _scheduler(m, pages: int = 64, **config) -> DecodeScheduler:  # type: ignore[no-untyped-def]
    pool = pool_for(m, pages=pages)
    forward = EagerRoundForward(m, pool, "torch")
    return DecodeScheduler(m, pool, forward, SchedulerConfig(**config), start_thread=False)


def _job(m, seed: int, case_index: int | None = None, kv_tokens: int | None = None) -> DecodeRequest:  # type: ignore[no-untyped-def]
    case = CASES[seed if case_index is None else case_index]
    built = static_decode(m, case, seed)
    tokens = built.static.num_tokens if kv_tokens is None else kv_tokens
    return DecodeRequest(f"r{seed}", lambda: built, threading.Event(), True, tokens)


def _events(job: DecodeRequest) -> list:
    out = []
    while not job.events.empty():
        out.append(job.events.get())
    return out


def test_every_active_request_advances_in_each_round_and_answers_exactly() -> None:
    m = model("dream")
    sched = _scheduler(m)
    jobs = [sched.submit(_job(m, seed)) for seed in range(len(CASES))]
    sched.run_once()
    assert sched.rounds == 1
    for job in jobs:  # one batched round moved every request one step
        assert job.session is not None and job.session.state.steps_taken == 1
        (event,) = _events(job)
        assert isinstance(event, Partial) and event.step == 1
    finals = {}
    blocks: dict[str, list[int]] = {job.request_id: [] for job in jobs}
    for _ in range(100):  # bounded: a request the rounds skip would never finish
        if not sched.active:
            break
        sched.run_once()
        for job in jobs:
            for event in _events(job):
                if isinstance(event, Final):
                    finals[job.request_id] = event
                else:
                    blocks[job.request_id].append(event.block)
    for job, case in zip(jobs, CASES, strict=True):  # partials name the block denoised, never one past it
        assert blocks[job.request_id] and max(blocks[job.request_id]) < case.gen.num_blocks
    longest = max(job.session.state.steps_taken for job in jobs)  # type: ignore[union-attr]
    assert sched.rounds == longest  # one forward per round, not one per request
    for seed, (job, case) in enumerate(zip(jobs, CASES, strict=True)):
        assert finals[job.request_id].result.raw_tokens == alone(m, case, seed)
    assert sched.pool.num_free == sched.pool.num_pages  # every page back
    assert all(job.status is Status.FINISHED for job in jobs)


def test_max_waiting_is_enforced_with_resource_exhausted() -> None:
    m = model("dream")
    sched = _scheduler(m, max_waiting=2)
    sched.submit(_job(m, 0))
    sched.submit(_job(m, 1))
    with pytest.raises(PdllmError) as err:
        sched.submit(_job(m, 2))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in str(err.value)
    sched.run_once()  # both admitted: room in the queue again
    sched.submit(_job(m, 2))


def test_cancelled_request_leaves_and_frees_its_pages_at_once() -> None:
    m = model("dream")
    sched = _scheduler(m)
    keep, drop = sched.submit(_job(m, 0)), sched.submit(_job(m, 1))
    sched.run_once()
    held = sched.pool.num_pages - sched.pool.num_free
    assert len(drop.pages) > 0 and held == len(keep.pages) + len(drop.pages)
    drop.cancelled.set()
    steps = drop.session.state.steps_taken  # type: ignore[union-attr]
    sched.run_once()
    assert [j.request_id for j in sched.active] == [keep.request_id]
    assert (keep.status, drop.status) == (Status.RUNNING, Status.CANCELLED)
    assert sched.pool.num_pages - sched.pool.num_free == len(keep.pages)  # its pages are back
    assert drop.session.state.steps_taken == steps  # type: ignore[union-attr]  # not stepped again
    # a request cancelled while waiting is never built
    waiting = _job(m, 2)
    waiting.cancelled.set()
    sched.submit(waiting)
    sched.run_once()
    assert waiting.session is None and waiting not in sched.active and waiting.status is Status.CANCELLED


def test_pool_budget_makes_requests_wait_and_refuses_what_never_fits() -> None:
    m = model("dream")
    sched = _scheduler(m, pages=6)  # 16-token pages
    first = sched.submit(_job(m, 0, case_index=0, kv_tokens=64))  # 4 pages
    second = sched.submit(_job(m, 1, case_index=0, kv_tokens=48))  # 3 pages: must wait
    sched.run_once()
    assert [j.request_id for j in sched.active] == [first.request_id] and second.session is None
    assert (first.status, second.status) == (Status.RUNNING, Status.WAITING)
    while first in sched.active:
        sched.run_once()
    sched.run_once()  # first's pages are back: second is admitted
    assert second in sched.active
    with pytest.raises(PdllmError) as err:
        sched.submit(_job(m, 2, case_index=0, kv_tokens=7 * 16))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV pool holds" in str(err.value)


def test_max_active_bounds_each_round_and_a_failed_build_returns_its_pages() -> None:
    m = model("dream")
    sched = _scheduler(m, max_active=2)
    jobs = [sched.submit(_job(m, seed)) for seed in range(3)]
    sched.run_once()
    assert len(sched.active) == 2 and jobs[2].session is None

    def broken():  # type: ignore[no-untyped-def]
        raise ValueError("bad chunk")

    bad = DecodeRequest("bad", broken, threading.Event(), True, 16)
    other = _scheduler(m)
    other.submit(bad)
    other.run_once()
    assert isinstance(bad.events.get_nowait(), ValueError) and bad.status is Status.FAILED
    assert other.pool.num_free == other.pool.num_pages and not other.active


def test_other_device_work_runs_one_piece_per_round_while_requests_decode() -> None:
    """The all-in-one's prefill pieces: one after each round while decoding, all at once when idle."""
    m = model("dream")
    sched = _scheduler(m)
    log: list[str] = []
    forward = sched.forward
    sched.forward = lambda packed: (log.append("round"), forward(packed))[1]  # type: ignore[method-assign]

    def pieces(n: int, tag: str):  # type: ignore[no-untyped-def]
        for i in range(n):
            log.append(f"{tag}{i}")
            if i < n - 1:
                yield
        return tag

    sched.submit(_job(m, 0))  # CASES[0]: 3 rounds
    results: list[str] = []
    caller = threading.Thread(target=lambda: results.append(sched.run_between_rounds(pieces(4, "p"))))
    caller.start()
    while not sched._foreign:  # the caller has handed its work over
        pass
    while sched.active or sched._waiting or sched._foreign:
        sched.run_once()
    caller.join(timeout=5)
    assert results == ["p"]
    # decoding: a piece after each round; once the request is done, the rest without waiting for rounds
    assert log[:6] == ["round", "p0", "round", "p1", "round", "p2"] and log[6:] == ["p3"]
    idle = threading.Thread(target=lambda: results.append(sched.run_between_rounds(pieces(3, "q"))))
    idle.start()
    while not sched._foreign:
        pass
    sched.run_once()
    idle.join(timeout=5)
    assert results == ["p", "q"] and log[-3:] == ["q0", "q1", "q2"]  # nothing decoding: all in one go


def _piecewise_job(m, seed: int) -> DecodeRequest:  # type: ignore[no-untyped-def]
    """A job whose build can also run in pieces of N layers (what the decode server hands over)."""
    case = CASES[seed]
    engine, sel = prefill(m, case, seed)
    layout = decode_layout(sel.request, sel.selected, case.gen.gen_length)

    def steps(layers: int):  # type: ignore[no-untyped-def]
        worker = engine.decode_worker
        static = yield from worker.build_steps(sel.request, layout, sel.config, (), layers)
        return StaticDecode(sel.request.query, static, case.gen)

    whole = static_decode(m, case, seed)
    return DecodeRequest(
        f"p{seed}", lambda: whole, threading.Event(), True, whole.static.num_tokens, start_steps=steps
    )


def test_builds_in_pieces_run_one_piece_per_round_and_answer_exactly() -> None:
    m = model("dream")  # two layers: build_pieces=1 cuts each build into two pieces
    sched = _scheduler(m, build_pieces=1)
    first = sched.submit(_piecewise_job(m, 1))
    sched.run_once()  # nothing decodes yet: the whole build runs, then the first round
    assert first.session is not None and first.session.state.steps_taken == 1
    second = sched.submit(_piecewise_job(m, 0))
    sched.run_once()  # one piece of the second build, then a round of the first alone
    assert second.session is None and first.session.state.steps_taken == 2
    assert second.status is Status.BUILDING and second.build is not None
    sched.run_once()  # the last piece: the build finishes and joins this round
    assert second.session is not None and second.session.state.steps_taken == 1
    assert first.session.state.steps_taken == 3
    finals = {}
    for _ in range(100):
        if not sched.active:
            break
        sched.run_once()
        for job in (first, second):
            for event in _events(job):
                if isinstance(event, Final):
                    finals[job.request_id] = event
    assert finals[first.request_id].result.raw_tokens == alone(m, CASES[1], 1)
    assert finals[second.request_id].result.raw_tokens == alone(m, CASES[0], 0)
    assert sched.pool.num_free == sched.pool.num_pages


def test_a_handoff_job_holds_its_pages_and_builds_only_once_its_pull_finished() -> None:
    from pdllm.decode_service.kv_receiver import Transfer, TransferState
    from pdllm.protos.pdllm.v1 import workers_pb2 as wpb

    m = model("dream")
    sched = _scheduler(m)
    other = sched.submit(_job(m, 0))
    pulls: list[Transfer] = []
    started: list[Transfer | None] = []

    def job_with_pull(seed: int) -> DecodeRequest:
        job = _job(m, seed)
        build = job.start
        job.start = lambda: (started.append(job.received), build())[1]  # type: ignore[assignment]
        job.fetch = lambda: pulls.append(Transfer(wpb.KvHandoff())) or pulls[-1]  # type: ignore[assignment]
        return sched.submit(job)

    pulled, dropped = job_with_pull(1), job_with_pull(2)
    for _ in range(2):  # the other request decodes meanwhile; nothing is built while the pulls run
        sched.run_once()
    assert started == [] and len(pulls) == 2 and pulled.pages and dropped.pages
    assert pulled.status is Status.PULLING and dropped.status is Status.PULLING
    assert [j.request_id for j in sched.active] == [other.request_id]
    assert other.session.state.steps_taken == 2  # type: ignore[union-attr]
    pulls[0].state = TransferState.FAILED
    dropped.cancelled.set()
    sched.run_once()
    assert started == [pulls[0]]  # built once the pull finished, seeing the finished pull
    assert pulled in sched.active and not dropped.pages  # the cancelled one gave its pages back at once
    assert (pulled.status, dropped.status) == (Status.RUNNING, Status.CANCELLED)
    assert sched.pool.num_pages - sched.pool.num_free == len(other.pages) + len(pulled.pages)


def test_a_cancelled_pull_still_writing_keeps_its_pages_until_it_has_finished() -> None:
    from pdllm.decode_service.kv_receiver import Transfer, TransferState
    from pdllm.protos.pdllm.v1 import workers_pb2 as wpb
    from pdllm.shared.kv_transfer.pages import PageTarget

    m = model("dream")
    sched = _scheduler(m)
    job = _job(m, 0)
    pull = Transfer(wpb.KvHandoff(), PageTarget(sched.pool.kv, (0,)))
    job.fetch = lambda: pull  # type: ignore[assignment]
    sched.submit(job)
    sched.run_once()
    pull._claim()  # the receiver has started writing into the job's pages
    job.cancelled.set()
    sched.run_once()
    assert job.pages and sched.pool.num_free < sched.pool.num_pages  # another job must not get them yet
    assert job.status is Status.PULLING
    pull.state = TransferState.FAILED
    sched.run_once()
    assert not job.pages and sched.pool.num_free == sched.pool.num_pages
