"""Block diffusion (SDAR) through the decode scheduler's rounds against the from-scratch oracle
(``block_diffusion.py``: the whole sequence recomputed every step, no cache): requests arriving while others
are mid-block, one leaving early, the in-process vanilla and pdllm paths; tokens and step counts equal.

Planted (``block_rounds.py``): a finished block's record not stored -> all 6 fail; every entry of a window
reading only the slots before the window (no causal order between its model blocks) -> 5 of 6 fail; a window
forwarded as one entry -> 5 of 6 fail."""

from __future__ import annotations

import threading

import pytest
import torch

from pdllm.decode_service.block_rounds import block_slots, start_block_decode
from pdllm.decode_service.kv_pool import DecodeKVPool
from pdllm.decode_service.request import DecodeRequest, Final, Status
from pdllm.decode_service.round_graphs import GraphedRoundForward
from pdllm.decode_service.rounds import BatchSession, EagerRoundForward
from pdllm.decode_service.scheduler import DecodeScheduler
from pdllm.decode_service.worker import DecodeWorker
from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.config import EngineConfig

from .block_diffusion import block_diffusion
from .cases import CHUNK, CONTEXT, INSTRUCTION, QUESTION, TOP_K, gen, ids, model

# (prompt length, gen_length, steps, block_length, threshold): prompts ending mid model block and on a
# generation block boundary, blocks of one, two and three model blocks (4 positions each).
REQUESTS = [
    (9, 16, 16, 4, None),
    (16, 16, 8, 8, None),
    (13, 12, 12, 12, None),
    (22, 16, 16, 8, 0.2),
    (7, 8, 4, 4, None),
]


def _pool(m, pages: int = 64, page_size: int = 8) -> DecodeKVPool:  # type: ignore[no-untyped-def]
    return DecodeKVPool.with_pages(m, pages, page_size)


def _job(m, rid: str, prompt: list[int], g) -> DecodeRequest:  # type: ignore[no-untyped-def]
    start = lambda: start_block_decode(m, torch.tensor(prompt), g)  # noqa: E731
    return DecodeRequest(rid, start, threading.Event(), False, cache_tokens=block_slots(len(prompt), g))


def _final(job: DecodeRequest) -> Final:
    (final,) = [e for e in list(job.events.queue) if isinstance(e, Final)]
    return final


@pytest.mark.parametrize("kind", ["eager", "padded"])
def test_requests_arriving_mid_block_each_equal_the_oracle(kind: str) -> None:
    """Two requests start together, the others arrive one per iteration while earlier ones are mid-block;
    every iteration with a running request runs one forward, whatever their blocks and records."""
    m = model("sdar", layers=2, seed=3)
    pool = _pool(m)
    forward = (
        EagerRoundForward(m, pool, "torch")
        if kind == "eager"
        else GraphedRoundForward(m, pool, "torch", False)
    )
    sched = DecodeScheduler(m, pool, forward, start_thread=False)
    cases = [(ids(n, 10 + i), gen(*rest)) for i, (n, *rest) in enumerate(REQUESTS)]
    jobs: list[DecodeRequest] = []
    iterations = 0
    while len(jobs) < len(cases) or sched.depth:
        for i in range(len(jobs), min(len(cases), max(2, iterations + 1))):
            jobs.append(sched.submit(_job(m, f"b{i}", *cases[i])))
        before = sched.rounds
        sched.run_once()
        iterations += 1
        running = [j for j in jobs if j.status is Status.RUNNING or j.status is Status.FINISHED]
        if running:
            assert sched.rounds == before + 1
            assert all(isinstance(j.session, BatchSession) for j in running)
        assert iterations < 200
    assert pool.num_free == pool.num_pages
    for (prompt, g), job in zip(cases, jobs, strict=True):
        answer, steps = block_diffusion(m, prompt, g.gen_length, g.block, g.steps, g.threshold)
        result = _final(job).result
        assert (result.raw_tokens, result.steps) == (answer, steps), job.request_id


def test_a_request_leaving_mid_block_does_not_disturb_the_others() -> None:
    m = model("sdar", layers=2, seed=4)
    pool = _pool(m)
    sched = DecodeScheduler(m, pool, EagerRoundForward(m, pool, "torch"), start_thread=False)
    cases = [(ids(n, 30 + i), gen(*rest)) for i, (n, *rest) in enumerate(REQUESTS[:3])]
    jobs = [sched.submit(_job(m, f"c{i}", *c)) for i, c in enumerate(cases)]
    for _ in range(3):
        sched.run_once()
    jobs[1].cancelled.set()
    while sched.depth:
        sched.run_once()
    assert jobs[1].status is Status.CANCELLED
    assert pool.num_free == pool.num_pages
    for i in (0, 2):
        prompt, g = cases[i]
        answer, steps = block_diffusion(m, prompt, g.gen_length, g.block, g.steps, g.threshold)
        assert (_final(jobs[i]).result.raw_tokens, _final(jobs[i]).result.steps) == (answer, steps)


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "graph-buckets"])
@pytest.mark.parametrize("schedule", [(16, 16, 4, None), (12, 6, 12, None), (16, 16, 8, 0.2)])
def test_in_process_vanilla_and_pdllm_equal_the_oracle(schedule: tuple, cuda_graph: bool) -> None:
    """``DecodeWorker.vanilla`` over a prompt, and the engine's pdllm decode over its selected prompt
    (``[instruction][BOS c_i]...[question]``, the chunks it reports, fixed chunks of ``CHUNK`` tokens);
    ``cuda_graph``: through the graph buckets' padded buffers (run eagerly off CUDA)."""
    m, g = model("sdar", layers=2, seed=5), gen(*schedule)
    prompt = ids(21, 7)
    answer, steps = block_diffusion(m, prompt, g.gen_length, g.block, g.steps, g.threshold)
    result = DecodeWorker(m, cuda_graph=cuda_graph).vanilla(prompt, g)
    assert (result.raw_tokens, result.steps) == (answer, steps)

    config = EngineConfig(chunk_size=CHUNK, top_k=TOP_K)
    engine = PrefillingEngine(m, None, config, cuda_graph=cuda_graph)
    result, trace = engine.generate(CONTEXT, QUESTION, g, INSTRUCTION)
    bos = m.config.bos_token_id
    selected = list(INSTRUCTION)
    for i in trace.selected:
        selected += [bos, *CONTEXT[i * CHUNK : (i + 1) * CHUNK]]
    answer, steps = block_diffusion(m, selected + QUESTION, g.gen_length, g.block, g.steps, g.threshold)
    assert (result.raw_tokens, result.steps) == (answer, steps)
