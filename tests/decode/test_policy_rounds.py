"""Decode policies in batched rounds (``decode_service/policy_rounds.py``) against the reference loop."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from pdllm.decode_service.policies import DecodePolicyConfig, make_policy
from pdllm.decode_service.policy_rounds import PolicyBatchSession, cache_slots
from pdllm.decode_service.request import DecodeRequest, Final
from pdllm.decode_service.rounds import EagerRoundForward
from pdllm.decode_service.scheduler import DecodeScheduler
from pdllm.shared.generation.sampler import GenerationConfig
from tests.decode.helpers import (
    CASES,
    POLICY_CASES,
    alone,
    policy_session,
    pool_for,
    reference,
    round_forward,
    run_rounds,
    session,
    static_decode,
)
from tests.engine.helpers import model


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("name", ["dual-cache", "prefix-cache"])
@pytest.mark.parametrize("kind", ["eager", "padded"])
def test_decode_in_rounds_equal_the_reference_loop(family: str, name: str, kind: str) -> None:
    m = model(family)
    policy = DecodePolicyConfig(name=name)
    want = [reference(m, case, seed, policy) for seed, case in enumerate(POLICY_CASES)]
    plain_want = alone(m, CASES[1], 7)
    pool = pool_for(m, pages=128)
    forward = round_forward(kind, m, pool)
    sessions = [policy_session(m, pool, case, seed, policy) for seed, case in enumerate(POLICY_CASES)]
    plain = session(m, pool, CASES[1], 7)  # a session without a policy shares the rounds
    rounds = run_rounds(forward, [sessions[0], plain, *sessions[1:]])
    assert plain.state.tokens.tolist() == plain_want
    for s, (tokens, cache), case in zip(sessions, want, POLICY_CASES, strict=True):
        result = s.result()
        assert result.raw_tokens == tokens, case
        assert result.cache == cache, case  # the policy's counters too
    assert rounds < sum(s.state.steps_taken for s in sessions)


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_refresh_every_step_equals_plain_decoding(family: str) -> None:
    m = model(family)
    pool = pool_for(m, pages=128)
    forward = EagerRoundForward(m, pool, "torch")
    for seed, case in enumerate(POLICY_CASES[:2]):
        s = policy_session(m, pool, case, seed, DecodePolicyConfig(name="dual-cache", refresh_steps=1))
        run_rounds(forward, [s])
        assert s.state.tokens.tolist() == alone(m, case, seed)
        assert s.stats.refreshes == s.stats.forwards and s.cached_rows == 0
        pool.release(s.pages)


def test_host_sampler_sessions_equal_the_reference_loop() -> None:
    m = model("dream")
    pool = pool_for(m, pages=128)
    policy = DecodePolicyConfig(name="dual-cache")
    case = POLICY_CASES[1]
    s = policy_session(m, pool, case, 1, policy, device_sampler=False)
    run_rounds(EagerRoundForward(m, pool, "torch"), [s])
    assert s.state.tokens.tolist() == reference(m, case, 1, policy)[0]


def test_other_kinds_policies_and_short_page_lists_are_refused() -> None:
    m = model("dream")
    pool = pool_for(m, pages=128)
    case = POLICY_CASES[0]
    built = static_decode(m, case, 0)
    s = built.static
    polestar = make_policy(DecodePolicyConfig(name="polestar"))
    dual = make_policy(DecodePolicyConfig(name="dual-cache"))
    assert polestar is not None and dual is not None
    pages = pool.reserve(s.num_tokens)
    assert pages is not None
    # Polestar-Cache's sessions are their own kind (``polestar_rounds.PolestarBatchSession``).
    with pytest.raises(ValueError, match="PolicyBatchSession does not run decode policy 'polestar'"):
        PolicyBatchSession.start_policy(
            m, built.query, s.query_start, s.num_tokens, pages, case.gen, polestar, 16
        )
    with pytest.raises(ValueError, match="needs .* pages"):
        PolicyBatchSession.start_policy(
            m, built.query, s.query_start, s.num_tokens, pages, case.gen, dual, 16
        )


def test_scheduler_runs_policy_jobs_in_its_batched_rounds() -> None:
    m = model("dream")
    pool = pool_for(m, pages=128)
    sched = DecodeScheduler(m, pool, EagerRoundForward(m, pool, "torch"), start_thread=False)
    policy = DecodePolicyConfig(name="dual-cache")
    jobs = []
    for seed, case in enumerate(POLICY_CASES[:3]):
        built = replace(static_decode(m, case, seed), cache_policy=make_policy(policy))
        job = DecodeRequest(
            f"r{seed}",
            lambda b=built: b,  # type: ignore[misc]
            threading.Event(),
            stream_partials=False,
            kv_tokens=built.static.num_tokens,
            cache_tokens=cache_slots(len(built.query), case.gen),
        )
        jobs.append(sched.submit(job))
    sched.run_once()
    assert all(isinstance(j.session, PolicyBatchSession) for j in jobs) and sched.rounds == 1
    while sched.active:
        sched.run_once()
    for seed, (job, case) in enumerate(zip(jobs, POLICY_CASES[:3], strict=True)):
        final = job.events.get_nowait()
        assert isinstance(final, Final) and job.events.empty()
        assert final.result.raw_tokens == reference(m, case, seed, policy)[0]
        assert final.result.cache["policy"] == "dual-cache"
    assert pool.num_free == pool.num_pages  # the cache pages went back too


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("kind", ["eager", "padded"])
@pytest.mark.parametrize(
    "knobs", [{}, {"delay_steps": 0, "retention": 0.3}, {"pool_kernel": 1, "refresh_steps": 3}]
)
def test_sparse_dllm_sessions_in_rounds_equal_the_reference_loop(family: str, kind: str, knobs: dict) -> None:
    m = model(family)
    policy = DecodePolicyConfig(name="sparse-dllm", **knobs)
    want = [reference(m, case, seed, policy) for seed, case in enumerate(POLICY_CASES)]
    pool = pool_for(m, pages=128)
    forward = round_forward(kind, m, pool)
    sessions = [policy_session(m, pool, case, seed, policy) for seed, case in enumerate(POLICY_CASES)]
    dual = policy_session(m, pool, POLICY_CASES[1], 9, DecodePolicyConfig(name="dual-cache"))
    run_rounds(forward, [sessions[0], dual, *sessions[1:]])
    assert (
        dual.state.tokens.tolist()
        == reference(m, POLICY_CASES[1], 9, DecodePolicyConfig(name="dual-cache"))[0]
    )
    for s, (tokens, cache), case in zip(sessions, want, POLICY_CASES, strict=True):
        result = s.result()
        assert result.raw_tokens == tokens, case
        assert result.cache == cache, case


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_vanilla_sparse_session_in_rounds_evicts_the_prompt_as_the_reference(family: str) -> None:
    """A session without static KV (the whole prompt as its query: vanilla) protects no row from Sparse-dLLM's
    eviction, as ``generate_vanilla``'s loop; only pdllm's question is protected."""
    from tests.engine.helpers import tokens
    from tests.reference.vanilla import generate_vanilla

    m = model(family, seed=1)
    prompt = tokens(14, 5)
    gen = GenerationConfig(gen_length=8, steps=8, block_length=4)
    policy = DecodePolicyConfig(name="sparse-dllm", retention=0.3)
    want = generate_vanilla(m, prompt, gen, policy=policy)
    pool = pool_for(m, pages=32)
    pages = pool.reserve(cache_slots(len(prompt), gen))
    assert pages is not None
    cache_policy = make_policy(policy)
    assert cache_policy is not None
    s = PolicyBatchSession.start_policy(m, prompt, 0, 0, pages, gen, cache_policy, pool.page_size)
    run_rounds(EagerRoundForward(m, pool, "torch"), [s])
    assert s.result().raw_tokens == want.raw_tokens
    assert s.result().cache == want.cache


@pytest.mark.parametrize("retention", [0.2, 0.5])
def test_sparse_dllm_requests_reserve_pages_only_for_the_rows_they_keep(retention: float) -> None:
    """Through the scheduler (the servicer's and the engine's session maker): a Sparse-dLLM request reserves
    its static KV plus ``p + floor((N - b - p) r)`` cache slots, not one per local row, and still decodes as
    the reference loop. Planted: the maker reserving one slot per row -> the page counts differ."""
    from pdllm.decode_service.policies.sparse_dllm import SaliencyKeep, kept_count
    from pdllm.decode_service.sessions import SessionMaker

    m = model("dream")
    pool = pool_for(m, pages=128)
    sched = DecodeScheduler(m, pool, EagerRoundForward(m, pool, "torch"), start_thread=False)
    maker = SessionMaker(m)
    policy = DecodePolicyConfig(name="sparse-dllm", retention=retention)
    case = POLICY_CASES[1]
    built = static_decode(m, case, 1)
    q, n = len(built.query), len(built.query) + case.gen.gen_length
    slots = maker.pool_slots(policy, q, case.gen, static=True)
    assert slots == kept_count(n, SaliencyKeep(0, case.gen.block, retention, 3, q)) < n
    built = replace(built, cache_policy=make_policy(policy))
    req = sched.submit(
        DecodeRequest(
            "s", lambda: built, threading.Event(), False, built.static.num_tokens, cache_tokens=slots
        )
    )
    sched.run_once()
    assert len(req.pages) == pool.pages_for(built.static.num_tokens + slots)
    for _ in range(100):
        if not sched.active:
            break
        sched.run_once()
    final = req.events.get_nowait()
    assert isinstance(final, Final) and final.result.raw_tokens == reference(m, case, 1, policy)[0]
