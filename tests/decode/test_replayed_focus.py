"""FOCUS at a replayed retained share (``FocusConfig.replay_retained_frac`` f, benchmarks only): each step
keeps the top ``ceil(f x block rows)`` masked rows by the importance delta (raised to a fixed schedule's
quota), plus the rows FOCUS always adds (AR context, placeholders, decoded rows not frozen), in the
vectorized selection and in SDAR's rounds, which still equal the reference loop token for
token and counter for counter; a session without the override beside them is untouched.

Planted by hand, each seen failing, then reverted:
- the top K taken in row order, not by dI (``select_batched``'s sort key the negated row index under the
  override) -> 11 of the 15 ``test_the_forced_selection_is_the_top_k_by_delta_plus_focus_rows`` cases and
  ``test_forced_focus_rounds_forward_the_forced_rows_past_layer_1`` fail;
- K = floor(f x rows) instead of the ceiling (``.ceil()`` -> ``.floor()`` in ``select_batched``) -> 8 of
  those 15 cases and the rounds test fail;
- the override leaking into the default path (``select_batched`` forcing f = 0.5 where none is set) ->
  the rounds test fails (its default session), and so does ``tests/decode/test_sdar_focus_rounds.py``.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import pytest
import torch

from pdllm.decode_service import sdar_focus_rounds
from pdllm.decode_service.block_rounds import block_slots, start_block_decode
from pdllm.decode_service.policies.focus import FocusConfig
from pdllm.decode_service.policies.focus_select import select_batched
from pdllm.decode_service.policy_rounds import batch_session
from pdllm.decode_service.sdar_focus_rounds import sdar_focus_slots
from pdllm.shared.generation.sampler import GenerationConfig
from tests.decode.helpers import pool_for, round_forward, run_rounds
from tests.model.helpers import tiny_model
from tests.oracles.cases import ids
from tests.reference.focus import generate_focus_block_diffusion


def exact_ceil(share: float, rows: int) -> int:
    """``ceil(share x rows)`` in exact arithmetic on the share as written (0.7 x 10 is 7)."""
    return math.ceil(Fraction(str(share)) * rows)


def expected_rows(
    delta: list[float], masked: list[bool], frozen: list[bool], reach: int, quota: int, share: float
) -> tuple[list[int], list[int]]:
    """The block rows a forced step forwards past layer 1 and its top K masked rows, from the scores: K =
    max(1, ceil(f x rows), quota) masked rows of largest delta (ties: the lower row), each one's
    predecessor, the masked rows from ``reach`` up to the last of those, the decoded rows not frozen."""
    w = len(delta)
    k = max(1, exact_ceil(share, w), quota)
    top = sorted((j for j in range(w) if masked[j]), key=lambda j: (-delta[j], j))[:k]
    rows = set(top) | {j - 1 for j in top if j > 0}
    last = max(rows)
    rows |= {j for j in range(w) if masked[j] and reach <= j < last}
    rows |= {j for j in range(w) if not masked[j] and not frozen[j]}
    return sorted(rows), sorted(top)


@pytest.mark.parametrize("share", [0.1, 0.3, 0.5, 0.7993, 1.0])
@pytest.mark.parametrize("width", [5, 8, 13])
def test_the_forced_selection_is_the_top_k_by_delta_plus_focus_rows(share: float, width: int) -> None:
    """``select_batched`` under the override, 12 random blocks at once (Eq. 4's inputs and a fixed
    ``budget`` present but ignored), against :func:`expected_rows`."""
    gen = torch.Generator().manual_seed(width)
    r = 12
    delta = torch.randn(r, width, generator=gen, dtype=torch.float64)
    masked = torch.rand(r, width, generator=gen) < 0.6
    masked[:, 0] |= ~masked.any(-1)  # at least one masked row each
    frozen = ~masked & (torch.rand(r, width, generator=gen) < 0.4)
    reach = torch.randint(0, width + 1, (r,), generator=gen)
    k_hist = torch.randint(1, width + 1, (r,), generator=gen)
    quota = torch.randint(0, 4, (r,), generator=gen) * (torch.arange(r) % 2)  # half without a quota
    config = FocusConfig(budget=2, replay_retained_frac=share)
    valid = torch.ones_like(masked)
    got = select_batched(delta, masked, frozen, valid, reach, k_hist, quota, config, width)
    for i in range(r):
        want, top = expected_rows(
            delta[i].tolist(), masked[i].tolist(), frozen[i].tolist(), int(reach[i]), int(quota[i]), share
        )
        assert got[i].nonzero().flatten().tolist() == want, (share, width, i)
        k = max(1, exact_ceil(share, width), int(quota[i]))
        assert len(top) == min(k, int(masked[i].sum()))  # the forced count, as many as are masked


def _spy_selections(mp: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Every ``select_batched`` call of the rounds: its inputs and output."""
    calls: list[tuple[Any, ...]] = []

    def spy(*args: Any) -> torch.Tensor:
        out = select_batched(*args)
        calls.append((*args, out))
        return out

    mp.setattr(sdar_focus_rounds, "select_batched", spy)
    return calls


def _check_forced_calls(calls: list[tuple[Any, ...]]) -> int:
    """Each forced call's rows equal :func:`expected_rows` of its own scores; the forced blocks checked."""
    checked = 0
    for delta, masked, frozen, valid, reach, _, quota, config, _, out in calls:
        share = config.replay_retained_frac
        if share is None:
            continue
        assert bool(valid.all())  # the rounds pad nothing: one width per batch
        for i in range(delta.shape[0]):
            want, _ = expected_rows(
                delta[i].tolist(), masked[i].tolist(), frozen[i].tolist(), int(reach[i]), int(quota[i]), share
            )
            assert out[i].nonzero().flatten().tolist() == want
            checked += 1
    return checked


def _sdar_session(m: Any, pool: Any, prompt: list[int], gen: GenerationConfig, focus: FocusConfig) -> Any:
    made = start_block_decode(m, torch.tensor(prompt), gen, focus=focus)
    slots = sdar_focus_slots(block_slots(len(prompt), gen), gen, m.config.block_size, pool.page_size)
    pages = pool.reserve(slots)
    assert pages is not None
    if made.static is not None:
        pool.write(pages, made.static.tensor())
    return batch_session(m, made, pages, pool.page_size)


GENS = [
    GenerationConfig(gen_length=16, steps=16, block_length=8, stop_at_eos=False),  # quota 1 per step
    GenerationConfig(gen_length=16, steps=16, block_length=8, threshold=0.1, stop_at_eos=False),  # none
    GenerationConfig(gen_length=16, steps=16, block_length=8, stop_at_eos=False),  # Eq. 4's K: 2 mostly
]
FOCUS = [FocusConfig(replay_retained_frac=0.5), FocusConfig(replay_retained_frac=0.3), FocusConfig()]


def test_forced_focus_rounds_forward_the_forced_rows_past_layer_1() -> None:
    """Two forced sessions (one under a fixed schedule, one under a threshold) and a default one share the
    rounds: every forced selection is :func:`expected_rows` of its scores, and each session ends as its
    reference loop under the same config (tokens and every FOCUS counter)."""
    m = tiny_model("sdar", seed=1, num_layers=4)
    pool = pool_for(m, pages=256, page_size=8)
    prompts = [ids(9 + 2 * i, 40 + i) for i in range(3)]
    with pytest.MonkeyPatch.context() as mp:
        calls = _spy_selections(mp)
        sessions = [_sdar_session(m, pool, p, g, f) for p, g, f in zip(prompts, GENS, FOCUS, strict=True)]
        run_rounds(round_forward("eager", m, pool), sessions)
    assert _check_forced_calls(calls) > 10
    for s, p, g, f in zip(sessions, prompts, GENS, FOCUS, strict=True):
        want = generate_focus_block_diffusion(m, torch.tensor(p), g, f)
        got = s.result()
        assert (got.raw_tokens, got.cache) == (want.raw_tokens, want.cache), f
    assert all(s.result().cache["evicted"] > 0 for s in sessions[:2])  # the forced ones evicted rows
