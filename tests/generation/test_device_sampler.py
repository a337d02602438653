"""The device-side unmasking (unmask_window, DeviceBatch) equals the host DenoiseState token for token."""

from __future__ import annotations

import itertools

import pytest
import torch

from pdllm.decode_service.device_state import DeviceBatch, DeviceDenoiseState
from pdllm.shared.generation.device_sampler import unmask_window
from pdllm.shared.generation.sampler import DenoiseState, GenerationConfig

V = 41
MASK = 40
EOS = 2


def logits_for(seed: int, kind: str, step: int, gen_length: int) -> torch.Tensor:
    """``[gen_length, V]`` logits of one step, row i for response position i.

    ``ties``: every row has two finite logits a fixed gap apart, so equal gaps give bit-identical
    confidences (1 / (1 + e^-gap)) whatever the tokens; ``flat``: every confidence exactly 1.0;
    ``eos``: random, with EOS the prediction at about one position in six."""
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    if kind in ("ties", "flat"):
        logits = torch.full((gen_length, V), float("-inf"))
        top = torch.randint(3, MASK, (gen_length,), generator=gen)
        logits[torch.arange(gen_length), top] = 5.0
        if kind == "ties":
            other = (top + 1 + torch.randint(0, 30, (gen_length,), generator=gen)) % MASK
            gap = torch.tensor([0.5, 1.0, 2.0])[torch.randint(0, 3, (gen_length,), generator=gen)]
            logits[torch.arange(gen_length), other] = torch.where(other == top, 5.0, 5.0 - gap)
        return logits
    logits = torch.randn(gen_length, V, generator=gen) * 3
    logits[:, EOS] = -1e9
    if kind == "eos":
        hit = torch.rand(gen_length, generator=gen) < 1 / 6
        logits[hit, EOS] = 1e3
    return logits


CONFIGS = [
    GenerationConfig(gen_length=8, steps=8),
    GenerationConfig(gen_length=12, steps=5 * 3, block_length=4),  # more steps than tokens
    GenerationConfig(gen_length=12, steps=6, block_length=4),
    GenerationConfig(gen_length=16, steps=4, block_length=8),  # several tokens per step
    GenerationConfig(gen_length=10, steps=3, block_length=None, stop_at_eos=False),
    GenerationConfig(gen_length=9, steps=9, block_length=3),
    GenerationConfig(gen_length=16, steps=16, block_length=4, threshold=0.5),
    GenerationConfig(gen_length=12, steps=12, block_length=6, threshold=0.9),
    GenerationConfig(gen_length=8, steps=8, threshold=0.05, stop_at_eos=False),
    GenerationConfig(gen_length=6, steps=6, block_length=1),
]
KINDS = ["random", "ties", "flat", "eos"]


def _reference_step(state: DenoiseState, logits: torch.Tensor) -> None:
    state.update(logits[state.positions()])


def test_ties_go_to_the_lower_position() -> None:
    window = torch.full((1, 6), MASK)
    confidence = torch.tensor([[0.5, 0.9, 0.5, 0.9, 0.9, 0.5]])
    predicted = torch.arange(10, 16)[None]
    new = unmask_window(
        window, confidence, predicted, torch.tensor([4]), torch.zeros(1), torch.tensor([False]), MASK
    )
    assert new.tolist() == [[10, 11, MASK, 13, 14, MASK]]
    state = DenoiseState(GenerationConfig(gen_length=6, steps=2, stop_at_eos=False), MASK, EOS)
    state.apply(predicted[0], confidence[0])  # schedule [3, 3]: the three 0.9s
    assert state.tokens.tolist() == [MASK, 11, MASK, 13, 14, MASK]


def test_threshold_compares_in_float32_and_falls_back_to_the_first_maximum() -> None:
    tau = 0.3
    at_tau = torch.tensor(tau, dtype=torch.float32).item()  # float32(0.3) > 0.3 in float64
    confidence = torch.tensor([[at_tau, 0.1, 0.2, 0.2]])
    window = torch.full((1, 4), MASK)
    predicted = torch.arange(20, 24)[None]
    cfg = GenerationConfig(gen_length=4, steps=4, threshold=tau, stop_at_eos=False)
    ref = DenoiseState(cfg, MASK, EOS)
    ref.apply(predicted[0], confidence[0])
    dev = unmask_window(
        window, confidence, predicted, torch.zeros(1, dtype=torch.long), torch.tensor([tau]),
        torch.tensor([True]), MASK,
    )  # fmt: skip
    assert dev[0].tolist() == ref.tokens.tolist() == [20, MASK, MASK, MASK]
    confidence = torch.tensor([[0.1, 0.2, 0.05, 0.2]])  # none above: the first of the two maxima
    ref = DenoiseState(cfg, MASK, EOS)
    ref.apply(predicted[0], confidence[0])
    dev = unmask_window(
        window, confidence, predicted, torch.zeros(1, dtype=torch.long), torch.tensor([tau]),
        torch.tensor([True]), MASK,
    )  # fmt: skip
    assert dev[0].tolist() == ref.tokens.tolist() == [MASK, 21, MASK, MASK]


def _batch_step(
    states: list[DeviceDenoiseState], seeds: list[int], kinds: list[str], steps: list[int]
) -> None:
    """One DeviceBatch step, each state's rows placed at its own offset (as a packed round would)."""
    starts, total = [], 0
    for s in states:
        starts.append(total + 3)  # three foreign rows before each response
        total += 3 + s.config.gen_length
    batch = DeviceBatch(states, starts)
    rows = batch.rows.tolist()
    logits, r = [], 0
    for s, start, seed, kind, step in zip(states, starts, seeds, kinds, steps, strict=True):
        full = logits_for(seed, kind, step, s.config.gen_length)
        own = rows[r : r + s.masked]
        r += s.masked
        logits.append(full[torch.tensor(own, dtype=torch.long) - start])
    assert r == len(rows)
    batch.apply(torch.cat(logits))


@pytest.mark.parametrize("eos_id", [EOS, None])
def test_device_batch_equals_reference_with_sessions_joining_and_leaving(eos_id: int | None) -> None:
    cases = [(config, kind, eos_id) for config, kind in itertools.product(CONFIGS, KINDS)]
    refs = [DenoiseState(c, MASK, e) for c, _, e in cases]
    devs = [DeviceDenoiseState(c, MASK, e, "cpu") for c, _, e in cases]
    seeds = [i * 13 + 1 for i in range(len(cases))]
    steps = [0] * len(cases)
    waiting, active, rounds = list(range(len(cases))), [], 0
    while waiting or active:
        for _ in range(3):  # three join per round
            if waiting:
                active.append(waiting.pop(0))
        kinds = [cases[i][1] for i in active]
        _batch_step([devs[i] for i in active], [seeds[i] for i in active], kinds, [steps[i] for i in active])
        for i in active:
            _reference_step(refs[i], logits_for(seeds[i], cases[i][1], steps[i], cases[i][0].gen_length))
            steps[i] += 1
        rounds += 1
        for i in active:
            ref, dev = refs[i], devs[i]
            assert dev.host_tokens() == ref.tokens.tolist(), (i, cases[i])
            assert (dev.steps_taken, dev.block, dev.done) == (ref.steps_taken, ref.block, ref.done), i
        active = [i for i in active if not refs[i].done]
    assert all(d.result() == r.result() for d, r in zip(devs, refs, strict=True))
    if eos_id is not None:  # some requests were stopped early by an EOS
        assert any(r.done and r.block < r.config.num_blocks for r in refs)
    with pytest.raises(ValueError, match="one mask id and EOS id"):
        DeviceBatch(
            [DeviceDenoiseState(c, MASK, e, "cpu") for c, e in ((CONFIGS[0], EOS), (CONFIGS[0], None))],
            [0, 8],
        )


def test_device_batch_reads_back_only_where_the_schedule_cannot_tell() -> None:
    fixed = DeviceDenoiseState(GenerationConfig(gen_length=8, steps=8, stop_at_eos=True), MASK, EOS, "cpu")
    assert not fixed.needs_readback()  # one block: its end is the request's end
    blocks = DeviceDenoiseState(GenerationConfig(gen_length=8, steps=4, block_length=4), MASK, EOS, "cpu")
    assert not blocks.needs_readback()  # 2 of 4 tokens: the block goes on
    blocks.advance(2, eos_seen=False)
    assert blocks.needs_readback()  # this step ends block 0: did an EOS stop the request?
    no_eos = DeviceDenoiseState(GenerationConfig(gen_length=8, steps=4, block_length=4), MASK, None, "cpu")
    no_eos.advance(2, eos_seen=False)
    assert not no_eos.needs_readback()
    thr = DeviceDenoiseState(GenerationConfig(gen_length=8, steps=8, threshold=0.5), MASK, None, "cpu")
    assert thr.needs_readback()  # how many were unmasked
    with pytest.raises(ValueError, match="sampled decoding"):
        DeviceDenoiseState(GenerationConfig(temperature=0.5), MASK, EOS, "cpu")
