"""Sparse-dLLM requests hold KV pool pages only for the rows they keep, through the scheduler.

Every count here comes from the paper's keep rule (``p + floor((N - b - p) r)`` rows, ``p`` the question's
protected rows, none for vanilla) and the pool's free pages, not from ``cache_slots``. Pools are filled
with noise first and their free pages shuffled, so a request's pages interleave with others' and a slot
it never wrote holds another request's old K/V, as a reused page does.

Planted and seen failing:
- the kept-row page map off by one (``_record_salient`` storing kept row j in slot j + 1): the cached
  steps read a slot nobody wrote -> the admission test's tokens differ from the reference (noise read),
  the reuse test's rounds fail (a last kept row addressed past its pages);
- the reservation one slot short of the kept rows (``cache_slots`` returning the kept count - 1, so the
  page of the last kept row goes to another request): the admission test admits 9 requests, not 8, and
  the reuse test's rounds fail (the last kept row's slot lies past the request's pages).
"""

from __future__ import annotations

import random
import threading
from dataclasses import replace

import torch

from pdllm.decode_service.kv_pool import DecodeKVPool
from pdllm.decode_service.policies import DecodePolicyConfig, make_policy
from pdllm.decode_service.request import DecodeRequest, Final, StaticDecode, Status
from pdllm.decode_service.rounds import EagerRoundForward
from pdllm.decode_service.scheduler import DecodeScheduler, SchedulerConfig
from pdllm.decode_service.sessions import SessionMaker
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.model.transformer import DiffusionLM
from tests.decode.helpers import POLICY_CASES, pool_for, reference, static_decode
from tests.engine.helpers import model, tokens
from tests.reference.vanilla import generate_vanilla

PAGE = 4
GEN = GenerationConfig(gen_length=8, steps=8, block_length=4)
PROMPT = 62  # N = 70 local rows: dual cache 70 slots (18 pages); r = 0.5 keeps floor(66 / 2) = 33 (9 pages)
SPARSE = DecodePolicyConfig(name="sparse-dllm", retention=0.5)
DUAL = DecodePolicyConfig(name="dual-cache")


def kept_rows(rows: int, block: int, retention: float, protected: int) -> int:
    """The paper's keep count, written out here: the protected rows and floor(r * the other candidates)."""
    return protected + int((rows - block - protected) * retention)


def pages(slots: int) -> int:
    return -(-slots // PAGE)


def noisy_pool(m: DiffusionLM, num_pages: int, seed: int) -> DecodeKVPool:
    """A pool whose slots hold noise and whose free pages come out in a shuffled order."""
    pool = pool_for(m, pages=num_pages, page_size=PAGE)
    pool.kv.normal_(generator=torch.Generator().manual_seed(seed))
    every = pool.pool.allocate(pool.num_pages)
    random.Random(seed).shuffle(every)
    pool.release(every)
    return pool


def vanilla_job(
    m: DiffusionLM, rid: str, prompt: list[int], gen: GenerationConfig, policy: DecodePolicyConfig
) -> DecodeRequest:
    slots = SessionMaker(m, PAGE).pool_slots(policy, len(prompt), gen, static=False)
    built = StaticDecode(prompt, None, gen, cache_policy=make_policy(policy))
    return DecodeRequest(rid, lambda: built, threading.Event(), False, 0, cache_tokens=slots)


def finals(
    sched: DecodeScheduler, jobs: list[DecodeRequest], seen: dict[str, tuple[list[int], bool]] | None = None
) -> list[Final]:
    """Run the scheduler until every job has ended; each job's Final (a failure is re-raised). ``seen``:
    each job's pages when first seen holding some, and whether the first job was running then."""
    for _ in range(400):
        if all(j.status.done for j in jobs):
            break
        sched.run_once()
        for j in jobs:
            if seen is not None and j.pages and j.request_id not in seen:
                seen[j.request_id] = (list(j.pages), jobs[0].status is Status.RUNNING)
    out = []
    for j in jobs:
        events = [j.events.get_nowait() for _ in range(j.events.qsize())]
        for e in events:
            if isinstance(e, BaseException):
                raise e
        (final,) = [e for e in events if isinstance(e, Final)]
        out.append(final)
    return out


def admitted_at_once(
    m: DiffusionLM, pool: DecodeKVPool, policy: DecodePolicyConfig, n: int
) -> tuple[DecodeScheduler, list[DecodeRequest], list[DecodeRequest]]:
    """Submit ``n`` equal vanilla requests; the ones the first iteration admitted, and all of them."""
    sched = DecodeScheduler(m, pool, EagerRoundForward(m, pool, "torch"), start_thread=False)
    jobs = [vanilla_job(m, f"{policy.name}{i}", tokens(PROMPT, i), GEN, policy) for i in range(n)]
    for j in jobs:
        sched.submit(j)
    sched.run_once()
    return sched, [j for j in jobs if j.status is not Status.WAITING], jobs


def test_a_pool_that_fits_n_dual_cache_requests_admits_n_over_r_sparse_ones() -> None:
    """A pool of exactly four dual-cache requests' pages admits four of them at once and eight Sparse-dLLM
    requests at r = 0.5, each holding the pages of its kept rows only (from admission to its end: its
    peak and its size after eviction are one); all of them still decode as the reference loop."""
    m = model("dream")
    rows = PROMPT + GEN.gen_length
    dual_pages, sparse_pages = pages(rows), pages(kept_rows(rows, GEN.block, 0.5, 0))
    assert (dual_pages, sparse_pages) == (18, 9)
    size = 4 * dual_pages

    pool = noisy_pool(m, size, 0)
    _, dual, _ = admitted_at_once(m, pool, DUAL, 6)
    assert len(dual) == size // dual_pages == 4
    assert pool.num_free == size - 4 * dual_pages == 0

    pool = noisy_pool(m, size, 1)
    sched, sparse, jobs = admitted_at_once(m, pool, SPARSE, 10)
    assert len(sparse) == size // sparse_pages == 8  # N / r
    assert pool.num_free == size - 8 * sparse_pages == 0
    assert all(len(j.pages) == sparse_pages for j in sparse)
    done = finals(sched, jobs)
    assert pool.num_free == size  # every page back
    for i, final in enumerate(done):
        want = generate_vanilla(m, tokens(PROMPT, i), GEN, policy=SPARSE)
        assert final.result.raw_tokens == want.raw_tokens, i
        assert final.pool_bytes == final.pool_peak_bytes == sparse_pages * pool.page_bytes


def test_pages_a_finished_request_gave_back_are_reused_while_kept_rows_stay_intact() -> None:
    """Sparse-dLLM requests (vanilla, and pdllm over static KV with the question protected) share a noisy,
    shuffled pool with a dual-cache one; later arrivals wait for pages and get the ones that short requests
    gave back while a long one is mid-decode, its kept rows on pages beside theirs. Every request decodes
    as its reference loop, and each held exactly the pages of its static KV plus its kept rows."""
    m = model("dream")
    long_gen = GenerationConfig(gen_length=16, steps=16, block_length=4)
    short_gen = GenerationConfig(gen_length=4, steps=4, block_length=4)
    vanilla = [  # (prompt length, gen, policy); N - b even and odd, kept counts across page boundaries
        (PROMPT, long_gen, SPARSE),
        (33, short_gen, SPARSE),
        (40, short_gen, DUAL),
        (29, GEN, SPARSE),
        (51, GEN, SPARSE),
    ]
    jobs: list[DecodeRequest] = []
    want: list[list[int]] = []
    held: list[int] = []
    for i, (n, gen, policy) in enumerate(vanilla):
        prompt = tokens(n, 20 + i)
        jobs.append(vanilla_job(m, f"v{i}", prompt, gen, policy))
        want.append(generate_vanilla(m, prompt, gen, policy=policy).raw_tokens)
        rows = n + gen.gen_length
        held.append(pages(rows if policy is DUAL else kept_rows(rows, gen.block, 0.5, 0)))
    case = POLICY_CASES[1]  # pdllm: static KV, then the question's rows (protected) and the answer's
    built = replace(static_decode(m, case, 1), cache_policy=make_policy(SPARSE))
    q, kv = len(built.query), built.kv_tokens
    slots = SessionMaker(m, PAGE).pool_slots(SPARSE, q, case.gen, static=True)
    jobs.insert(2, DecodeRequest("p", lambda: built, threading.Event(), False, kv, cache_tokens=slots))
    want.insert(2, reference(m, case, 1, SPARSE)[0])
    held.insert(2, pages(kv + kept_rows(q + case.gen.gen_length, case.gen.block, 0.5, q)))

    # Room for the first three at once: the others wait for pages the short ones give back.
    size = sum(held[:3]) + 1
    pool = noisy_pool(m, size, 2)
    config = SchedulerConfig(max_active=8)
    sched = DecodeScheduler(m, pool, EagerRoundForward(m, pool, "torch"), config, start_thread=False)
    for j in jobs:
        sched.submit(j)
    sched.run_once()
    assert [j.status is Status.WAITING for j in jobs] == [False] * 3 + [True] * 3
    seen = {j.request_id: (list(j.pages), True) for j in jobs[:3]}
    done = finals(sched, jobs, seen)
    assert pool.num_free == size
    first = set(seen[jobs[1].request_id][0]) | set(seen[jobs[2].request_id][0])
    for j in jobs[3:]:  # each got pages the short ones had held, while the long one was mid-decode
        pages_of, long_running = seen[j.request_id]
        assert long_running and first & set(pages_of), j.request_id
    for i, (final, tokens_want, n) in enumerate(zip(done, want, held, strict=True)):
        assert final.result.raw_tokens == tokens_want, i
        assert final.pool_bytes == final.pool_peak_bytes == n * pool.page_bytes, i
