"""A pdllm request under top-B retention holds KV pool pages only for the static tokens its build keeps.

Counts come from the pool's free pages and the rule written out here (the instruction plus ``min(B, n)``
tokens of each chunk of ``n``), not from the server's ``static_tokens``. Pools are filled with noise and
their free pages shuffled, so a slot a request never wrote holds garbage and its pages interleave with
others'. Every answer equals ``shared/reference.py``'s.

Planted and seen failing:
- the retained count one short (``static_tokens`` returning one token less): the 21-token request gets
  5 pages, not 6, and its build's write of its last kept token finds no page -> both tests fail ("a
  chunk of 21 tokens needs 6 pages, got 5");
- top-B ignored in the reservation (the old rule, every chunk token reserved): the exact-pages test sees
  11 pages held, not 6, and the admission test admits 4 requests, not 7.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch

from pdllm.decode_service.kv_pool import DecodeKVPool
from pdllm.decode_service.rounds import EagerRoundForward
from pdllm.decode_service.scheduler import DecodeScheduler, SchedulerConfig
from pdllm.decode_service.server import DecodeServicer
from pdllm.decode_service.worker import DecodeWorker
from pdllm.protos.pdllm.v1 import workers_pb2 as wpb
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.layout import Request
from pdllm.shared.model.transformer import DiffusionLM
from pdllm.shared.reference import reference_generate
from tests.decode.helpers import pool_for
from tests.decode.test_sdar_decode_worker import _decode, _pdllm_request
from tests.engine.helpers import model, tokens

PAGE = 4
B = 5
GEN = GenerationConfig(gen_length=8, steps=8, block_length=4)
CHUNK_LENS = (12, 9, 12, 10)  # 43 tokens, 20 kept at B = 5


def pages(slots: int) -> int:
    return -(-slots // PAGE)


def kept(instruction: int, top_b: int | None) -> int:
    """Static tokens the build keeps: the instruction, then per chunk all of it or its B best (BOS among)."""
    return instruction + sum(n if top_b is None else min(top_b, n) for n in CHUNK_LENS)


def noisy_pool(m: DiffusionLM, num_pages: int, seed: int) -> DecodeKVPool:
    pool = pool_for(m, pages=num_pages, page_size=PAGE)
    pool.kv.normal_(generator=torch.Generator().manual_seed(seed))
    every = pool.pool.allocate(pool.num_pages)
    random.Random(seed).shuffle(every)
    pool.release(every)
    return pool


def ask(instruction: int, seed: int, top_b: int | None) -> tuple[wpb.DecodeRequest, Request]:
    instr, query = tokens(instruction, seed), tokens(4, seed + 1)
    chunks = [tokens(n, seed + 10 + i) for i, n in enumerate(CHUNK_LENS)]
    method = {"top_k": len(chunks)} | ({} if top_b is None else {"top_b": top_b})
    wire = _pdllm_request(instr, chunks, query, GEN, **method)
    wire.request_id = f"i{instruction}s{seed}b{top_b}"
    return wire, Request(instruction=instr, chunks=chunks, query=query)


def want(worker: DecodeWorker, request: Request, top_b: int | None) -> list[int]:
    config = replace(worker.config, top_k=len(request.chunks), top_b=top_b)
    return reference_generate(worker.model, request, config, GEN).result.token_ids


def serve(
    pool: DecodeKVPool, worker: DecodeWorker, asks: list[wpb.DecodeRequest]
) -> tuple[list[wpb.DecodeResult], int, int]:
    """Decode ``asks`` through the servicer, this thread driving the scheduler; their results, and after
    the first iteration how many were admitted and the pool's free pages."""
    m = worker.model
    sched = DecodeScheduler(
        m, pool, EagerRoundForward(m, pool, "torch"), SchedulerConfig(max_active=32), start_thread=False
    )
    servicer = DecodeServicer(worker, sched)
    with ThreadPoolExecutor(len(asks)) as threads:
        calls = [threads.submit(_decode, servicer, r) for r in asks]
        deadline = time.monotonic() + 30
        while sched.depth < len(asks) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sched.depth == len(asks)
        sched.run_once()
        admitted, free = len(sched.active), pool.num_free
        while sched.depth:
            sched.run_once()
        results = [c.result(timeout=30)[0] for c in calls]
    assert pool.num_free == pool.num_pages  # every page back
    return results, admitted, free


def test_a_top_b_request_holds_exactly_the_pages_of_its_kept_tokens() -> None:
    """Alone in a pool, a request with 1 (then 4) instruction tokens holds ceil((1 + 4 x 5) / 4) = 6 (then
    ceil(24 / 4) = 6) pages under B = 5, against 11 (then 12) without top-B; each answers as the
    reference."""
    m = model("dream")
    worker = DecodeWorker(m)
    for instruction, seed in ((1, 3), (4, 7)):
        for top_b in (B, None):
            wire, request = ask(instruction, seed, top_b)
            pool = noisy_pool(m, 16, seed)
            (result,), admitted, free = serve(pool, worker, [wire])
            held = pool.num_pages - free
            assert admitted == 1 and held == pages(kept(instruction, top_b)), (instruction, top_b, held)
            assert list(result.token_ids) == want(worker, request, top_b), (instruction, top_b)
    assert [pages(kept(i, b)) for i in (1, 4) for b in (B, None)] == [6, 11, 6, 12]


def test_a_pool_that_fits_n_requests_without_top_b_admits_more_with_it() -> None:
    """A pool of exactly four full-chunk requests' pages (4 x 11) admits four of them at once, and seven
    top-B ones (44 // 6); every answer still equals the reference."""
    m = model("dream")
    worker = DecodeWorker(m)
    full, retained = pages(kept(1, None)), pages(kept(1, B))
    size = 4 * full
    for top_b, n in ((None, size // full), (B, size // retained)):
        asks = [ask(1, 40 + i, top_b) for i in range(8)]
        results, admitted, free = serve(noisy_pool(m, size, 5), worker, [w for w, _ in asks])
        assert admitted == n and free == size - n * pages(kept(1, top_b)), (top_b, admitted, free)
        for result, (_, request) in zip(results, asks, strict=True):
            assert list(result.token_ids) == want(worker, request, top_b), (top_b, request.instruction)
    assert (size // full, size // retained) == (4, 7)
