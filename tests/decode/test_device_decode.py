"""Greedy decode with the unmasking on the device equals the host-side sampler, token for token, in batched
rounds of mixed sessions (eager and padded)."""

from __future__ import annotations

import dataclasses

import pytest

from pdllm.decode_service.device_state import DeviceDenoiseState
from pdllm.decode_service.round_graphs import GraphedRoundForward
from pdllm.decode_service.rounds import BatchSession, EagerRoundForward, decode_round
from pdllm.shared.generation.sampler import DenoiseState, GenerationConfig
from tests.decode.helpers import CASES, Case, alone, eos_model, pool_for, session
from tests.engine.helpers import model

GENS = [
    GenerationConfig(gen_length=8, steps=8),
    GenerationConfig(gen_length=12, steps=6, block_length=4),
    GenerationConfig(gen_length=12, steps=12, block_length=3),
    GenerationConfig(gen_length=8, steps=2, stop_at_eos=False),
    GenerationConfig(gen_length=10, steps=3),  # uneven schedules: 4, 3, 3
    GenerationConfig(gen_length=12, steps=8, block_length=6),  # 2, 2, 1, 1 per block
    GenerationConfig(gen_length=12, steps=12, block_length=6, threshold=0.3),
    GenerationConfig(gen_length=8, steps=8, threshold=0.9, stop_at_eos=False),
]


def _cases() -> list[Case]:
    """Greedy variants of the rounds' cases (their K, top-B and KV modes) over ``GENS``."""
    return [dataclasses.replace(c, gen=g) for c in CASES for g in GENS if c.gen.temperature == 0][::2]


def _mixed(m, pool, cases: list[Case]) -> list[tuple[BatchSession, BatchSession | None]]:  # type: ignore[no-untyped-def]
    """Each case as a device session paired with the same case on the host sampler (greedy only)."""
    out = []
    for seed, case in enumerate(cases):
        dev = session(m, pool, case, seed)
        host = session(m, pool, case, seed, device_sampler=False) if case.gen.temperature == 0 else None
        out.append((dev, host))
    return out


@pytest.mark.parametrize("planted_eos", [False, True])
@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("kind", ["eager", "padded"])
def test_rounds_device_sessions_step_like_host_sessions(family: str, kind: str, planted_eos: bool) -> None:
    m = eos_model(family) if planted_eos else model(family)
    cases = CASES + _cases()
    pool = pool_for(m, pages=160)
    forward = (
        EagerRoundForward(m, pool, "torch")
        if kind == "eager"
        else GraphedRoundForward(m, pool, "torch", False)
    )
    pairs = _mixed(m, pool, cases)
    assert isinstance(pairs[0][0].state, DeviceDenoiseState) and isinstance(pairs[0][1].state, DenoiseState)  # type: ignore[union-attr]
    assert isinstance(pairs[2][0].state, DenoiseState)  # sampled: stays on the host
    waiting, active = list(pairs), []
    while waiting or active:
        for _ in range(2):  # two pairs join per round, sessions leave when done: mixed steps every round
            if waiting:
                active += [s for s in waiting.pop(0) if s is not None]
        decode_round(forward, active)
        for dev, host in pairs:
            if host is not None and dev in active:
                assert dev.partial() == host.partial()
                assert (dev.state.steps_taken, dev.state.block, dev.done) == (
                    host.state.steps_taken,
                    host.state.block,
                    host.done,
                )
        active = [s for s in active if not s.done]
    if planted_eos and family == "dream":  # some device sessions were stopped early by an EOS
        assert any(d.state.block < d.state.config.num_blocks for d, h in pairs if h is not None)
    for seed, (case, (dev, host)) in enumerate(zip(cases, pairs, strict=True)):
        want = alone(m, case, seed)
        assert dev.result().raw_tokens == want, (seed, case.gen)
        if host is not None:
            assert dev.result() == dataclasses.replace(host.result(), decode_seconds=dev.seconds)
