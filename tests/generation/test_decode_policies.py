"""Decode policies (Fast-dLLM prefix / dual cache) on the vanilla path, tiny fp32 Dream and LLaDA models.

Exact identities: a cache refreshed every step, or one step per block, is plain decoding; with one block
the prefix cache and the dual cache forward the same rows. The cached steps themselves are held to a second,
from-scratch implementation (``straightforward_cache.py``). With a single block the prefix cache is *not*
plain decoding: the prompt's K/V beyond layer 0 depend on the response, which the cache freezes at the
block's first step (``test_cached_step_really_reuses_stale_kv``).
"""

from __future__ import annotations

import pytest
import torch

from pdllm.decode_service.policies import (
    DecodePolicyConfig,
    DualCache,
    StepContext,
    StepPlan,
)
from pdllm.shared.generation.plain import vanilla_logits_fn
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.model.attention import DenseAttention
from pdllm.shared.settings import SettingError
from tests.reference.policy import PolicyLogits, denoise_with_policy
from tests.reference.vanilla import generate_vanilla

from ..model.helpers import tiny_model
from .straightforward_cache import straightforward_cache_loop

PROMPT = [1, 17, 33, 8, 61, 5, 40, 22, 9]
POLICIES = ["prefix-cache", "dual-cache"]
# (gen_length, steps, block_length, threshold)
SCHEDULES = [(16, 16, 4, None), (16, 8, 8, None), (12, 12, 6, 0.15), (16, 16, 4, 0.2)]


def _gen(gen: int, steps: int, block: int | None, threshold: float | None) -> GenerationConfig:
    return GenerationConfig(
        gen_length=gen, steps=steps, block_length=block, threshold=threshold, stop_at_eos=False
    )


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
def test_refresh_every_step_is_plain_decoding(family: str, name: str, schedule: tuple) -> None:
    model, gen = tiny_model(family), _gen(*schedule)
    plain = generate_vanilla(model, PROMPT, gen)
    cached = generate_vanilla(model, PROMPT, gen, policy=DecodePolicyConfig(name, refresh_steps=1))
    assert cached.raw_tokens == plain.raw_tokens
    assert cached.steps == plain.steps == cached.cache["refreshes"]


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("name", POLICIES)
def test_one_step_per_block_is_plain_decoding(family: str, name: str) -> None:
    # every step is a block's first step, hence a refresh
    model, gen = tiny_model(family, seed=2), _gen(16, 4, 4, None)
    cached = generate_vanilla(model, PROMPT, gen, policy=DecodePolicyConfig(name))
    assert cached.raw_tokens == generate_vanilla(model, PROMPT, gen).raw_tokens


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("threshold", [None, 0.1])
def test_single_block_prefix_cache_is_dual_cache(family: str, threshold: float | None) -> None:
    model, gen = tiny_model(family, seed=3), _gen(12, 12, None, threshold)
    prefix = generate_vanilla(model, PROMPT, gen, policy=DecodePolicyConfig("prefix-cache"))
    dual = generate_vanilla(model, PROMPT, gen, policy=DecodePolicyConfig("dual-cache"))
    assert prefix.raw_tokens == dual.raw_tokens
    assert prefix.cache["rows_forwarded"] == dual.cache["rows_forwarded"]


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_straightforward_loop(family: str, name: str, schedule: tuple, seed: int) -> None:
    model, gen = tiny_model(family, seed=seed), _gen(*schedule)
    policy = DecodePolicyConfig(name)
    cached = generate_vanilla(model, PROMPT, gen, policy=policy)
    assert (
        cached.raw_tokens == generate_vanilla(model, PROMPT, gen, policy=policy).raw_tokens
    )  # deterministic
    g, steps, block, threshold = schedule
    expected = straightforward_cache_loop(model, PROMPT, g, block, steps, name == "dual-cache", threshold)
    assert cached.raw_tokens == expected
    assert cached.cache["refreshes"] == g // block  # exactly one refresh per block
    assert model.config.mask_token_id not in cached.raw_tokens


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_rows_forwarded_per_step(family: str) -> None:
    """Dual cache: a cached step forwards the block (+ the row before it on Dream); prefix cache: the
    block and every row after it."""
    model, gen = tiny_model(family), _gen(16, 16, 4, None)
    lead, n = int(family == "dream"), len(PROMPT) + 16
    dual = generate_vanilla(model, PROMPT, gen, policy=DecodePolicyConfig("dual-cache")).cache
    assert dual["rows_forwarded"] == 4 * n + 12 * (4 + lead)
    prefix = generate_vanilla(model, PROMPT, gen, policy=DecodePolicyConfig("prefix-cache")).cache
    after = sum(n - (len(PROMPT) + 4 * b) + lead for b in range(4))  # rows from each block's start
    assert prefix["rows_forwarded"] == 4 * n + 3 * after
    assert dual["cache_bytes"] == 2 * 2 * 2 * n * 16 * 4  # layers, K/V, kv heads, rows, head dim, fp32


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_cached_step_really_reuses_stale_kv(family: str) -> None:
    """A cached step's logits differ from a fresh forward once the block has changed (the prompt and the
    later blocks keep their K/V from the refresh); with nothing changed they agree."""
    model, gen = tiny_model(family), _gen(8, 8, 4, None)
    prompt = torch.tensor(PROMPT)
    mask = model.config.mask_token_id
    local = torch.cat([prompt, torch.full((8,), mask)])
    positions = torch.arange(local.numel())[None]
    fn = PolicyLogits(model, local, positions, len(PROMPT), gen, DualCache(), DenseAttention())
    plain = vanilla_logits_fn(model, prompt, 8)
    response = torch.full((8,), mask)
    at = torch.arange(4)
    with torch.inference_mode():
        fn(response, at)  # the refresh
        same = fn(response, at)
        torch.testing.assert_close(same, plain(response, at), rtol=1e-5, atol=1e-5)
        response[0] = 42
        stale, fresh = fn(response, at[1:]), plain(response, at[1:])
    assert not torch.allclose(stale, fresh, atol=1e-4)


class _ForgetsTheRowBefore:
    name = "broken"

    def plan(self, ctx: StepContext) -> StepPlan:
        return (
            StepPlan.full(ctx) if ctx.step_in_block == 0 else StepPlan(False, ctx.block_start, ctx.block_end)
        )


def test_plan_must_cover_the_rows_the_logits_come_from() -> None:
    model, gen = tiny_model("dream"), _gen(8, 8, 4, None)
    local = torch.tensor(PROMPT + [model.config.mask_token_id] * 8)
    positions = torch.arange(local.numel())[None]
    with pytest.raises(ValueError, match=r"must cover rows \[8, 13\)"):
        denoise_with_policy(
            model, local, positions, len(PROMPT), gen, _ForgetsTheRowBefore(), DenseAttention()
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"name": "sparse"},
            "decode_policy must be one of none, prefix-cache, dual-cache, sparse-dllm, polestar, dyllm, focus (got 'sparse')",
        ),
        ({"name": "dual-cache", "refresh_steps": 0}, "cache_refresh_steps must be in [1, 4096] (got 0)"),
        ({"name": "none", "refresh_steps": 2}, "cache_refresh_steps needs a caching decode_policy"),
    ],
)
def test_bad_config_is_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(SettingError) as err:
        DecodePolicyConfig(**kwargs)
    assert message in str(err.value)


def test_none_policy_is_the_plain_loop() -> None:
    model, gen = tiny_model("llada"), _gen(8, 8, 4, None)
    result = generate_vanilla(model, PROMPT, gen, policy=DecodePolicyConfig())
    assert result.raw_tokens == generate_vanilla(model, PROMPT, gen).raw_tokens and result.cache == {}
