"""FOCUS (``decode_service/policies/focus.py``, its reference loop ``tests/reference/focus.py``) on tiny fp32
SDAR models of 4 layers (layers >= 2 exist to evict from), block by block over the exact cache; Dream and
LLaDA refuse it (SDAR only).

Identities: a budget of the block length evicts nothing; without the intra-block cache every step then
forwards every row and equals plain decoding token for token, in the reference loop and in the decode
worker's rounds. The sampler chooses among the eligible rows only.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pdllm.decode_service.policies.focus import ONLY_SDAR, FocusConfig
from pdllm.decode_service.worker import DecodeWorker
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.generation.sampler import DenoiseState, GenerationConfig
from pdllm.shared.model.transformer import DiffusionLM
from tests.reference.focus import generate_focus_block_diffusion
from tests.reference.vanilla import generate_vanilla

from ..model.helpers import tiny_model

PROMPTS = [
    [1, 17, 33, 8, 61, 5, 40, 22, 9, 70, 11, 3, 58],
    [1, 5, 6, 7, 8, 9, 10],
    [4, 44, 55, 66, 3, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24],
]
# (gen_length, steps, block_length, threshold)
SCHEDULES = [(16, 16, 4, None), (16, 8, 8, None), (16, 16, 8, 0.05), (16, 16, 16, 0.04)]
PAPER = FocusConfig()  # alpha 1.5, MaxPool kernel 3, intra-block cache on


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny forwards gain nothing from a second thread, and on a busy 2-core box the idle OpenMP worker's
    spin-waiting makes them ~40x slower; the previous setting is restored after this module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(family: str, seed: int = 0) -> DiffusionLM:
    return tiny_model(family, seed=seed, num_layers=4)


def _gen(gen: int, steps: int, block: int | None, threshold: float | None, **kw: Any) -> GenerationConfig:
    return GenerationConfig(
        gen_length=gen, steps=steps, block_length=block, threshold=threshold, stop_at_eos=False, **kw
    )


@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
def test_budget_of_the_block_without_the_intra_block_cache_is_plain_decoding(schedule: tuple) -> None:
    model, gen = _model("sdar", seed=1), _gen(*schedule)
    plain = generate_vanilla(model, PROMPTS[0], gen)
    for focus in (
        FocusConfig(budget=gen.block, delayed_cache=False),
        FocusConfig(alpha=1e6, delayed_cache=False),
    ):
        out = generate_focus_block_diffusion(model, torch.tensor(PROMPTS[0]), gen, focus)
        assert out.raw_tokens == plain.raw_tokens and out.steps == plain.steps
        assert out.cache["rows_forwarded"] == out.cache["rows_plain"] and out.cache["evicted"] == 0
    knobs = {"focus_budget": gen.block, "focus_delayed_cache": "off"}
    rounds = DecodeWorker(model).vanilla(PROMPTS[0], gen, DecodePolicyConfig("focus", focus=knobs))
    assert rounds.raw_tokens == plain.raw_tokens


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_dream_and_llada_are_refused(family: str) -> None:
    """FOCUS runs on SDAR only: the reference loop and the decode worker refuse a Dream/LLaDA model before
    any forward, with one message."""
    gen, model = _gen(8, 8, 4, None), _model(family)
    with pytest.raises(ValueError, match=rf"^{re.escape(ONLY_SDAR)} \(got '{family}'\)$"):
        generate_focus_block_diffusion(model, torch.tensor(PROMPTS[0]), gen, PAPER)
    worker = DecodeWorker(model)
    for run in (
        lambda: worker.vanilla(PROMPTS[0], gen, DecodePolicyConfig("focus")),
        lambda: worker.decode_job(PROMPTS[0][3:], None, gen, DecodePolicyConfig("focus")),  # type: ignore[arg-type]
    ):
        with pytest.raises(ValueError, match=rf"^{re.escape(ONLY_SDAR)}$"):
            run()


def test_a_one_layer_model_is_refused() -> None:
    with pytest.raises(ValueError, match="needs a model of >= 2 layers"):
        DecodeWorker(tiny_model("sdar", num_layers=1)).vanilla(
            PROMPTS[0], _gen(8, 8, 4, None), DecodePolicyConfig("focus")
        )


def test_sampler_chooses_among_eligible_rows_only() -> None:
    mask = 96
    conf = torch.tensor([0.9, 0.2, 0.8, 0.1])
    tokens = torch.tensor([5, 6, 7, 8])
    eligible = torch.tensor([False, True, True, True])
    state = DenoiseState(_gen(4, 2, None, None), mask, None)
    assert state.quota() == 2
    assert state.apply(tokens, conf, eligible).tolist() == [2, 1]  # not 0, the most confident
    state = DenoiseState(_gen(4, 4, None, 0.5), mask, None)
    assert state.quota() is None and state.apply(tokens, conf, eligible).tolist() == [2]
    state = DenoiseState(_gen(4, 4, None, 0.95), mask, None)
    assert state.apply(tokens, conf, eligible).tolist() == [2]  # the fallback argmax skips row 0
    state = DenoiseState(_gen(4, 1, None, None), mask, None)  # one step: the last, all eligible rows
    assert state.apply(tokens, conf, eligible).tolist() == [2, 1, 3] and not state.done
    assert state.apply(tokens[:1], conf[:1]).tolist() == [0] and state.done  # the extra step acts as last
    with pytest.raises(ValueError, match="eligible must mark >= 1"):
        DenoiseState(_gen(4, 4, None, None), mask, None).apply(tokens, conf, torch.zeros(4, dtype=torch.bool))
    logits = F.one_hot(torch.tensor([1, 2, 3, 4]), 97).float()
    assert DenoiseState(_gen(4, 4, None, None), mask, None).update(logits, eligible).numel() == 1
