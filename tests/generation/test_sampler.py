"""The shared sampler: schedules, threshold mode, EOS handling and argument errors."""

from __future__ import annotations

import pytest
import torch

from pdllm.shared.generation.sampler import DenoiseState, GenerationConfig, denoise, step_schedule

V = 50
MASK = 49
EOS = 2


def _random_logits(seed: int):
    gen = torch.Generator().manual_seed(seed)

    def fn(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits = torch.randn(positions.numel(), V, generator=gen) * 3
        logits[:, MASK] = -1e9
        logits[:, EOS] = -1e9
        return logits

    return fn


@pytest.mark.parametrize(("block", "steps"), [(8, 8), (10, 3), (7, 7), (5, 9), (1, 1)])
def test_step_schedule_covers_block(block: int, steps: int) -> None:
    sched = step_schedule(block, steps)
    assert sum(sched) == block and all(s >= 1 for s in sched) and len(sched) == min(block, steps)


@pytest.mark.parametrize(
    ("gen", "steps", "block"), [(32, 32, None), (32, 8, 8), (24, 6, 12), (16, 4, 4), (12, 12, 3)]
)
def test_step_mode_unmasks_exactly_gen_length(gen: int, steps: int, block: int | None) -> None:
    cfg = GenerationConfig(gen_length=gen, steps=steps, block_length=block, stop_at_eos=False)
    state = DenoiseState(cfg, MASK, EOS)
    fn = _random_logits(0)
    per_step = []
    while not state.done:
        before = int((state.tokens == MASK).sum())
        blk = state.block
        picked = state.update(fn(state.tokens, state.positions()))
        per_step.append(before - int((state.tokens == MASK).sum()))
        # Unmasking never leaves the current semi-autoregressive block.
        assert bool(((picked // cfg.block) == blk).all())
    assert int((state.tokens == MASK).sum()) == 0
    assert sum(per_step) == gen
    assert state.steps_taken == min(steps, gen)
    expected = step_schedule(cfg.block, steps // cfg.num_blocks) * cfg.num_blocks
    assert per_step == expected


@pytest.mark.parametrize("tau", [0.05, 0.5, 0.99])
def test_threshold_mode_at_least_one_per_step(tau: float) -> None:
    cfg = GenerationConfig(gen_length=16, steps=16, block_length=8, threshold=tau, stop_at_eos=False)
    state = DenoiseState(cfg, MASK, EOS)
    fn = _random_logits(1)
    while not state.done:
        before = int((state.tokens == MASK).sum())
        state.update(fn(state.tokens, state.positions()))
        assert before - int((state.tokens == MASK).sum()) >= 1
    assert int((state.tokens == MASK).sum()) == 0


def test_threshold_unmasks_all_confident_tokens_at_once() -> None:
    cfg = GenerationConfig(gen_length=8, steps=8, threshold=0.9, stop_at_eos=False)
    state = DenoiseState(cfg, MASK, EOS)
    logits = torch.full((8, V), -20.0)
    logits[torch.arange(8), torch.arange(8) + 10] = 20.0  # every prediction ~certain
    state.update(logits)
    assert state.done and state.tokens.tolist() == list(range(10, 18))


def test_greedy_picks_most_confident_first() -> None:
    cfg = GenerationConfig(gen_length=4, steps=4, stop_at_eos=False)
    state = DenoiseState(cfg, MASK, EOS)
    logits = torch.zeros(4, V)
    logits[2, 7] = 10.0  # position 2 is by far the most confident
    state.update(logits)
    assert state.tokens.tolist() == [MASK, MASK, 7, MASK]


def test_temperature_sampling_is_seeded() -> None:
    def run(seed: int) -> list[int]:
        cfg = GenerationConfig(gen_length=16, steps=16, temperature=1.0, seed=seed, stop_at_eos=False)
        flat = lambda tokens, positions: torch.zeros(positions.numel(), V)  # noqa: E731
        return denoise(cfg, MASK, EOS, flat).raw_tokens

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_eos_stops_after_block_and_trims() -> None:
    cfg = GenerationConfig(gen_length=12, steps=12, block_length=4, stop_at_eos=True)

    def fn(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(positions.numel(), V)
        for row, pos in enumerate(positions.tolist()):
            logits[row, EOS if pos == 5 else 10 + pos] = 10.0
        return logits

    result = denoise(cfg, MASK, EOS, fn)
    assert result.token_ids == [10, 11, 12, 13, 14]
    assert result.steps == 8  # blocks 0 and 1 only: the EOS in block 1 stops generation
    assert result.raw_tokens[8:] == [MASK] * 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": 0}, "steps must be > 0"),
        ({"steps": -3}, "steps must be > 0"),
        ({"gen_length": 0}, "gen_length must be > 0"),
        ({"gen_length": 10, "block_length": 4}, r"must be divisible by block_length \(4\)"),
        ({"gen_length": 16, "block_length": 4, "steps": 6}, "multiple of the number of blocks"),
        ({"threshold": 0.0}, "threshold must be in"),
        ({"threshold": 1.5}, "threshold must be in"),
        ({"temperature": -1.0}, "temperature must be"),
    ],
)
def test_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DenoiseState(GenerationConfig(**kwargs), MASK, EOS)


def test_wrong_number_of_logit_rows() -> None:
    state = DenoiseState(GenerationConfig(gen_length=4, steps=4), MASK, EOS)
    with pytest.raises(ValueError, match="expected logits for 4 positions"):
        state.update(torch.zeros(3, V))
