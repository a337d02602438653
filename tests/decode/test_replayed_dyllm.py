"""DyLLM at a replayed share (``DyLLMConfig.replay_ffn_frac`` f, benchmarks only): at every layer of a
SparseStep the ``ceil(f x queried rows)`` rows of lowest context cosine are salient instead of those under
τ, in the rounds (each forced layer's choice checked against the cosines it was made from) and in the
reference loop; the rounds still equal the reference token for token and counter for counter, and a
session without the override beside them is untouched.

Planted by hand, each seen failing, then reverted:
- the forced rows taken in row order, not by cosine (``lowest_per_member`` given a zero score) ->
  ``test_forced_dyllm_layers_make_the_most_drifted_rows_salient`` fails (dream, llada);
- the count floored (``replay_ceil(f * m)`` -> ``int(f * m)`` in ``DyLLMRound``) -> the same test fails
  (dream, llada);
- the override leaking into the default path (``DyLLMRound`` forcing f = 0.5 for a session without one)
  -> the same test fails (its default session), and 7 of the 8 tests of ``tests/decode/test_dyllm_rounds.py``.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import pytest
import torch

from pdllm.decode_service import dyllm_rounds
from pdllm.decode_service.dyllm_rounds import DyLLMRound
from pdllm.decode_service.request import StaticDecode
from pdllm.shared.decode_policy import DyLLMConfig
from pdllm.shared.generation.sampler import GenerationConfig, GenerationResult
from pdllm.shared.model.attention import DenseAttention
from tests.decode.helpers import pool_for, round_forward, run_rounds
from tests.decode.test_dyllm_rounds import dyllm_session
from tests.model.helpers import tiny_model
from tests.oracles.cases import ids
from tests.reference.compute_skip import run_compute_skip
from tests.reference.dyllm import DyLLMLogits
from tests.reference.policy import vanilla_local_rows


def exact_ceil(share: float, rows: int) -> int:
    """``ceil(share x rows)`` in exact arithmetic on the share as written (0.7 x 10 is 7)."""
    return math.ceil(Fraction(str(share)) * rows)


CONFIGS = [
    DyLLMConfig(full_steps=2, full_sequence_interval=3, replay_ffn_frac=0.4),
    DyLLMConfig(threshold=0.9, full_steps=1, full_sequence_interval=2, replay_ffn_frac=0.75),
    DyLLMConfig(full_steps=2, approximate_attention=False, replay_ffn_frac=0.2),
    DyLLMConfig(threshold=0.98, full_steps=2, full_sequence_interval=3),  # τ decides
]
GENS = [
    GenerationConfig(gen_length=16, steps=16, block_length=8, stop_at_eos=False),
    GenerationConfig(gen_length=12, steps=6, block_length=6, stop_at_eos=False),
    GenerationConfig(gen_length=16, steps=16, block_length=8, threshold=0.1, stop_at_eos=False),
    GenerationConfig(gen_length=16, steps=16, block_length=8, stop_at_eos=False),
]


def _reference(m: Any, prompt: list[int], gen: GenerationConfig, config: DyLLMConfig) -> GenerationResult:
    local, positions = vanilla_local_rows(m.config.mask_token_id, torch.tensor(prompt), gen)
    return run_compute_skip(DyLLMLogits(m, local, positions, len(prompt), gen, config, DenseAttention()))


def _spy_layers(mp: pytest.MonkeyPatch) -> list[int]:
    """Checks every forced layer of the rounds: a forced session's chosen rows are the ``ceil(f x queried
    rows)`` of lowest cosine (ties: the lower row). Returns one entry per forced session and layer checked."""
    cosines: list[torch.Tensor] = []
    checked: list[int] = []
    cosine, after = dyllm_rounds.context_cosine, DyLLMRound.after

    def keep(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        cosines.append(cosine(new, old))
        return cosines[-1]

    def watched(self: DyLLMRound, *args: Any) -> torch.Tensor:
        out = after(self, *args)
        sim, chosen = cosines[-1].tolist(), self.chosen.tolist()  # type: ignore[union-attr]
        at = 0
        for e, n in zip(self.edits, self.sizes, strict=True):
            share = e.session.dyllm.replay_ffn_frac
            if share is not None and not e.full:
                want = sorted(range(n), key=lambda i: (sim[at + i], i))[: exact_ceil(share, n)]
                assert [i for i in range(n) if chosen[at + i]] == sorted(want)
                checked.append(n)
            at += n
        return out

    mp.setattr(dyllm_rounds, "context_cosine", keep)
    mp.setattr(DyLLMRound, "after", watched)
    return checked


def _ffn_rows(cache: dict, layers: int, rows: int, gen: int, lead: int, share: float) -> int:
    """FFN rows a forced decode runs, from its step counts: FullSteps every local row, each SparseStep
    ``ceil(f x queried rows)`` per layer (the full sequence, or the response and ``lead`` rows before)."""
    sparse = cache["forwards"] - cache["full_steps"]
    response = cache["response_only_steps"]
    per_step = (sparse - response) * exact_ceil(share, rows) + response * exact_ceil(share, gen + lead)
    return layers * (cache["full_steps"] * rows + per_step)


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_forced_dyllm_layers_make_the_most_drifted_rows_salient(family: str) -> None:
    m = tiny_model(family, seed=0, num_layers=4)
    pool = pool_for(m, pages=256)
    prompts = [ids(10 + i, 50 + i) for i in range(len(CONFIGS))]
    built = [StaticDecode(p, None, g, cache_policy=c) for p, g, c in zip(prompts, GENS, CONFIGS, strict=True)]
    with pytest.MonkeyPatch.context() as mp:
        checked = _spy_layers(mp)
        sessions = [dyllm_session(pool, m, b) for b in built]
        run_rounds(round_forward("eager", m, pool), sessions)
    assert len(checked) > 20
    lead = 1 if m.config.shift_logits else 0
    for s, p, g, c in zip(sessions, prompts, GENS, CONFIGS, strict=True):
        want = _reference(m, p, g, c)
        got = s.result()
        assert (got.raw_tokens, got.cache) == (want.raw_tokens, want.cache), c
        if c.replay_ffn_frac is not None:  # the reference's count too, from its own step counts
            rows = len(p) + g.gen_length
            ffn = _ffn_rows(got.cache, m.config.num_layers, rows, g.gen_length, lead, c.replay_ffn_frac)
            assert got.cache["rows_forwarded"] == ffn
