"""FOCUS (Dream / LLaDA) in the batched rounds (``decode_service/focus_rounds.py``): FOCUS sessions share
each round's one forward with plain, dual-cache, Sparse-dLLM and Polestar sessions (pdllm and vanilla,
arriving mid-block), in process and through the servicer, and end with their reference loop's tokens and
every FOCUS counter.

Planted by hand (failures here: mixed rounds / scheduler / servicer tests, of 4 / 1 / 2; and in
``tests/oracles/test_focus.py``, vanilla in the rounds / pdllm, of 24 / 4):
- a block row both forwarded and in the key region at layers >= 2 (every row below ``reach`` copied in):
  4 / 1 / 2, 18 / 4;
- the region one slot short at layers >= 2 (``kv_len`` - 1): 4 / 1 / 0, 13 / 1; one slot long: 4 / 1 / 2,
  16 / 1;
- frozen rows forwarded at layers 0-1 (``active``: every block row): 4 / 1 / 2, 17 / 4;
- the frozen rows not copied into the region at layers 0-1: 4 / 1 / 2, 17 / 4;
- the LM head over every masked row (evicted ones' dropped rows read): 2 / 0 / 1, 12 / 1."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from pdllm.decode_service.focus_rounds import FocusBatchSession, focus_slots
from pdllm.decode_service.kv_pool import DecodeKVPool
from pdllm.decode_service.policies import DecodePolicyConfig
from pdllm.decode_service.policy_rounds import batch_session, cache_slots
from pdllm.decode_service.request import DecodeRequest, Final, StaticDecode
from pdllm.decode_service.rounds import BatchSession
from pdllm.decode_service.scheduler import DecodeScheduler
from pdllm.decode_service.sessions import rounds_policy
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.model.transformer import DiffusionLM
from tests.decode.helpers import (
    CASES,
    POLICY_CASES,
    Case,
    alone,
    policy_session,
    pool_for,
    prefill,
    reference,
    round_forward,
    rounds_with_arrivals,
    schedule_arrivals,
    session,
    static_decode,
)
from tests.model.helpers import tiny_model
from tests.reference.compute_skip import run_compute_skip
from tests.reference.static_kv import static_compute_skip_logits
from tests.reference.vanilla import generate_vanilla

FOCUS_KNOBS = [
    {},  # the paper's
    {"focus_budget": 2},
    {"focus_alpha": 1.2, "focus_pool_kernel": 5, "focus_delayed_cache": "off"},
]
PROMPTS = [[1, 17, 33, 8, 61, 5, 40, 22, 9, 70], [1, 5, 6, 7, 8, 9, 10]]
VANILLA_GENS = [
    GenerationConfig(gen_length=16, steps=16, block_length=8, stop_at_eos=False),
    GenerationConfig(gen_length=12, steps=12, block_length=4, threshold=0.15, stop_at_eos=False),
]


def _focus(knobs: dict) -> DecodePolicyConfig:
    return DecodePolicyConfig("focus", focus=knobs)


def focus_reference(m: DiffusionLM, case: Case, seed: int, knobs: dict) -> tuple[list[int], dict]:
    """A pdllm request's FOCUS reference loop over its static KV (segmented attention, no scheduler)."""
    engine, sel = prefill(m, case, seed)
    static = engine.build(sel, case.gen)
    logits = static_compute_skip_logits(m, sel.request.query, static, case.gen, _focus(knobs), "segments")
    result = run_compute_skip(logits)
    return result.raw_tokens, dict(result.cache)


def vanilla_reference(m: DiffusionLM, prompt: list[int], gen: GenerationConfig, knobs: dict) -> tuple:
    result = generate_vanilla(m, prompt, gen, policy=_focus(knobs))
    return result.raw_tokens, dict(result.cache)


def focus_built(m: DiffusionLM, case: Case, seed: int, knobs: dict) -> StaticDecode:
    return replace(static_decode(m, case, seed), cache_policy=rounds_policy(_focus(knobs)))


def vanilla_built(prompt: list[int], gen: GenerationConfig, knobs: dict) -> StaticDecode:
    return StaticDecode(list(prompt), None, gen, cache_policy=rounds_policy(_focus(knobs)))


def focus_session(pool: DecodeKVPool, m: DiffusionLM, built: StaticDecode) -> BatchSession:
    pages = pool.reserve(built.kv_tokens + focus_slots(built.gen))
    assert pages is not None
    if built.static is not None:
        pool.write(pages, built.static.tensor())
    s = batch_session(m, built, pages, pool.page_size)
    assert isinstance(s, FocusBatchSession)
    return s


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("kind", ["eager", "padded"])
def test_focus_sessions_share_mixed_rounds_and_equal_their_references(family: str, kind: str) -> None:
    m = tiny_model(family, seed=0, num_layers=4)
    pool = pool_for(m, pages=256)
    forward = round_forward(kind, m, pool)
    focus_cases = [(POLICY_CASES[0], 0, FOCUS_KNOBS[0]), (POLICY_CASES[2], 2, FOCUS_KNOBS[1])]
    focus_cases.append((POLICY_CASES[3], 3, FOCUS_KNOBS[2]))
    want = [focus_reference(m, case, seed, knobs) for case, seed, knobs in focus_cases]
    want += [
        vanilla_reference(m, p, g, FOCUS_KNOBS[i]) for i, (p, g) in enumerate(zip(PROMPTS, VANILLA_GENS))
    ]
    focus = [focus_session(pool, m, focus_built(m, c, seed, knobs)) for c, seed, knobs in focus_cases]
    for i, (p, g) in enumerate(zip(PROMPTS, VANILLA_GENS, strict=True)):
        focus.append(focus_session(pool, m, vanilla_built(p, g, FOCUS_KNOBS[i])))
    # Others in the same rounds: plain (device sampler), dual cache, Sparse-dLLM, Polestar-Cache.
    plain = session(m, pool, CASES[1], 7)
    policies = [DecodePolicyConfig(n) for n in ("dual-cache", "sparse-dllm", "polestar")]
    others = [policy_session(m, pool, POLICY_CASES[4], 4, p) for p in policies]
    order = [focus[0], plain, others[0], focus[1], focus[3], others[1], focus[2], others[2], focus[4]]
    assert rounds_with_arrivals(m, forward, order, FocusBatchSession) > 10
    for s, (tokens, cache) in zip(focus, want, strict=True):
        result = s.result()
        assert result.raw_tokens == tokens and result.steps == s.state.steps_taken
        assert result.cache == cache  # every FOCUS counter
    assert sum(cache["rows_plain"] - cache["rows_forwarded"] for _, cache in want) > 0  # rows evicted
    assert plain.state.tokens.tolist() == alone(m, CASES[1], 7)
    for s, p in zip(others, policies, strict=True):
        assert s.result().raw_tokens == reference(m, POLICY_CASES[4], 4, p)[0]


def test_the_scheduler_steps_focus_requests_in_its_one_forward_per_iteration() -> None:
    """Requests under FOCUS, none and the dual cache, arriving while others decode, all advance in one
    model forward per iteration (``rounds`` counts them) and answer as their references."""
    m = tiny_model("dream", seed=2, num_layers=4)
    pool = pool_for(m, pages=128)
    sched = DecodeScheduler(m, pool, round_forward("eager", m, pool), start_thread=False)
    gen = VANILLA_GENS[0]
    dual = DecodePolicyConfig("dual-cache")

    def job(name: str, built: StaticDecode, slots: int) -> DecodeRequest:
        return DecodeRequest(
            name, lambda: built, threading.Event(), False, built.kv_tokens, cache_tokens=slots
        )

    dual_built = replace(static_decode(m, POLICY_CASES[0], 0), cache_policy=rounds_policy(dual))
    jobs = [
        job("focus-pdllm", focus_built(m, POLICY_CASES[1], 1, {}), focus_slots(POLICY_CASES[1].gen)),
        job("vanilla", StaticDecode(PROMPTS[0], None, gen, cache_policy=rounds_policy(_focus({}))), 16),
        job("plain", static_decode(m, CASES[3], 3), 0),
        job("dual", dual_built, cache_slots(len(dual_built.query), POLICY_CASES[0].gen)),
        job(
            "focus-late", focus_built(m, POLICY_CASES[3], 3, FOCUS_KNOBS[1]), focus_slots(POLICY_CASES[3].gen)
        ),
    ]
    schedule_arrivals(m, sched, dict(zip((0, 2, 3, 5, 7), jobs, strict=True)))  # mid-block arrivals
    want = [
        focus_reference(m, POLICY_CASES[1], 1, {}),
        vanilla_reference(m, PROMPTS[0], gen, {}),
        (alone(m, CASES[3], 3), {}),
        reference(m, POLICY_CASES[0], 0, dual),
        focus_reference(m, POLICY_CASES[3], 3, FOCUS_KNOBS[1]),
    ]
    for j, (tokens, cache) in zip(jobs, want, strict=True):
        final = j.events.get_nowait()
        assert isinstance(final, Final), j.request_id
        assert final.result.raw_tokens == tokens, j.request_id
        if cache.get("policy") == "focus":
            assert final.result.cache == cache, j.request_id
    assert pool.num_free == pool.num_pages  # the FOCUS sessions' block K/V pages went back too


def test_short_page_lists_are_refused() -> None:
    m = tiny_model("llada", num_layers=4)
    pool = pool_for(m, pages=8, page_size=4)
    built = StaticDecode(PROMPTS[1], None, VANILLA_GENS[0], cache_policy=rounds_policy(_focus({})))
    with pytest.raises(ValueError, match="needs 4 pages"):
        FocusBatchSession.begin(m, built, pool.reserve(8), pool.page_size)  # type: ignore[arg-type]


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_focus_requests_over_grpc_share_rounds_and_equal_their_references(family: str) -> None:
    """Through the servicer (``DecodeServicer.Decode``, its scheduler thread): pdllm and vanilla FOCUS
    requests decoded concurrently with a plain and a dual-cache one share rounds (FOCUS's rows with the
    others' in one forward), and each answers as its reference loop, FOCUS's counters in the trace."""
    from pdllm.decode_service.rounds import EagerRoundForward
    from pdllm.decode_service.server import DecodeServicer
    from pdllm.decode_service.worker import DecodeWorker
    from pdllm.shared.layout import Request
    from tests.decode.test_sdar_decode_worker import _decode, _generation, _pdllm_request
    from tests.engine.helpers import tokens
    from tests.reference.static_kv import static_compute_skip_logits as focus_logits

    m = tiny_model(family, seed=3, num_layers=4)
    pool = pool_for(m, pages=64)
    eager = EagerRoundForward(m, pool, "torch")
    rounds: list[tuple[int, bool]] = []  # (sessions, some FOCUS) per round

    def forward(packed):  # type: ignore[no-untyped-def]
        rounds.append((len(packed.counts), packed.splits))
        return eager(packed)

    scheduler = DecodeScheduler(m, pool, forward, start_thread=False)
    worker = DecodeWorker(m)
    servicer = DecodeServicer(worker, scheduler)
    instruction, query = tokens(3, 1), tokens(5, 2)
    chunks = [tokens(12, 3), tokens(9, 4)]
    context = tokens(20, 5)
    gens = [VANILLA_GENS[0], GenerationConfig(gen_length=12, steps=6, block_length=6, stop_at_eos=False)]
    knobs = [{}, FOCUS_KNOBS[2], {}, {}]
    asks = []
    for i, name in enumerate(["focus", "focus", "none", "dual-cache"]):
        gen = gens[i % 2]
        if i == 1:
            request = _generation(gen)
            request.method.method = "vanilla"
            request.instruction_ids.extend(instruction)
            request.context_ids.extend(context)
            request.question_ids.extend(query)
        else:
            request = _pdllm_request(instruction, chunks, query, gen)
        request.request_id = f"r{i}"
        request.decode_policy.decode_policy = name
        for key, value in knobs[i].items():
            setattr(request.decode_policy, key, value)
        asks.append(request)
    with ThreadPoolExecutor(len(asks)) as threads:
        calls = [threads.submit(_decode, servicer, r) for r in asks]
        deadline = time.monotonic() + 30
        while scheduler.depth < len(asks) and time.monotonic() < deadline:  # every request submitted
            time.sleep(0.01)
        while scheduler.depth:  # this thread drives the scheduler: the rounds do not depend on timing
            scheduler.run_once()
        finals = [c.result(timeout=30)[0] for c in calls]
    assert rounds[0] == (4, True) and len(rounds) == 16  # all four in one forward per iteration
    request = Request(instruction=instruction, chunks=chunks, query=query)
    static = worker.build_selected(request, [0, 1], gens[0])
    want = run_compute_skip(focus_logits(m, query, static, gens[0], _focus({}), "segments"))
    assert list(finals[0].token_ids) == want.token_ids
    assert _trace(finals[0]) == _nonzero(want.cache)
    prompt = [m.config.bos_token_id, *instruction, *context, *query]
    vanilla = generate_vanilla(m, prompt, gens[1], policy=_focus(FOCUS_KNOBS[2]))
    assert list(finals[1].token_ids) == vanilla.token_ids
    assert _trace(finals[1]) == _nonzero(vanilla.cache)
    plain = worker.decode(query, worker.build_selected(request, [0, 1], gens[0]), gens[0])
    assert list(finals[2].token_ids) == plain.token_ids


def _nonzero(cache: dict) -> dict:
    return {k: v for k, v in cache.items() if v}


def _trace(final) -> dict:  # type: ignore[no-untyped-def]
    """A result's ``decode_policy`` trace as one dict like ``GenerationResult.cache`` (nonzero values)."""
    p = final.decode_policy
    named = {f.name: getattr(p, f.name) for f in p.DESCRIPTOR.fields if f.name != "counters"}
    return _nonzero({**named, **dict(p.counters)})
