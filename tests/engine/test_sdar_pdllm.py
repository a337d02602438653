"""The pdllm engine on SDAR (block diffusion), in process: selection as usual, then exact block diffusion.

Spec: ``engine.generate`` equals :func:`generate_block_diffusion` on ``[instruction][BOS c_i for the chunks
the engine itself selected, document order][query]`` token for token (tiny random fp32 models, CPU); under
decode policy focus it equals vanilla FOCUS (:func:`generate_focus_block_diffusion`) on that prompt, tokens and
counters, and with a budget of the block and no intra-block cache (nothing evicted) plain pdllm itself.
"""

from __future__ import annotations

import pytest
import torch

from pdllm.decode_service import sdar_decode
from pdllm.decode_service.block_diffusion import (
    BlockKVCache,
    answer_spans,
    prefill_blocks,
)
from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.config import EngineConfig
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.layout import decode_layout
from tests.reference import sdar
from tests.reference.block_diffusion import generate_block_diffusion
from tests.reference.focus import generate_focus_block_diffusion

from ..model.helpers import tiny_model
from .helpers import model as tiny
from .helpers import tokens

BOS = 1
CHUNK = 8  # 40 context tokens: 5 chunks of 9 tokens with their BOS

# (seed, instruction len, query len, top_k, gen_length, steps, block_length); model block size 4.
# static = instruction + 9 * top_k, prompt = static + query.
CASES = [
    (0, 2, 4, 2, 16, 16, 4),  # static 20, prompt 24: both on block boundaries
    (1, 3, 5, 2, 16, 8, 8),  # static 21, prompt 26: both off; the static tail is decoded with the answer
    (2, 0, 3, 2, 12, 12, 4),  # static 18, prompt 21: no instruction
    (3, 1, 2, 3, 16, 16, 8),  # static 28, prompt 30: the static prefix ends inside the last partial block
    (4, 5, 7, 1, 8, 8, 8),  # static 14, prompt 21
    (5, 2, 6, 3, 24, 12, 12),  # static 29, prompt 35: generation block of 3 model blocks
]


def _run(
    seed: int,
    instr: int,
    query: int,
    top_k: int,
    gen: GenerationConfig,
    kv_mode: str = "full-mask",
    decode_policy: DecodePolicyConfig | None = None,
    layers: int = 2,
):
    model = tiny("sdar", seed=seed) if layers == 2 else tiny_model("sdar", seed=seed, num_layers=layers)
    cfg = EngineConfig(chunk_size=CHUNK, top_k=top_k, kv_mode=kv_mode)  # type: ignore[arg-type]
    engine = PrefillingEngine(model, config=cfg, reuse_chunks=False)
    context, question = tokens(40, seed), tokens(query, seed + 100)
    instruction = tokens(instr, seed + 200)
    result, trace = engine.generate(
        context, question, gen, instruction_ids=instruction, decode_policy=decode_policy
    )
    chunks = [[BOS, *context[i * CHUNK : (i + 1) * CHUNK]] for i in trace.selected]
    prompt = instruction + [t for c in chunks for t in c] + question
    return model, result, trace, prompt


@pytest.mark.parametrize(("seed", "instr", "query", "top_k", "gen_len", "steps", "block"), CASES)
def test_engine_equals_block_diffusion_on_the_selected_prompt(
    seed: int, instr: int, query: int, top_k: int, gen_len: int, steps: int, block: int
) -> None:
    gen = GenerationConfig(gen_length=gen_len, steps=steps, block_length=block, stop_at_eos=False)
    model, result, trace, prompt = _run(seed, instr, query, top_k, gen)
    expected = generate_block_diffusion(model, torch.tensor(prompt), gen)
    assert len(trace.selected) == top_k and trace.kept_tokens == [CHUNK + 1] * top_k
    assert result.raw_tokens == expected.raw_tokens and result.token_ids == expected.token_ids
    assert result.steps == expected.steps == trace.decode_steps
    assert {"build", "decode"} <= set(result.timings)


def test_chunk_query_equals_full_mask_and_threshold_runs() -> None:
    # On SDAR both modes build the same cache: the query and the response are in later blocks.
    gen = GenerationConfig(gen_length=16, steps=16, block_length=8, threshold=0.05, stop_at_eos=False)
    model, full, _, prompt = _run(6, 3, 5, 2, gen, "full-mask")
    _, query, _, _ = _run(6, 3, 5, 2, gen, "chunk-query")
    assert full.raw_tokens == query.raw_tokens
    assert full.raw_tokens == generate_block_diffusion(model, torch.tensor(prompt), gen).raw_tokens


def test_prefix_cache_covers_whole_static_blocks_only() -> None:
    model = tiny("sdar", seed=0)
    engine = PrefillingEngine(model, config=EngineConfig(chunk_size=CHUNK, top_k=2), reuse_chunks=False)
    gen = GenerationConfig(gen_length=8, steps=8, block_length=8)
    for query, cached in ((5, 20), (2, 16)):
        sel = engine.prefill(tokens(40, 0), tokens(query, 1), gen, tokens(3, 2))
        layout = decode_layout(sel.request, sel.selected, gen.gen_length)
        cache = sdar_decode.build_prefix(model, sel.request, layout, gen)
        # Static 21: its whole model blocks end at 20. With prompt 23 the prompt's last whole generation
        # block ends at 16, and [16, 20) must be decoded with the query and the answer.
        assert layout.static_len == 21 and cache.length == cached
        assert cache.capacity == 21 + query + 8


def test_misaligned_prefix_is_refused() -> None:
    model = tiny("sdar")
    prompt = torch.tensor(tokens(9, 0))
    gen = GenerationConfig(gen_length=8, steps=8, block_length=4)
    cache = BlockKVCache(17, 4)
    prefill_blocks(model, cache, prompt, 8)
    assert generate_block_diffusion(model, prompt, gen, prefix=cache).raw_tokens == (
        generate_block_diffusion(model, prompt, gen).raw_tokens
    )
    long = BlockKVCache(17, 4)
    prefill_blocks(model, long, torch.tensor(tokens(12, 0)), 12)
    with pytest.raises(ValueError, match="must end on a model block boundary .* before"):
        generate_block_diffusion(model, prompt, gen, prefix=long)


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (EngineConfig(kv_mode="chunk-only"), r"kv_mode='chunk-only' is not supported .* SDAR"),
        (EngineConfig(top_b=4), r"top_b=4 is not supported .* SDAR"),
    ],
)
def test_unsupported_settings_are_refused(cfg: EngineConfig, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PrefillingEngine(tiny("sdar"), config=cfg, reuse_chunks=False)
    engine = PrefillingEngine(tiny("sdar"), reuse_chunks=False)  # a per-request config is checked too
    with pytest.raises(ValueError, match=match):
        engine.prefill(
            tokens(40, 0), tokens(4, 1), GenerationConfig(gen_length=8, steps=8, block_length=4), config=cfg
        )


@pytest.mark.parametrize("name", ["dyllm", "dual-cache", "prefix-cache", "sparse-dllm", "polestar"])
def test_decode_policies_but_focus_are_refused(name: str) -> None:
    engine = PrefillingEngine(tiny("sdar"), config=EngineConfig(chunk_size=CHUNK), reuse_chunks=False)
    gen = GenerationConfig(gen_length=8, steps=8, block_length=4)
    with pytest.raises(ValueError, match=f"decode policy '{name}' is not supported .* SDAR"):
        engine.generate(tokens(40, 0), tokens(4, 1), gen, decode_policy=DecodePolicyConfig(name=name))


def test_unsupported_decode_options_are_refused() -> None:
    engine = PrefillingEngine(tiny("sdar"), config=EngineConfig(chunk_size=CHUNK), reuse_chunks=False)
    with pytest.raises(ValueError, match="block_length is 6, .* multiple of 4"):
        engine.generate(
            tokens(40, 0), tokens(4, 1), GenerationConfig(gen_length=12, steps=12, block_length=6)
        )


# FOCUS on 4 layers (layers >= 2 exist to evict from): (case index into CASES, focus knobs).
FOCUS_CASES = [
    (1, {}),  # the paper's defaults: dynamic budget, intra-block cache on
    (3, {"focus_alpha": 1.2, "focus_pool_kernel": 5, "focus_delayed_cache": "off"}),
    (5, {"focus_budget": 2}),
    (0, {"focus_budget": 1, "focus_delayed_cache": "off"}),
]


@pytest.mark.parametrize(("case", "knobs"), FOCUS_CASES, ids=["paper", "alpha-k5-nocache", "b2", "b1"])
def test_focus_equals_vanilla_focus_on_the_selected_prompt(case: int, knobs: dict) -> None:
    seed, instr, query, top_k, gen_len, steps, block = CASES[case]
    gen = GenerationConfig(gen_length=gen_len, steps=steps, block_length=block, stop_at_eos=False)
    policy = DecodePolicyConfig("focus", focus=knobs)
    model, result, trace, prompt = _run(seed, instr, query, top_k, gen, decode_policy=policy, layers=4)
    expected = generate_focus_block_diffusion(model, torch.tensor(prompt), gen, policy.focus_config())
    assert result.raw_tokens == expected.raw_tokens and result.steps == expected.steps == trace.decode_steps
    assert result.cache == expected.cache and result.cache["policy"] == "focus"
    assert result.cache["forwards"] == result.steps and result.cache["evicted"] > 0  # FOCUS did evict
    assert {"build", "decode"} <= set(result.timings)


@pytest.mark.parametrize(("seed", "instr", "query", "top_k", "gen_len", "steps", "block"), CASES)
def test_focus_evicting_nothing_equals_plain_pdllm(
    seed: int, instr: int, query: int, top_k: int, gen_len: int, steps: int, block: int
) -> None:
    """A budget of the block evicts nothing; without the intra-block cache every step then forwards every
    row of the window: exactly the plain block diffusion over the same prefix."""
    gen = GenerationConfig(gen_length=gen_len, steps=steps, block_length=block, stop_at_eos=False)
    focus = DecodePolicyConfig("focus", focus={"focus_budget": block, "focus_delayed_cache": "off"})
    _, plain, plain_trace, _ = _run(seed, instr, query, top_k, gen, layers=4)
    _, result, trace, _ = _run(seed, instr, query, top_k, gen, decode_policy=focus, layers=4)
    assert trace.selected == plain_trace.selected
    assert result.raw_tokens == plain.raw_tokens and result.token_ids == plain.token_ids
    assert result.steps == plain.steps and plain.cache == {}
    assert result.cache["evicted"] == 0 and result.cache["rows_forwarded"] == result.cache["rows_plain"]


@pytest.mark.parametrize("policy", [None, DecodePolicyConfig("focus")], ids=["plain", "focus"])
def test_decode_continues_the_prefix_in_place(policy: DecodePolicyConfig | None) -> None:
    """Step 7 runs over the step-6 prefix itself (any policy): the finished blocks land in that very cache."""
    model = tiny_model("sdar", seed=1, num_layers=4)
    engine = PrefillingEngine(model, config=EngineConfig(chunk_size=CHUNK, top_k=2), reuse_chunks=False)
    gen = GenerationConfig(gen_length=16, steps=16, block_length=4, stop_at_eos=False)
    sel = engine.prefill(tokens(40, 1), tokens(5, 101), gen, tokens(3, 201))
    layout = decode_layout(sel.request, sel.selected, gen.gen_length)
    prefix = sdar_decode.build_prefix(model, sel.request, layout, gen)
    built = prefix.length
    result = sdar.decode(model, sel.request, layout, prefix, gen, decode_policy=policy)
    prompt = layout.static_len + layout.query_len
    last = answer_spans(prompt, gen.gen_length, 4)[-1][0]  # every answer block but the last is recorded
    assert built > 0 and prefix.length == prompt + last
    assert result.cache.get("policy") == (policy.name if policy else None)
