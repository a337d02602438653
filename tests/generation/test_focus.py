"""FOCUS (``decode_service/policies/focus.py``, its reference loop ``tests/reference/focus.py``) on tiny fp32
models of 4 layers (layers >= 2 exist to evict from): SDAR block by block over its exact cache, Dream and
LLaDA under the semi-AR blocks, vanilla and over a pdllm-style static KV backend.

Identities: a budget of the block length evicts nothing; without the intra-block cache every step then
forwards every row and equals plain decoding token for token, in the reference loop and in the decode
worker's rounds. The importance (Eq. 2) and the selection (Algorithm 1), one request's and the vectorized
ones the rounds use, are held to from-scratch computations.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pdllm.decode_service.policies.focus import FocusConfig
from pdllm.decode_service.worker import DecodeWorker
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.generation.sampler import DenoiseState, GenerationConfig, GenerationResult, denoise
from pdllm.shared.model.attention import AttentionBackend, DenseAttention, PrefixAttention, RecordKV
from pdllm.shared.model.transformer import DiffusionLM
from tests.reference.focus import (
    FocusLogits,
    generate_focus_block_diffusion,
    run_focus,
)
from tests.reference.vanilla import generate_vanilla

from ..model.helpers import tiny_model

PROMPTS = [
    [1, 17, 33, 8, 61, 5, 40, 22, 9, 70, 11, 3, 58],
    [1, 5, 6, 7, 8, 9, 10],
    [4, 44, 55, 66, 3, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24],
]
FAMILIES = ["sdar", "dream", "llada"]
# (gen_length, steps, block_length, threshold)
SCHEDULES = [(16, 16, 4, None), (16, 8, 8, None), (16, 16, 8, 0.05), (16, 16, 16, 0.04)]
PAPER = FocusConfig()  # alpha 1.5, MaxPool kernel 3, intra-block cache on
OTHER = FocusConfig(alpha=1.2, pool_kernel=5, delayed_cache=False)
FIXED = FocusConfig(budget=2, pool_kernel=1)


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


def _local(
    model: DiffusionLM, head: list[int], gen: GenerationConfig, first: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    local = torch.tensor(head + [model.config.mask_token_id] * gen.gen_length)
    return local, torch.arange(first, first + local.numel())


def _reference(
    model: DiffusionLM,
    head: list[int],
    gen: GenerationConfig,
    focus: FocusConfig,
    inner: AttentionBackend | None = None,
    first: int = 0,
) -> GenerationResult:
    if model.config.block_size is not None:
        return generate_focus_block_diffusion(model, torch.tensor(head), gen, focus)
    local, positions = _local(model, head, gen, first)
    return run_focus(
        FocusLogits(model, local, positions[None], len(head), gen, focus, inner or DenseAttention())
    )


def _static(model: DiffusionLM, length: int) -> PrefixAttention:
    """pdllm's static chunk KV, as the method's backend reads it: K/V of ``length`` context tokens."""
    ids = torch.randint(3, 90, (1, length), generator=torch.Generator().manual_seed(length))
    record = RecordKV(DenseAttention())
    with torch.inference_mode():
        model.hidden_states(ids, attention=record)
    return PrefixAttention(list(zip(record.keys, record.values, strict=True)))


def _plain_over(
    model: DiffusionLM, head: list[int], gen: GenerationConfig, inner: AttentionBackend, first: int
) -> GenerationResult:
    """Plain decoding over the static KV (every local row every step), the reference's own loop."""
    local, positions = _local(model, head, gen, first)
    p = len(head)

    def logits_fn(response: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        local[p:] = response
        return model(local[None], positions[None], inner, logits_at=(at + p)[None])[0]

    with torch.inference_mode():
        return denoise(gen, model.config.mask_token_id, model.config.eos_token_id, logits_fn)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
def test_budget_of_the_block_without_the_intra_block_cache_is_plain_decoding(
    family: str, schedule: tuple
) -> None:
    model, gen = _model(family, seed=1), _gen(*schedule)
    plain = generate_vanilla(model, PROMPTS[0], gen)
    for focus in (
        FocusConfig(budget=gen.block, delayed_cache=False),
        FocusConfig(alpha=1e6, delayed_cache=False),
    ):
        out = _reference(model, PROMPTS[0], gen, focus)
        assert out.raw_tokens == plain.raw_tokens and out.steps == plain.steps
        assert out.cache["rows_forwarded"] == out.cache["rows_plain"] and out.cache["evicted"] == 0
    knobs = {"focus_budget": gen.block, "focus_delayed_cache": "off"}
    rounds = DecodeWorker(model).vanilla(PROMPTS[0], gen, DecodePolicyConfig("focus", focus=knobs))
    assert rounds.raw_tokens == plain.raw_tokens


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_budget_of_the_block_over_static_kv_is_plain_decoding(family: str) -> None:
    """Composed with chunk selection: the method's backend reads the static KV, FOCUS sees local rows."""
    model, gen = _model(family, seed=2), _gen(16, 16, 8, None)
    inner = _static(model, 20)
    plain = _plain_over(model, PROMPTS[1], gen, inner, first=20)
    out = _reference(model, PROMPTS[1], gen, FocusConfig(budget=8, delayed_cache=False), inner, first=20)
    assert out.raw_tokens == plain.raw_tokens
    evicting = _reference(model, PROMPTS[1], gen, PAPER, inner, first=20)
    assert evicting.cache["evicted"] > 0 and evicting.steps == plain.steps  # the schedule is kept


def test_unsupported_families_are_refused() -> None:
    gen = _gen(8, 8, 4, None)
    with pytest.raises(ValueError, match="runs block by block over the exact cache"):
        FocusLogits(tiny_model("sdar", num_layers=4), *_pair(gen), 3, gen, PAPER, DenseAttention())
    with pytest.raises(ValueError, match="block-diffusion decoding runs on SDAR models; 'dream'"):
        generate_focus_block_diffusion(_model("dream"), torch.tensor(PROMPTS[0]), gen, PAPER)
    with pytest.raises(ValueError, match="needs a model of >= 2 layers"):
        DecodeWorker(tiny_model("llada", num_layers=1)).vanilla(PROMPTS[0], gen, DecodePolicyConfig("focus"))


def _pair(gen: GenerationConfig) -> tuple[torch.Tensor, torch.Tensor]:
    local = torch.tensor([1, 2, 3] + [96] * gen.gen_length)
    return local, torch.arange(local.numel())[None]


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
