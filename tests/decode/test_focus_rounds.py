"""The decode worker's batched FOCUS (``decode_service/focus_rounds.py``), driven as the scheduler drives
sessions stepped alone: every member advances by exactly one denoising step per iteration whatever the
order of its members' ``step()`` calls, joins mid-way, leaves when done or cancelled (its slot reused),
and ends with the reference loop's tokens and counters."""

from __future__ import annotations

import threading

import pytest
import torch

from pdllm.decode_service.focus_rounds import FocusGroups, FocusMember
from pdllm.decode_service.policies.focus import FocusConfig
from pdllm.decode_service.vanilla import generate_vanilla
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.generation.sampler import GenerationConfig, GenerationResult
from pdllm.shared.model.attention import DenseAttention
from pdllm.shared.model.transformer import DiffusionLM

from ..model.helpers import tiny_model

PROMPTS = [[1, 17, 33, 8, 61, 5, 40, 22, 9, 70], [1, 5, 6, 7, 8, 9, 10], [4, 44, 55, 66, 3, 12, 13, 14, 15]]
GEN = GenerationConfig(gen_length=16, steps=16, block_length=8, stop_at_eos=False)  # 16 steps each
PAPER = FocusConfig()


def _reference(model: DiffusionLM, prompt: list[int], gen: GenerationConfig) -> GenerationResult:
    return generate_vanilla(model, prompt, gen, policy=DecodePolicyConfig("focus"))  # the paper's knobs


def _join(groups: FocusGroups, model: DiffusionLM, prompt: list[int], gen: GenerationConfig) -> FocusMember:
    local = torch.tensor(prompt + [model.config.mask_token_id] * gen.gen_length)
    positions = torch.arange(local.numel())[None]
    return groups.join(local, positions, len(prompt), DenseAttention(), gen, PAPER, threading.Event())


def _iteration(members: list[FocusMember]) -> None:
    """One scheduler iteration: each live member's group stepped once, then the retiring of finished ones."""
    stepped: list[object] = []
    for m in members:
        if not any(m.group is g for g in stepped):
            m.group.step()
            stepped.append(m.group)
    members[:] = [m for m in members if not m.done]


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_members_advance_once_per_iteration_and_match_the_reference(family: str) -> None:
    model = tiny_model(family, seed=2, num_layers=4)
    groups = FocusGroups(model, slots=4)
    a, b = _join(groups, model, PROMPTS[0], GEN), _join(groups, model, PROMPTS[1], GEN)
    live, done = [a, b], [a, b]
    _iteration(live)
    assert a.state.steps_taken == b.state.steps_taken == 1
    c = _join(groups, model, PROMPTS[2], GEN)  # joins the running group mid-way
    assert c.group is a.group
    live.insert(0, c)
    done.append(c)
    for n in range(2, 5):
        _iteration(live if n % 2 else live[::-1])
        assert (a.state.steps_taken, b.state.steps_taken, c.state.steps_taken) == (n, n, n - 1)
    while live:
        _iteration(live)
    for member, prompt in zip(done, PROMPTS, strict=True):
        ref, got = _reference(model, prompt, GEN), member.result()
        assert got.raw_tokens == ref.raw_tokens and got.steps == ref.steps
        assert got.cache == ref.cache


def test_cancelled_and_finished_members_free_their_slots() -> None:
    model = tiny_model("dream", seed=1, num_layers=4)
    groups = FocusGroups(model, slots=2)
    a, b = _join(groups, model, PROMPTS[0], GEN), _join(groups, model, PROMPTS[1], GEN)
    c = _join(groups, model, PROMPTS[2], GEN)
    assert c.group is not a.group and a.group is b.group  # the first group was full
    b.group.step()  # a's block K/V fill its slot
    a.cancelled.set()
    b.group.step()
    assert a.state.steps_taken == 1 and b.state.steps_taken == 2  # a left at the group's step
    d = _join(groups, model, PROMPTS[2], GEN)
    assert d.group is b.group and d.request.slot == a.request.slot
    other = GenerationConfig(gen_length=8, steps=8, block_length=4, stop_at_eos=False)
    e = _join(groups, model, PROMPTS[0], other)
    assert e.group not in (b.group, c.group)  # another schedule: another group
    e.group.step()
    e.group.step()
    assert e.state.steps_taken == 2  # alone in its group, it advances at each of its group's steps
    live = [b, c, d, e]
    while live:
        _iteration(live)
    ref, got = _reference(model, PROMPTS[2], GEN), d.result()
    assert got.raw_tokens == ref.raw_tokens and got.cache == ref.cache
    assert e.result().raw_tokens == _reference(model, PROMPTS[0], other).raw_tokens


def test_groups_left_empty_are_dropped_at_the_next_join() -> None:
    model = tiny_model("llada", seed=3, num_layers=4)
    groups = FocusGroups(model, slots=2)
    other = GenerationConfig(gen_length=8, steps=8, block_length=4, stop_at_eos=False)
    a = _join(groups, model, PROMPTS[0], other)
    while not a.done:
        a.group.step()
    _join(groups, model, PROMPTS[1], GEN)
    assert list(groups.groups) == [(GEN, PAPER)]  # the finished request's group is gone


def test_the_scheduler_steps_each_focus_group_once_per_iteration() -> None:
    """Requests of one FOCUS group through the scheduler advance one step per iteration, together, and
    answer as the reference loop. Planted: ``step_alone`` stepping a group once per member -> each member
    advances three steps in the first iteration; fails."""
    from pdllm.decode_service.request import DecodeRequest, Final
    from pdllm.decode_service.rounds import EagerRoundForward
    from pdllm.decode_service.scheduler import DecodeScheduler
    from pdllm.decode_service.sessions import SessionMaker
    from tests.decode.helpers import pool_for

    model = tiny_model("dream", seed=2, num_layers=4)
    pool = pool_for(model, pages=8)
    sched = DecodeScheduler(model, pool, EagerRoundForward(model, pool, "torch"), start_thread=False)
    maker = SessionMaker(model, "segments", False)
    policy = DecodePolicyConfig("focus")
    reqs = []
    for i, prompt in enumerate(PROMPTS):
        cancelled = threading.Event()
        start = lambda p=prompt, c=cancelled: maker.vanilla(p, GEN, policy, c)  # noqa: E731
        reqs.append(sched.submit(DecodeRequest(f"f{i}", start, cancelled, False)))
    sched.run_once()
    sessions = [r.session for r in reqs]
    assert all(isinstance(s, FocusMember) and s.group is sessions[0].group for s in sessions)
    assert [s.state.steps_taken for s in sessions] == [1, 1, 1]  # type: ignore[union-attr]
    for _ in range(100):
        if not sched.active:
            break
        sched.run_once()
    for req, prompt in zip(reqs, PROMPTS, strict=True):
        final = req.events.get_nowait()
        assert isinstance(final, Final)
        ref = _reference(model, prompt, GEN)
        assert final.result.raw_tokens == ref.raw_tokens and final.result.cache == ref.cache
