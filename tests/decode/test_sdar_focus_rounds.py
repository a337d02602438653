"""FOCUS on SDAR in the batched rounds (``decode_service/sdar_focus_rounds.py``): SDAR FOCUS sessions share
each round's one forward with plain SDAR sessions, arriving mid-block, and end with their reference's
(``generate_focus_block_diffusion``) tokens and every FOCUS counter; the plain ones with
``generate_block_diffusion``'s. Windows of one, two and three model blocks (4 positions each), prompts
ending mid model block and on a block boundary, pages of 4, 8 and 16 slots (a model block starting at a
page boundary or inside a page). The scheduler runs them in one round per iteration. Two of
them run through the split-S kernel under the Triton interpreter too (``triton_rounds_case.py``). Their
references are the reference loops (the from-scratch oracle is ``tests/oracles/focus_sdar.py``).

Planted by hand (failures here, of 5; in ``tests/decode/test_sdar_decode_worker.py``'s FOCUS cases, of 3;
in ``tests/engine/test_sdar_pdllm.py``, of the 16 tests ``-k focus`` selects):
- an entry seeing a later model block's rows (its hidden rows at layers >= 2 taken up to the reach, across
  its block's end): 5 / 1 / 0;
- a non-forwarded row's K/V counted twice (the selected rows copied into the region too): 5 / 0 / 7;
- the tail of the page a model block starts in not copied into its region (slots ``[P * page, s)`` read
  stale): 4 / 2 / 4;
- the frozen rows not copied into the region at layers 0-1: 5 / 2 / 0."""

from __future__ import annotations

import threading

import pytest
import torch

from pdllm.decode_service.block_rounds import BlockBatchSession, block_slots, start_block_decode
from pdllm.decode_service.policies import DecodePolicyConfig
from pdllm.decode_service.policy_rounds import batch_session
from pdllm.decode_service.request import DecodeRequest, Final
from pdllm.decode_service.scheduler import DecodeScheduler
from pdllm.decode_service.sdar_focus_rounds import SdarFocusSession, sdar_focus_slots
from pdllm.shared.generation.sampler import GenerationConfig
from tests.decode.helpers import pool_for, round_forward, rounds_with_arrivals
from tests.model.helpers import tiny_model
from tests.oracles.cases import ids
from tests.reference.block_diffusion import generate_block_diffusion
from tests.reference.focus import generate_focus_block_diffusion

# (prompt length, gen_length, steps, block_length, threshold, temperature, focus knobs)
FOCUS = [
    (9, 16, 16, 8, None, 0.0, {}),
    (16, 12, 12, 12, None, 0.0, {"focus_budget": 2}),
    (13, 16, 8, 8, None, 0.0, {"focus_alpha": 1.2, "focus_pool_kernel": 5, "focus_delayed_cache": "off"}),
    (22, 16, 16, 8, 0.2, 0.0, {}),
    (7, 12, 12, 12, None, 0.7, {"focus_budget": 1}),
]
PLAIN = [(10, 8, 8, 8, None, 0.0), (5, 12, 12, 4, None, 0.0)]


def _gen(n: int, steps: int, block: int, threshold: float | None, temperature: float) -> GenerationConfig:
    return GenerationConfig(
        gen_length=n, steps=steps, block_length=block, threshold=threshold, temperature=temperature,
        stop_at_eos=False, seed=n + steps,
    )  # fmt: skip


def _session(m, pool, prompt: list[int], g: GenerationConfig, knobs: dict | None):  # type: ignore[no-untyped-def]
    focus = None if knobs is None else DecodePolicyConfig("focus", focus=knobs).focus_config()
    made = start_block_decode(m, torch.tensor(prompt), g, focus=focus)
    slots = block_slots(len(prompt), g)
    if focus is not None:
        slots = sdar_focus_slots(slots, g, m.config.block_size, pool.page_size)
    pages = pool.reserve(slots)
    assert pages is not None
    if made.static is not None:
        pool.write(pages, made.static.tensor())
    return batch_session(m, made, pages, pool.page_size)


@pytest.mark.parametrize(("kind", "page_size"), [("eager", 4), ("eager", 8), ("eager", 16), ("padded", 8)])
def test_sdar_focus_sessions_share_mixed_rounds_and_equal_their_references(kind: str, page_size: int) -> None:
    m = tiny_model("sdar", seed=1, num_layers=4)
    pool = pool_for(m, pages=2048 // page_size, page_size=page_size)
    forward = round_forward(kind, m, pool)
    prompts = [ids(p, 30 + i) for i, (p, *_) in enumerate(FOCUS)]
    plain_prompts = [ids(p, 60 + i) for i, (p, *_) in enumerate(PLAIN)]
    want = []
    for prompt, (_, *g, knobs) in zip(prompts, FOCUS, strict=True):
        focus = DecodePolicyConfig("focus", focus=knobs).focus_config()
        want.append(generate_focus_block_diffusion(m, torch.tensor(prompt), _gen(*g), focus))
    plain_want = [
        generate_block_diffusion(m, torch.tensor(p), _gen(*g))
        for p, (_, *g) in zip(plain_prompts, PLAIN, strict=True)
    ]
    focus = [_session(m, pool, p, _gen(*g), k) for p, (_, *g, k) in zip(prompts, FOCUS, strict=True)]
    plain = [_session(m, pool, p, _gen(*g), None) for p, (_, *g) in zip(plain_prompts, PLAIN, strict=True)]
    assert all(isinstance(s, SdarFocusSession) for s in focus)
    assert all(type(s) is BlockBatchSession for s in plain)
    order = [focus[0], plain[0], focus[1], focus[2], plain[1], focus[3], focus[4]]
    # one model forward per round, records included
    assert rounds_with_arrivals(m, forward, order, SdarFocusSession, others=2) > 10
    for s, ref in zip(focus, want, strict=True):
        result = s.result()
        assert result.raw_tokens == ref.raw_tokens and result.steps == ref.steps
        assert result.cache == ref.cache  # every FOCUS counter
    assert sum(r.cache["rows_plain"] - r.cache["rows_forwarded"] for r in want) > 0  # rows evicted
    assert sum(r.cache["frozen"] for r in want) > 0  # frozen rows read from their slots
    for s, ref in zip(plain, plain_want, strict=True):
        assert s.result().raw_tokens == ref.raw_tokens


def test_the_scheduler_steps_sdar_focus_and_plain_requests_in_one_round_per_iteration() -> None:
    m = tiny_model("sdar", seed=2, num_layers=4)
    pool = pool_for(m, pages=256, page_size=8)
    sched = DecodeScheduler(m, pool, round_forward("eager", m, pool), start_thread=False)
    specs = [(FOCUS[0], 0), (PLAIN[0], 1), (FOCUS[2], 2), (FOCUS[1], 3)]
    jobs, want = [], []
    for spec, seed in specs:
        p, *g = spec[:6]
        knobs = spec[6] if len(spec) > 6 else None
        prompt, gen = ids(p, 80 + seed), _gen(*g)
        focus = None if knobs is None else DecodePolicyConfig("focus", focus=knobs).focus_config()
        slots = block_slots(p, gen)
        if focus is not None:
            slots = sdar_focus_slots(slots, gen, m.config.block_size, pool.page_size)
            want.append(generate_focus_block_diffusion(m, torch.tensor(prompt), gen, focus))
        else:
            want.append(generate_block_diffusion(m, torch.tensor(prompt), gen))
        start = lambda prompt=prompt, gen=gen, focus=focus: start_block_decode(  # noqa: E731
            m, torch.tensor(prompt), gen, focus=focus
        )
        jobs.append(DecodeRequest(f"r{seed}", start, threading.Event(), False, cache_tokens=slots))
    arrivals = dict(zip((0, 1, 3, 6), jobs, strict=True))
    iteration = 0
    while iteration <= max(arrivals) or sched.depth:
        if iteration in arrivals:
            sched.submit(arrivals[iteration])
        rounds = sched.rounds
        sched.run_once()
        iteration += 1
        assert sched.rounds - rounds <= 1  # every running request in the iteration's one round
    for job, ref in zip(jobs, want, strict=True):
        (final,) = [e for e in list(job.events.queue) if isinstance(e, Final)]
        assert final.result.raw_tokens == ref.raw_tokens, job.request_id
        if ref.cache:
            assert final.result.cache == ref.cache, job.request_id
    assert pool.num_free == pool.num_pages
