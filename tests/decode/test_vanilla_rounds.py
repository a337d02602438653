"""Vanilla requests in the batched rounds: the whole prompt as a session's local rows, no static KV, under
no decode policy or a caching one, sharing each round's one forward with pdllm sessions.

``generate_vanilla`` (the reference loop: dense attention over prompt + response, recomputed or cached
per the policy's plan) is the specification, token for token and counter for counter.
Planted: a vanilla session's pages reserved without its cache slots -> 4 of 5 fail (the session refuses
the short page list).
"""

from __future__ import annotations

import threading

import pytest

from pdllm.decode_service.policies import DecodePolicyConfig, make_policy
from pdllm.decode_service.policy_rounds import cache_slots
from pdllm.decode_service.request import DecodeRequest, Final, StaticDecode
from pdllm.decode_service.round_graphs import GraphedRoundForward
from pdllm.decode_service.rounds import BatchSession, EagerRoundForward
from pdllm.decode_service.scheduler import DecodeScheduler
from pdllm.shared.generation.sampler import GenerationConfig
from tests.decode.helpers import CASES, alone, pool_for, static_decode
from tests.engine.helpers import model, tokens
from tests.reference.vanilla import generate_vanilla

POLICIES = ["none", "prefix-cache", "dual-cache", "sparse-dllm", "polestar"]
GENS = [
    GenerationConfig(gen_length=8, steps=8, block_length=4),
    GenerationConfig(gen_length=6, steps=3, temperature=0.9, seed=5),
    GenerationConfig(gen_length=8, steps=8, threshold=0.4, block_length=4),
]


def _vanilla_job(
    m, rid: str, prompt: list[int], gen: GenerationConfig, policy: DecodePolicyConfig
) -> DecodeRequest:  # type: ignore[no-untyped-def]
    cache_policy = make_policy(policy)
    built = StaticDecode(prompt, None, gen, cache_policy=cache_policy)
    cache = cache_slots(len(prompt), gen, cache_policy) if cache_policy is not None else 0
    return DecodeRequest(rid, lambda: built, threading.Event(), False, 0, cache_tokens=cache)


def _pdllm_job(m, seed: int) -> DecodeRequest:  # type: ignore[no-untyped-def]
    built = static_decode(m, CASES[seed], seed)
    return DecodeRequest(f"p{seed}", lambda: built, threading.Event(), False, built.static.num_tokens)


def _final(job: DecodeRequest) -> Final:
    events = []
    while not job.events.empty():
        events.append(job.events.get_nowait())
    (final,) = [e for e in events if isinstance(e, Final)]
    return final


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("kind", ["eager", "padded"])
def test_vanilla_requests_of_every_caching_policy_share_rounds_with_pdllm_ones(
    family: str, kind: str
) -> None:
    m = model(family, seed=2)
    pool = pool_for(m, pages=128)
    forward = (
        EagerRoundForward(m, pool, "torch")
        if kind == "eager"
        else GraphedRoundForward(m, pool, "torch", False)
    )
    sched = DecodeScheduler(m, pool, forward, start_thread=False)
    want, jobs = [], []
    for i, name in enumerate(POLICIES):
        gen = GENS[i % len(GENS)]
        prompt = tokens(9 + 3 * i, 40 + i)
        policy = DecodePolicyConfig(name=name)
        want.append(generate_vanilla(m, prompt, gen, policy=policy if name != "none" else None))
        jobs.append(sched.submit(_vanilla_job(m, f"v{i}", prompt, gen, policy)))
    pdllm = [sched.submit(_pdllm_job(m, seed)) for seed in (0, 3)]
    sched.run_once()
    assert sched.rounds == 1  # every request, vanilla or not, took its first step in one forward
    assert all(isinstance(j.session, BatchSession) for j in jobs + pdllm)
    assert all(j.session.state.steps_taken == 1 for j in jobs + pdllm)  # type: ignore[union-attr]
    while sched.active:
        sched.run_once()
    for job, w, name in zip(jobs, want, POLICIES, strict=True):
        result = _final(job).result
        assert result.raw_tokens == w.raw_tokens, name
        assert result.steps == w.steps, name
        assert result.cache == w.cache, name
    for seed, job in zip((0, 3), pdllm, strict=True):
        assert _final(job).result.raw_tokens == alone(m, CASES[seed], seed)
    assert pool.num_free == pool.num_pages  # cache pages of the vanilla sessions went back too


def test_an_all_vanilla_round_without_pages_runs() -> None:
    """Sessions without pages (vanilla, no policy) only: the round's page table still has a column."""
    m = model("dream", seed=3)
    pool = pool_for(m, pages=4)
    sched = DecodeScheduler(m, pool, EagerRoundForward(m, pool, "torch"), start_thread=False)
    gen = GENS[0]
    prompts = [tokens(7, 1), tokens(12, 2)]
    jobs = [
        sched.submit(_vanilla_job(m, f"v{i}", p, gen, DecodePolicyConfig())) for i, p in enumerate(prompts)
    ]
    while sched.depth:
        sched.run_once()
    for job, prompt in zip(jobs, prompts, strict=True):
        assert (
            job.pages == [] and _final(job).result.raw_tokens == generate_vanilla(m, prompt, gen).raw_tokens
        )


@pytest.mark.parametrize("name", POLICIES)
def test_in_process_vanilla_runs_the_rounds_and_equals_the_reference_loop(name: str) -> None:
    """``generate --method vanilla`` and ``eval``'s vanilla decode through the worker's rounds."""
    from pdllm.decode_service.worker import DecodeWorker

    m = model("llada", seed=4)
    worker = DecodeWorker(m)
    policy = DecodePolicyConfig(name=name)
    for i, gen in enumerate(GENS):
        prompt = tokens(10 + i, 60 + i)
        got = worker.vanilla(prompt, gen, policy)
        want = generate_vanilla(m, prompt, gen, policy=policy if name != "none" else None)
        assert (got.raw_tokens, got.steps, got.cache) == (want.raw_tokens, want.steps, want.cache)
    assert worker.local.scheduler is not None and worker.local.scheduler.rounds > 0
