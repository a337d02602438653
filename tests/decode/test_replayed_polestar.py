"""Polestar-Cache at replayed work (``Polestar.replay_rows_per_update_layer`` r and
``replay_updates_per_forward`` u, benchmarks only): an update recomputes ``ceil(r)`` cached rows at every
layer (the rows carried from the layer before first under ``propagated``, then the clusters' members by
descending drift), and updates run at u per forward; the reference hook's rows are checked against the
drifts they were ranked by, the rounds' rows against the reference's, update by update and layer by
layer, and the tokens and counters of both are equal; a default session beside them is untouched.

Planted by hand, each seen failing, then reverted:
- the rows ranked by cluster index, not by drift: in the reference (``forced_rows``' key ``(c,)``) and,
  apart, in the rounds (``forced_batched`` without its drift sort) -> each fails
  ``test_forced_polestar_recomputes_the_forced_rows_per_layer`` for all 3 knob sets;
- the count floored (``replay_ceil(forced)`` -> ``math.floor(forced)`` in ``PolestarState.drifting``) ->
  the same test fails for r = 2.5 (the integer counts are their own floor);
- the override leaking into the default path (``UpdateGroup`` forcing ``ceil(2.5)`` rows where the policy
  sets none) -> the same test fails for all 3 sets (their default session), and 20 of the 23 tests of
  ``tests/decode/test_polestar_rounds.py``;
- the replayed rate rounded up (``replay_due`` with ``ceil``) -> the same test fails for u = 0.4.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import pytest
import torch

from pdllm.decode_service.polestar_rounds import PolestarBatchSession
from pdllm.decode_service.polestar_update_group import UpdateGroup
from pdllm.decode_service.policies import polestar
from pdllm.decode_service.policies.polestar import Polestar, PolestarState
from pdllm.decode_service.policy_rounds import batch_session, cache_slots
from pdllm.decode_service.request import StaticDecode
from pdllm.decode_service.rounds import EagerRoundForward
from pdllm.shared.generation.sampler import GenerationConfig
from tests.decode.helpers import pool_for, run_rounds
from tests.oracles.cases import PROMPT
from tests.oracles.cases import model as oracle_model
from tests.reference.policy import run_policy
from tests.reference.vanilla import vanilla_policy_logits

GEN = GenerationConfig(gen_length=16, steps=16, block_length=8, stop_at_eos=False)
REFRESHES = {0, 8}  # forwards (0-based) that refresh: each block's first step
FORCED = [
    Polestar(
        4, 1, 0, 0.0, "int8", "propagated", replay_rows_per_update_layer=2.5, replay_updates_per_forward=0.4
    ),
    Polestar(
        6, 2, 1, 1e-4, "fp8", "per-layer", replay_rows_per_update_layer=5, replay_updates_per_forward=1.0
    ),
    Polestar(
        3, 2, 0, 0.0, "none", "propagated", replay_rows_per_update_layer=1, replay_updates_per_forward=0.25
    ),
]
DEFAULT = Polestar(4, 1, 0, 0.0, "int8", "propagated")


def exact_ceil(value: float) -> int:
    return math.ceil(Fraction(str(value)))


def expected_updates(rate: float, forwards: int) -> int:
    """Updates at ``rate`` per forward: a cached step updates while fewer than floor(rate x i) ran."""
    done = 0
    for i in range(forwards):
        if i not in REFRESHES and done < math.floor(Fraction(str(rate)) * (i + 1)):
            done += 1
    return done


def _spy_reference(mp: pytest.MonkeyPatch) -> dict[int, list[list[list[int]]]]:
    """Per reference state, per update, per layer: the rows recomputed, each checked against its layer's
    drifts: the carried rows (``propagated``) first, then the clusters' members by descending drift (ties:
    the lower cluster), ``min(ceil(r), cached rows)`` of them."""
    seen: dict[int, list[list[list[int]]]] = {}
    alive: list[PolestarState] = []
    drifts: list[torch.Tensor] = []
    kl_drift, drifting = polestar.kl_drift, PolestarState.drifting

    def keep(*args: torch.Tensor) -> torch.Tensor:
        drifts.append(kl_drift(*args))
        return drifts[-1]

    def watched(self: PolestarState, policy: Polestar, model: Any, layer: int, k: torch.Tensor) -> Any:
        carried = [] if self.carried_rows is None else self.carried_rows.tolist()
        drifts.clear()
        out = drifting(self, policy, model, layer, k)
        rows = [] if out is None else out[0].tolist()
        store = self.stores[layer]
        if policy.replay_rows_per_update_layer is not None:
            ranked = list(carried) if policy.recompute == "propagated" else []
            kl = drifts[0].tolist() if drifts else []
            for c in sorted(range(len(kl)), key=lambda c: (-kl[c], c)):
                ranked += [r for r in sorted(store.rows[store.assign == c].tolist()) if r not in ranked]
            count = min(exact_ceil(policy.replay_rows_per_update_layer), store.rows.numel())
            assert rows == sorted(ranked[:count]) and len(rows) == count
        if layer == 0:
            alive.append(self)  # kept, so that no later state takes its id
            seen.setdefault(id(self), []).append([])
        seen[id(self)][-1].append(rows)
        return out

    mp.setattr(polestar, "kl_drift", keep)
    mp.setattr(PolestarState, "drifting", watched)
    return seen


def _spy_rounds(mp: pytest.MonkeyPatch) -> dict[int, list[list[list[int]]]]:
    """Per rounds session, per update, per layer: the rows its update group recomputed (the real ones)."""
    seen: dict[int, list[list[list[int]]]] = {}
    finish = UpdateGroup._finish

    def watched(
        self: UpdateGroup, layer: int, sess: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, *a: Any
    ):
        for i, s in enumerate(self.sessions):
            if layer == 0:
                seen.setdefault(id(s), []).append([])
            seen[id(s)][-1].append(rows[(sess == i) & valid].sort().values.tolist())
        return finish(self, layer, sess, rows, valid, *a)

    mp.setattr(UpdateGroup, "_finish", watched)
    return seen


def _session(m: Any, pool: Any, policy: Polestar, prompt: list[int]) -> PolestarBatchSession:
    pages = pool.reserve(cache_slots(len(prompt), GEN, policy))
    assert pages is not None
    s = batch_session(m, StaticDecode(list(prompt), None, GEN, cache_policy=policy), pages, pool.page_size)
    assert isinstance(s, PolestarBatchSession)
    return s


@pytest.mark.parametrize("forced", FORCED, ids=lambda p: f"{p.recompute}-r{p.replay_rows_per_update_layer}")
def test_forced_polestar_recomputes_the_forced_rows_per_layer(forced: Polestar) -> None:
    m = oracle_model("dream")
    pool = pool_for(m, pages=128)
    cases = [(forced, PROMPT), (forced, PROMPT[:11]), (DEFAULT, PROMPT[:13])]
    with pytest.MonkeyPatch.context() as mp:
        ref_rows = _spy_reference(mp)
        want = [run_policy(vanilla_policy_logits(m, torch.tensor(p), GEN, policy)) for policy, p in cases]
    with pytest.MonkeyPatch.context() as mp:
        rounds_rows = _spy_rounds(mp)
        sessions = [_session(m, pool, policy, p) for policy, p in cases]
        run_rounds(EagerRoundForward(m, pool, "torch"), list(sessions))
    assert len(ref_rows) == len(cases)
    layers = len(m.model.layers)
    for s, w, ref, (policy, _) in zip(sessions, want, ref_rows.values(), cases, strict=True):
        result = s.result()
        assert (result.raw_tokens, result.cache) == (w.raw_tokens, w.cache)  # counters too
        assert rounds_rows.get(id(s), []) == ref  # update by update, layer by layer
        if policy is DEFAULT:
            continue
        assert s.polestar.updates == expected_updates(policy.replay_updates_per_forward, GEN.steps) > 0
        count = exact_ceil(policy.replay_rows_per_update_layer)
        assert all(len(rows) == count for update in ref for rows in update)  # cached rows >= count here
        assert s.polestar.rows_recomputed == s.polestar.updates * layers * count
