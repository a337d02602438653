"""DyLLM (Dream / LLaDA) in the batched rounds (``decode_service/dyllm_rounds.py``): DyLLM sessions share
each round's one forward with plain, dual-cache, Sparse-dLLM and Polestar sessions (pdllm and vanilla,
arriving mid-block), and end with their reference loop's tokens and every DyLLM counter; the scheduler
steps them in its one forward too.

Planted by hand (failures here, mixed rounds / scheduler, of 4 / 1):
- the chosen rows compared with ``<=`` against 0.999 tau: 4 / 1;
- the approximate context without its ``A_t ΔV`` update (``C_{t-1}`` alone): 4 / 1;
- the K/V rows counted from the chosen rows instead of the incoming salient ones: 4 / 0;
- the salient-column update reading each request's salient column list one entry late: 4 / 1.

Through the Triton kernels (``dyllm_triton_case.py``, under the interpreter), planted: the salient-column
update's weights without the log-sum-exp rescale -> the case fails.

The update's normalizer is the round attention's row log-sum-exp (``PagedBatchAttention.lse``); planted:
that LSE over the static pages only (the rows' own keys left out, torch path) -> the mixed rounds, the
scheduler and the LSE test fail; stored in base 2 (the split-S kernel's one-split store) -> the Triton case
fails; the update called with ``lse=None`` (back to its K-only pass) -> the LSE test fails.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pdllm.decode_service.dyllm_rounds import DyLLMBatchSession
from pdllm.decode_service.kv_pool import DecodeKVPool
from pdllm.decode_service.policies import DecodePolicyConfig
from pdllm.decode_service.policy_rounds import batch_session, cache_slots
from pdllm.decode_service.request import DecodeRequest, Final, StaticDecode, Status
from pdllm.decode_service.rounds import BatchSession, decode_round
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
from tests.interpreter import run_under_interpreter
from tests.model.helpers import tiny_model
from tests.reference.compute_skip import run_compute_skip
from tests.reference.static_kv import static_compute_skip_logits
from tests.reference.vanilla import generate_vanilla

KNOBS = [
    {"dyllm_threshold": 0.99, "dyllm_full_steps": 2, "dyllm_full_sequence_interval": 3},
    {"dyllm_threshold": 0.9, "dyllm_full_steps": 1, "dyllm_full_sequence_interval": 2},
    {"dyllm_threshold": 0.98, "dyllm_full_steps": 2, "dyllm_approximate_attention": "off"},
]
PROMPT = [1, 17, 33, 8, 61, 5, 40, 22, 9, 70]
VANILLA_GEN = GenerationConfig(gen_length=16, steps=16, block_length=8, stop_at_eos=False)


def _dyllm(knobs: dict) -> DecodePolicyConfig:
    return DecodePolicyConfig("dyllm", dyllm=knobs)


def dyllm_reference(m: DiffusionLM, case: Case, seed: int, knobs: dict) -> tuple[list[int], dict]:
    """A pdllm request's DyLLM loop over its static KV (segmented attention, no scheduler)."""
    engine, sel = prefill(m, case, seed)
    static = engine.build(sel, case.gen)
    logits = static_compute_skip_logits(m, sel.request.query, static, case.gen, _dyllm(knobs), "segments")
    result = run_compute_skip(logits)
    return result.raw_tokens, dict(result.cache)


def dyllm_built(m: DiffusionLM, case: Case, seed: int, knobs: dict) -> StaticDecode:
    return replace(static_decode(m, case, seed), cache_policy=rounds_policy(_dyllm(knobs)))


def dyllm_session(pool: DecodeKVPool, m: DiffusionLM, built: StaticDecode) -> BatchSession:
    pages = pool.reserve(built.kv_tokens + cache_slots(len(built.query), built.gen))
    assert pages is not None
    if built.static is not None:
        pool.write(pages, built.static.tensor())
    s = batch_session(m, built, pages, pool.page_size)
    assert isinstance(s, DyLLMBatchSession)
    return s


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("kind", ["eager", "padded"])
def test_dyllm_sessions_share_mixed_rounds_and_equal_their_references(family: str, kind: str) -> None:
    m = tiny_model(family, seed=0, num_layers=4)
    pool = pool_for(m, pages=256)
    forward = round_forward(kind, m, pool)
    cases = [(POLICY_CASES[0], 0, KNOBS[0]), (POLICY_CASES[3], 3, KNOBS[1]), (POLICY_CASES[1], 1, KNOBS[2])]
    want = [dyllm_reference(m, case, seed, knobs) for case, seed, knobs in cases]
    vanilla = generate_vanilla(m, PROMPT, VANILLA_GEN, policy=_dyllm(KNOBS[1]))
    want.append((vanilla.raw_tokens, dict(vanilla.cache)))
    dyllm = [dyllm_session(pool, m, dyllm_built(m, c, seed, knobs)) for c, seed, knobs in cases]
    built = StaticDecode(list(PROMPT), None, VANILLA_GEN, cache_policy=rounds_policy(_dyllm(KNOBS[1])))
    dyllm.append(dyllm_session(pool, m, built))
    # Others in the same rounds: plain (device sampler), dual cache, Sparse-dLLM, Polestar-Cache.
    plain = session(m, pool, CASES[1], 7)
    policies = [DecodePolicyConfig(n) for n in ("dual-cache", "sparse-dllm", "polestar")]
    others = [policy_session(m, pool, POLICY_CASES[4], 4, p) for p in policies]
    order = [dyllm[0], plain, others[0], dyllm[1], others[1], dyllm[3], others[2], dyllm[2]]
    assert rounds_with_arrivals(m, forward, order, DyLLMBatchSession) > 10
    for s, (tokens, cache) in zip(dyllm, want, strict=True):
        result = s.result()
        assert result.raw_tokens == tokens and result.steps == s.state.steps_taken
        assert result.cache == cache  # every DyLLM counter
    assert plain.state.tokens.tolist() == alone(m, CASES[1], 7)
    for s, p in zip(others, policies, strict=True):
        assert s.result().raw_tokens == reference(m, POLICY_CASES[4], 4, p)[0]


def update_normalizer(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    q_offsets: torch.Tensor,
    k_local: torch.Tensor,
) -> torch.Tensor:
    """``[n, Hq]`` float64: the normalizer of ``A_t`` by the salient update's own definition, from its
    arguments: ``logsumexp(q·k / sqrt(D))`` over each request's paged slots below ``kv_len``, then its
    own rows' keys (``k_local``), slot by slot through the page table."""
    hq, d = q.shape[1], q.shape[2]
    hkv, page = k_pages.shape[1], k_pages.shape[2]
    out = torch.empty(q.shape[:2], dtype=torch.float64)
    offs = q_offsets.tolist()
    for b, n in enumerate(kv_lens.tolist()):
        q0, q1 = offs[b], offs[b + 1]
        paged = [k_pages[int(page_table[b, j // page]), :, j % page] for j in range(n)]  # [Hkv, D] each
        keys = torch.stack(paged + list(k_local[q0:q1])).double().repeat_interleave(hq // hkv, 1)
        out[q0:q1] = torch.logsumexp(torch.einsum("thd,lhd->thl", q[q0:q1].double(), keys) / d**0.5, -1)
    return out


def spy_on_lse(update: Callable[..., torch.Tensor], given: list[int]) -> Callable[..., torch.Tensor]:
    """``update`` checked on every call: given the attention's ``lse``, equal to :func:`update_normalizer`."""

    def spy(*args: torch.Tensor, lse: torch.Tensor | None = None, **kw: object) -> torch.Tensor:
        assert lse is not None, "the salient update was left to its K-only pass"
        torch.testing.assert_close(lse.double(), update_normalizer(*args[:6]), rtol=1e-5, atol=1e-5)
        given.append(lse.shape[0])
        return update(*args, lse=lse, **kw)

    return spy


def test_the_salient_update_takes_the_attentions_log_sum_exp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every approximate update in the torch rounds is handed the attention's row LSE (no K-only pass),
    equal to the normalizer over the keys ``A_t`` spans (static KV and cached rows before the queried ones,
    then the queried rows' keys as ``before`` left them), and the sessions still end as their references."""
    from pdllm.decode_service import dyllm_rounds

    given: list[int] = []
    spy = spy_on_lse(dyllm_rounds.salient_attention_reference, given)
    monkeypatch.setattr(dyllm_rounds, "salient_attention_reference", spy)
    m = tiny_model("dream", seed=0, num_layers=4)
    pool = pool_for(m, pages=128)
    forward = round_forward("eager", m, pool)
    want = [
        dyllm_reference(m, POLICY_CASES[3], 3, KNOBS[1]),
        dyllm_reference(m, POLICY_CASES[0], 0, KNOBS[0]),
    ]
    sessions = [dyllm_session(pool, m, dyllm_built(m, POLICY_CASES[3], 3, KNOBS[1])),
                dyllm_session(pool, m, dyllm_built(m, POLICY_CASES[0], 0, KNOBS[0]))]  # fmt: skip
    active = [*sessions, session(m, pool, CASES[1], 7)]
    while active:
        decode_round(forward, active)
        active = [s for s in active if not s.done]
    assert len(given) > 4
    for s, (tokens, cache) in zip(sessions, want, strict=True):
        assert (s.result().raw_tokens, s.result().cache) == (tokens, cache)


def test_triton_dyllm_rounds_equal_their_references_under_interpreter() -> None:
    run_under_interpreter(Path(__file__).with_name("dyllm_triton_case.py"), timeout_s=300)


def test_the_scheduler_steps_dyllm_requests_in_its_one_forward_per_iteration() -> None:
    """Requests under DyLLM, none and the dual cache, arriving while others decode, all advance in one
    model forward per iteration (``rounds`` counts them) and answer as their references."""
    m = tiny_model("dream", seed=2, num_layers=4)
    pool = pool_for(m, pages=128)
    sched = DecodeScheduler(m, pool, round_forward("eager", m, pool), start_thread=False)
    dual = DecodePolicyConfig("dual-cache")

    def job(name: str, built: StaticDecode, slots: int) -> DecodeRequest:
        return DecodeRequest(
            name, lambda: built, threading.Event(), False, built.kv_tokens, cache_tokens=slots
        )

    dual_built = replace(static_decode(m, POLICY_CASES[0], 0), cache_policy=rounds_policy(dual))
    late = dyllm_built(m, POLICY_CASES[3], 3, KNOBS[1])
    early = dyllm_built(m, POLICY_CASES[1], 1, KNOBS[0])
    vanilla = StaticDecode(PROMPT, None, VANILLA_GEN, cache_policy=rounds_policy(_dyllm(KNOBS[0])))
    jobs = [
        job("dyllm-pdllm", early, cache_slots(len(early.query), early.gen)),
        job("vanilla", vanilla, cache_slots(len(PROMPT), VANILLA_GEN)),
        job("plain", static_decode(m, CASES[3], 3), 0),
        job("dual", dual_built, cache_slots(len(dual_built.query), POLICY_CASES[0].gen)),
        job("dyllm-late", late, cache_slots(len(late.query), late.gen)),
    ]
    schedule_arrivals(m, sched, dict(zip((0, 2, 3, 5, 7), jobs, strict=True)))  # mid-block arrivals
    results = {}
    for j in jobs:
        finals = []
        while not j.events.empty():
            event = j.events.get_nowait()
            if isinstance(event, Final):
                finals.append(event)
        assert len(finals) == 1, j.request_id
        results[j.request_id] = finals[0].result.raw_tokens
    assert results["dyllm-pdllm"] == dyllm_reference(m, POLICY_CASES[1], 1, KNOBS[0])[0]
    assert results["dyllm-late"] == dyllm_reference(m, POLICY_CASES[3], 3, KNOBS[1])[0]
    assert results["vanilla"] == generate_vanilla(m, PROMPT, VANILLA_GEN, policy=_dyllm(KNOBS[0])).raw_tokens
    assert results["plain"] == alone(m, CASES[3], 3)
    assert results["dual"] == reference(m, POLICY_CASES[0], 0, dual)[0]


def test_a_session_that_cannot_start_fails_its_request_and_the_others_go_on() -> None:
    """A DyLLM request given no pages for its rows' K/V (its session refuses to start) gets that error;
    its pages go back and a plain request beside it still answers. Planted: the session started outside a
    try -> ``run_once`` raises and the request stays BUILDING forever."""
    m = tiny_model("dream", seed=2, num_layers=4)
    pool = pool_for(m, pages=64)
    sched = DecodeScheduler(m, pool, round_forward("eager", m, pool), start_thread=False)
    long = GenerationConfig(gen_length=32, steps=32, block_length=8)  # more rows than a page's slack
    bad = replace(dyllm_built(m, POLICY_CASES[1], 1, KNOBS[0]), gen=long)
    plain = static_decode(m, CASES[3], 3)
    jobs = [
        DecodeRequest("bad", lambda: bad, threading.Event(), False, bad.kv_tokens, cache_tokens=0),
        DecodeRequest("plain", lambda: plain, threading.Event(), False, plain.kv_tokens, cache_tokens=0),
    ]
    free = pool.num_free
    for j in jobs:
        sched.submit(j)
    for _ in range(64):
        if not sched.depth:
            break
        sched.run_once()
    assert not sched.depth
    events = {j.request_id: [j.events.get_nowait() for _ in range(j.events.qsize())] for j in jobs}
    assert [type(e) for e in events["bad"]] == [ValueError] and "pages" in str(events["bad"][0])
    assert jobs[0].status is Status.FAILED and pool.num_free == free
    finals = [e for e in events["plain"] if isinstance(e, Final)]
    assert len(finals) == 1 and finals[0].result.raw_tokens == alone(m, CASES[3], 3)
