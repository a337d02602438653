"""FOCUS on SDAR (block diffusion) against the from-scratch oracle (``focus_sdar.py``: the cached prefix
recomputed every block, the window run layer by layer with explicit key sets): the decode worker's batched
rounds (``sdar_focus_rounds.py``, in-process vanilla), the reference session
(``generate_focus_block_diffusion``) and the pdllm engine over its selected prompt; tokens and every
counter equal. Prompts end mid model block (4 positions); generation blocks of one, two and three model
blocks; the fixed schedule and a confidence threshold.

Planted by hand (each reverted), failures of the 32 tests (15 vanilla rounds, 12 reference, 3 pdllm, 2 mixed
rounds):

- ``sdar_focus_rounds.py``: a model block's entry at layers >= 2 also sees the window's later model blocks'
  visible, unselected rows (``range(entry.a, s.reach)`` for ``range(entry.a, min(entry.b, s.reach))``)
  -> 6 fail (the 3-model-block windows' tokens; the mixed rounds: its region overflows);
- ``sdar_focus_rounds.py``: the frozen rows not copied into the entries' key regions at layers 0-1
  -> 14 fail (every case with the delayed cache on);
- ``sdar_focus_rounds.py``: the reach one short (``max(mem.reach, sel[-1])``) -> 3 fail;
- ``tests/reference/focus_layers.py`` (the reference's ``SdarRows``): the window bidirectional across its model
  blocks -> 9 fail (every reference case with windows of 2-3 model blocks);
- ``policies/focus.py``: no AR-context preservation (predecessors of the top K) -> 9 fail.
"""

from __future__ import annotations

import threading

import pytest
import torch

from pdllm.decode_service.block_rounds import block_slots, start_block_decode
from pdllm.decode_service.kv_pool import DecodeKVPool
from pdllm.decode_service.request import DecodeRequest, Final, Status
from pdllm.decode_service.rounds import EagerRoundForward
from pdllm.decode_service.scheduler import DecodeScheduler
from pdllm.decode_service.sdar_focus_rounds import sdar_focus_slots
from pdllm.decode_service.worker import DecodeWorker
from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.config import EngineConfig
from pdllm.shared.decode_policy import DecodePolicyConfig, FocusConfig
from tests.reference.focus import generate_focus_block_diffusion

from .block_diffusion import block_diffusion
from .cases import CHUNK, CONTEXT, INSTRUCTION, QUESTION, TOP_K, case_id, counters, gen, ids, model
from .focus_sdar import focus_sdar

# (alpha, pool kernel, fixed budget, delayed cache): the paper's defaults, a fixed budget, cache off.
KNOBS = [(1.5, 3, None, True), (1.5, 1, 2, True), (1.2, 5, None, False)]
# (prompt length, gen_length, steps, block_length, threshold): every prompt ends mid model block.
REQUESTS = [
    (9, 16, 16, 4, None),
    (13, 16, 16, 8, None),
    (7, 12, 12, 12, None),
    (22, 16, 16, 8, 0.2),
    (13, 16, 8, 8, None),
]


def _policy(alpha: float, kernel: int, budget: int | None, delayed: bool) -> DecodePolicyConfig:
    knobs = {
        "focus_alpha": alpha,
        "focus_pool_kernel": kernel,
        "focus_budget": budget,
        "focus_delayed_cache": "on" if delayed else "off",
    }
    return DecodePolicyConfig("focus", focus=knobs)


def _focus(alpha: float, kernel: int, budget: int | None, delayed: bool) -> FocusConfig:
    return FocusConfig(alpha=alpha, pool_kernel=kernel, budget=budget, delayed_cache=delayed)


@pytest.mark.parametrize("knobs", KNOBS, ids=case_id)
@pytest.mark.parametrize("request_", REQUESTS, ids=case_id)
def test_vanilla_in_the_rounds_matches_oracle(knobs: tuple, request_: tuple) -> None:
    n, *schedule = request_
    m, g, prompt = model("sdar", layers=4, seed=3), gen(*schedule), ids(n, 10 + n)
    tokens, expected = focus_sdar(m, prompt, g.gen_length, g.block, g.steps, g.threshold, *knobs)
    result = DecodeWorker(m).vanilla(prompt, g, _policy(*knobs))
    assert result.raw_tokens == tokens
    assert counters(result, expected) == expected


@pytest.mark.parametrize("knobs", KNOBS, ids=case_id)
@pytest.mark.parametrize("request_", REQUESTS[:4], ids=case_id)
def test_reference_session_matches_oracle(knobs: tuple, request_: tuple) -> None:
    n, *schedule = request_
    m, g, prompt = model("sdar", layers=3, seed=4), gen(*schedule), ids(n, 20 + n)
    tokens, expected = focus_sdar(m, prompt, g.gen_length, g.block, g.steps, g.threshold, *knobs)
    result = generate_focus_block_diffusion(m, torch.tensor(prompt), g, _focus(*knobs))
    assert result.raw_tokens == tokens
    assert counters(result, expected) == expected


@pytest.mark.parametrize(
    ("knobs", "schedule"),
    [(KNOBS[0], (16, 16, 8, None)), (KNOBS[1], (12, 12, 12, 0.2)), (KNOBS[2], (16, 16, 4, None))],
    ids=case_id,
)
def test_pdllm_matches_oracle(knobs: tuple, schedule: tuple) -> None:
    """The engine's SDAR decode under FOCUS (the rounds) over its selected prompt
    (``[instruction][BOS c_i]...[question]``, 35 tokens: mid model block), from its block-causal prefix."""
    m, g = model("sdar", layers=4, seed=5), gen(*schedule)
    engine = PrefillingEngine(m, None, EngineConfig(chunk_size=CHUNK, top_k=TOP_K))
    result, trace = engine.generate(CONTEXT, QUESTION, g, INSTRUCTION, decode_policy=_policy(*knobs))
    selected = list(INSTRUCTION)
    for i in trace.selected:
        selected += [m.config.bos_token_id, *CONTEXT[i * CHUNK : (i + 1) * CHUNK]]
    tokens, expected = focus_sdar(m, selected + QUESTION, g.gen_length, g.block, g.steps, g.threshold, *knobs)
    assert result.raw_tokens == tokens
    assert counters(result, expected) == expected


@pytest.mark.parametrize("page_size", [4, 8])
def test_requests_arriving_mid_block_in_one_round_each_equal_the_oracle(page_size: int) -> None:
    """Every request of ``REQUESTS`` under FOCUS (knobs in turn), with one plain block-diffusion request
    among them, in one scheduler: two start together, the others arrive one per iteration while earlier
    ones are mid-block, so one round's forward mixes windows at different steps, blocks and records."""
    m = model("sdar", layers=4, seed=6)
    pool = DecodeKVPool.with_pages(m, 160, page_size)
    sched = DecodeScheduler(m, pool, EagerRoundForward(m, pool, "torch"), start_thread=False)
    cases = []
    for i, (n, *schedule) in enumerate(REQUESTS):
        cases.append((ids(n, 40 + i), gen(*schedule), KNOBS[i % len(KNOBS)]))
    cases.insert(2, (ids(11, 60), gen(16, 16, 8, None), None))  # plain block diffusion
    jobs: list[DecodeRequest] = []
    iterations = 0
    while len(jobs) < len(cases) or sched.depth:
        for i in range(len(jobs), min(len(cases), max(2, iterations + 1))):
            prompt, g, knobs = cases[i]
            focus = None if knobs is None else _focus(*knobs)
            slots = block_slots(len(prompt), g)
            if focus is not None:
                slots = sdar_focus_slots(slots, g, m.config.block_size, page_size)
            start = lambda p=prompt, g=g, f=focus: start_block_decode(m, torch.tensor(p), g, focus=f)  # noqa: E731
            jobs.append(
                sched.submit(DecodeRequest(f"f{i}", start, threading.Event(), False, cache_tokens=slots))
            )
        before = sched.rounds
        sched.run_once()
        iterations += 1
        if any(j.status in (Status.RUNNING, Status.FINISHED) for j in jobs):
            assert sched.rounds == before + 1  # one forward for every running request
        assert iterations < 300
    assert pool.num_free == pool.num_pages
    for (prompt, g, knobs), job in zip(cases, jobs, strict=True):
        (final,) = [e for e in list(job.events.queue) if isinstance(e, Final)]
        if knobs is None:
            tokens = block_diffusion(m, prompt, g.gen_length, g.block, g.steps, g.threshold)[0]
            assert final.result.raw_tokens == tokens, job.request_id
            continue
        tokens, expected = focus_sdar(m, prompt, g.gen_length, g.block, g.steps, g.threshold, *knobs)
        assert final.result.raw_tokens == tokens, job.request_id
        assert counters(final.result, expected) == expected, job.request_id
