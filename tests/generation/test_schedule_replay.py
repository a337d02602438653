"""Replaying a recorded unmask schedule (``GenerationConfig.schedule``) in the decode worker's batched rounds.

- A replayed decode unmasks exactly the recorded counts per step: each session's masked slots are counted
  after every round from its partial output, not from the sampler's own record, for every decode policy's
  session kind (device-sampled plain and caching sessions, host-sampled DyLLM and FOCUS ones, block
  diffusion on SDAR), sessions of different schedules sharing the rounds.
- Recording a greedy threshold run and replaying its schedule reproduces its tokens: a threshold step
  unmasks the positions with confidence > T, which are exactly the ``n`` most confident where ``n`` is how
  many passed (none at or below T ranks above one above it; with none above T both take the first most
  confident), and the same tokens give the same logits at the next step. FOCUS is the exception, and
  why is tested: its budget is raised to a replayed step's count, as to a fixed schedule's.
- The fitting of a schedule to another response shape, per recorded block when recorded in shorter
  blocks (SDAR at its model block, replayed in longer generation blocks aligned to absolute positions).

Planted and seen failing: the replayed step index read one ahead (``self._schedule[self.step_in_block + 1]``
in ``DeviceDenoiseState.scheduled`` and ``DenoiseState.apply``) -> 19 of the 20 tests fail: the exact-count
test of every session kind and every record-then-replay test (the fitting test does not step a decode).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdllm.decode_service.policies import DecodePolicyConfig
from pdllm.decode_service.policy_rounds import batch_session
from pdllm.decode_service.rounds import BatchSession, EagerRoundForward, decode_round
from pdllm.decode_service.sessions import SessionMaker
from pdllm.shared.generation.sampler import DenoiseState, GenerationConfig
from pdllm.shared.generation.schedule import block_counts, fit_counts, replayed, replayed_spans, schedule_tpf
from pdllm.shared.model.transformer import DiffusionLM
from tests.decode.helpers import pool_for
from tests.engine.helpers import tokens
from tests.model.helpers import tiny_model

POLICIES = ["none", "dual-cache", "sparse-dllm", "polestar", "dyllm"]  # Dream; focus: SDAR only
# Gen 8 in blocks of 4 (SDAR: its model block); blocks of different paces, the first reused for a third.
SCHEDULES = [((1, 3), (2, 1, 1)), ((4,),), ((1, 1, 1, 1), (3, 1))]


class Rounds:
    """Vanilla sessions of one tiny model in eager batched rounds, made as the decode worker makes them."""

    def __init__(self, m: DiffusionLM) -> None:
        self.m, self.maker = m, SessionMaker(m, page_size=16)
        self.pool = pool_for(m, pages=256)
        self.forward = EagerRoundForward(m, self.pool, "torch")

    def session(self, prompt: list[int], gen: GenerationConfig, policy: str) -> BatchSession:
        cfg = None if policy == "none" else DecodePolicyConfig(policy)
        built = self.maker.vanilla(prompt, gen, cfg)
        pages = self.pool.reserve(self.maker.pool_slots(cfg, len(prompt), gen, static=False))
        assert pages is not None
        if built.static is not None:  # block diffusion: the prompt's whole blocks, built
            self.pool.place(pages, built.static)
        return batch_session(self.m, built, pages, self.pool.page_size)

    def run(self, sessions: list[BatchSession]) -> list[list[int]]:
        """Decode ``sessions`` together; per session its masked slots before and after each of its rounds
        (counted from its partial output)."""
        masked = [[s.partial().count(-1)] for s in sessions]
        active = list(range(len(sessions)))
        while active:
            decode_round(self.forward, [sessions[i] for i in active])
            for i in active:
                masked[i].append(sessions[i].partial().count(-1))
            active = [i for i in active if not sessions[i].done]
        return masked


def _prompt(seed: int) -> list[int]:
    return [1, *tokens(12 + seed, seed)]


def _family_cases() -> list[tuple[str, str]]:
    return [("dream", p) for p in POLICIES] + [("llada", "dual-cache"), ("sdar", "none"), ("sdar", "focus")]


@pytest.mark.parametrize(("family", "policy"), _family_cases())
def test_a_replayed_decode_unmasks_exactly_the_recorded_counts(family: str, policy: str) -> None:
    rounds = Rounds(tiny_model(family, seed=3))
    gens = [
        GenerationConfig(gen_length=12, steps=12, block_length=4, schedule=s, stop_at_eos=False)
        for s in SCHEDULES
    ]
    sessions = [rounds.session(_prompt(i), gen, policy) for i, gen in enumerate(gens)]
    for schedule, masked, s in zip(SCHEDULES, rounds.run(sessions), sessions, strict=True):
        # block diffusion aligns its blocks to absolute positions: its first and last may be shorter
        spans = getattr(s.state, "spans", [(lo, lo + 4) for lo in range(0, 12, 4)])
        want = [block_counts(schedule, b, hi - lo) for b, (lo, hi) in enumerate(spans)]
        assert [a - b for a, b in zip(masked, masked[1:])] == [n for w in want for n in w], (policy, schedule)
        assert masked[-1] == 0 and s.result().unmasked == want


def _record_then_replay(family: str, policy: str, quota: bool = True) -> list[tuple[bool, list[list[int]]]]:
    """Greedy threshold decodes (EOS stop on: some stop early) and their replays, one at a time: per
    decode, whether the replay's tokens and steps equal the threshold run's, and the recorded schedule.
    ``quota=False``: the replay's sampler reports no step quota to FOCUS (what a threshold run reports)."""
    m = tiny_model(family, seed=5)
    with torch.no_grad():  # EOS wins at some positions
        m.lm_head.weight[m.config.eos_token_id] = m.lm_head.weight[50] * 1.2
    block = 4 if family == "sdar" else 8
    out = []
    for seed in range(3):
        for threshold in (0.03, 0.08, 0.2):
            rounds = Rounds(m)
            gen = GenerationConfig(gen_length=16, steps=16, block_length=block, threshold=threshold)
            first = rounds.session(_prompt(seed), gen, policy)
            rounds.run([first])
            recorded = first.result()
            schedule = tuple(map(tuple, recorded.unmasked))
            replay = rounds.session(_prompt(seed), replace(gen, threshold=None, schedule=schedule), policy)
            with pytest.MonkeyPatch.context() as patch:
                if not quota:
                    patch.setattr(DenoiseState, "quota", lambda self: None)
                rounds.run([replay])
            again = replay.result()
            assert again.unmasked == recorded.unmasked  # the counts, whatever the tokens
            same = (again.raw_tokens, again.steps) == (recorded.raw_tokens, recorded.steps)
            out.append((same, recorded.unmasked))
    return out


@pytest.mark.parametrize(("family", "policy"), [c for c in _family_cases() if c[1] != "focus"])
def test_replaying_a_threshold_runs_schedule_reproduces_its_tokens(family: str, policy: str) -> None:
    runs = _record_then_replay(family, policy)
    assert all(same for same, _ in runs)
    counts = {n for _, schedule in runs for block in schedule for n in block}
    assert len(counts) > 2  # several tokens in some steps, one in others


def test_focus_replays_reproduce_the_threshold_run_but_for_its_raised_budget() -> None:
    """FOCUS raises its budget of rows forwarded past layer 1 to the step's quota, so that a fixed
    schedule's count can be unmasked (``focus_select.select_batched``); a threshold run has no quota. A
    replay therefore forwards more rows where the recorded count exceeded FOCUS's own budget (the count
    was reached through its AR-context and placeholder rows), and its tokens may differ; with the quota
    not reported the replay is the threshold run (FOCUS runs on SDAR only)."""
    assert all(same for same, _ in _record_then_replay("sdar", "focus", quota=False))


def test_fitting_a_schedule_to_another_shape() -> None:
    assert fit_counts([3, 1], 8) == [3, 1, 3, 1]  # extended: the counts again, in order
    assert fit_counts([5, 10, 17], 8) == [5, 3]  # truncated: the step that passes the length is cut
    assert block_counts(((4,), (1, 3)), 2, 4) == [4]  # block 2 replays recorded block 0
    assert replayed(((2, 2), (1, 1, 2)), 16, 8) == ((2, 2, 2, 2), (1, 1, 2, 1, 1, 2))
    assert schedule_tpf(((2, 2), (1, 1, 2))) == pytest.approx(8 / 5)
    # recorded at block 4, replayed in SDAR spans of a 73-token prompt (blocks of 8 aligned to absolute
    # positions): pieces [0,3) [3,7) | [7,11) [11,15) | [15,16), piece g replaying recorded block g mod 3
    sdar = ((1,), (2, 2), (3, 1))
    assert replayed_spans(sdar, [(0, 7), (7, 15), (15, 16)], 4, start=73) == (
        (1, 1, 1, 2, 2),
        (3, 1, 1, 1, 1, 1),
        (1,),
    )
    assert replayed_spans(sdar, [(0, 8), (8, 16)], 32) == replayed(sdar, 16, 8)  # a unit past the block
    assert replayed(sdar, 16, 8, unit=4) == ((1, 1, 1, 1, 2, 2), (3, 1, 1, 1, 1, 1))
    with pytest.raises(ValueError, match="no threshold"):
        GenerationConfig(gen_length=4, steps=4, threshold=0.5, schedule=((4,),)).validate()
    with pytest.raises(ValueError, match="positive integers"):
        GenerationConfig(gen_length=4, steps=4, schedule=((2, 0, 2),)).validate()
