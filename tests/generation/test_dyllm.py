"""DyLLM (``policies/dyllm_base.py``) on tiny fp32 Dream and LLaDA models: its reference loop
(``tests/reference/dyllm.py``) and its fast path (the decode worker's rounds).

Exact identities: τ = 1 with every step querying the full sequence is plain decoding (tokens, and logits at
every step), vanilla and over static KV (pdllm's composition); a forward whose tokens did not change
computes no row and returns the last logits. The approximate attention of eq. 3 is held to a from-scratch
softmax at the first layer. The fast path is held to the reference token for token, with its counters.
"""

from __future__ import annotations

import pytest
import torch

from pdllm.decode_service.worker import DecodeWorker
from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.config import EngineConfig
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.generation.plain import vanilla_logits_fn
from pdllm.shared.generation.sampler import DenoiseState, GenerationConfig, GenerationResult, denoise
from pdllm.shared.model.attention import DenseAttention, PrefixAttention
from pdllm.shared.model.transformer import DiffusionLM, apply_rope
from tests.reference.dyllm import (
    DyLLMConfig,
    DyLLMLogits,
    denoise_with_dyllm,
    step_kind,
    vanilla_dyllm_logits,
)
from tests.reference.policy import run_policy
from tests.reference.static_kv import StaticPolicy, decode_logits_fn, local_inputs
from tests.reference.vanilla import generate_vanilla

from ..engine.helpers import tokens
from ..model.helpers import tiny_model

PROMPT = [1, 17, 33, 8, 61, 5, 40, 22, 9, 70, 11, 3, 58]
# (gen_length, steps, block_length, confidence threshold): several blocks, fixed schedule and threshold.
SCHEDULES = [(16, 16, 4, None), (16, 8, 8, None), (12, 12, 6, 0.15)]
PLAIN = DyLLMConfig(threshold=1.0, full_steps=1, full_sequence_interval=1)
PATHS = {"reference": DyLLMLogits}


def _gen(gen: int, steps: int, block: int | None, threshold: float | None) -> GenerationConfig:
    return GenerationConfig(
        gen_length=gen, steps=steps, block_length=block, threshold=threshold, stop_at_eos=False
    )


def _vanilla(model: DiffusionLM, gen: GenerationConfig, config: DyLLMConfig, fast: bool) -> GenerationResult:
    """The reference loop (``fast`` False) or the decode worker's rounds, in process."""
    if not fast:
        return run_policy(vanilla_dyllm_logits(model, torch.tensor(PROMPT), gen, config))
    knobs = {
        "dyllm_full_steps": config.full_steps,
        "dyllm_full_sequence_interval": config.full_sequence_interval,
        "dyllm_approximate_attention": "on" if config.approximate_attention else "off",
    }
    if config.threshold is not None:
        knobs["dyllm_threshold"] = config.threshold
    return DecodeWorker(model).vanilla(PROMPT, gen, DecodePolicyConfig("dyllm", dyllm=knobs))


def _vanilla_args(model: DiffusionLM, gen: GenerationConfig) -> tuple[torch.Tensor, torch.Tensor, int]:
    local = torch.tensor(PROMPT + [model.config.mask_token_id] * gen.gen_length)
    return local, torch.arange(local.numel())[None], len(PROMPT)


def _same_counters(a: GenerationResult, b: GenerationResult) -> bool:
    return a.cache == b.cache


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("fast", [False, True], ids=["reference", "rounds"])
def test_threshold_one_is_plain_decoding(family: str, schedule: tuple, seed: int, fast: bool) -> None:
    model, gen = tiny_model(family, seed=seed), _gen(*schedule)
    plain = generate_vanilla(model, PROMPT, gen)
    dyllm = _vanilla(model, gen, PLAIN, fast)
    assert dyllm.raw_tokens == plain.raw_tokens and dyllm.steps == plain.steps
    assert dyllm.cache["rows_forwarded"] == dyllm.cache["kv_rows"] == dyllm.cache["rows_total"]


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("path", PATHS)
@torch.inference_mode()
def test_threshold_one_logits_match_plain_at_every_step(family: str, path: str) -> None:
    model, gen = tiny_model(family), _gen(12, 12, 6, None)
    prompt = torch.tensor(PROMPT)
    fn = PATHS[path](model, *_vanilla_args(model, gen), gen, PLAIN, DenseAttention())
    plain = vanilla_logits_fn(model, prompt, gen.gen_length)
    state = DenoiseState(gen, model.config.mask_token_id, model.config.eos_token_id)
    while not state.done:
        at = state.positions()
        expected = plain(state.tokens, at)
        torch.testing.assert_close(fn(state.tokens, at), expected, rtol=1e-5, atol=1e-5)
        state.update(expected)
    assert fn.stats.full_steps == 1 and fn.stats.forwards == 12


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("threshold", [None, 0.9], ids=["paper", "0.9"])
def test_rounds_match_reference(family: str, schedule: tuple, seed: int, threshold: float | None) -> None:
    model, gen = tiny_model(family, seed=seed), _gen(*schedule)
    for approximate in (True, False):
        config = DyLLMConfig(threshold=threshold, approximate_attention=approximate)
        reference, fast = _vanilla(model, gen, config, False), _vanilla(model, gen, config, True)
        assert fast.raw_tokens == reference.raw_tokens and fast.steps == reference.steps
        assert _same_counters(fast, reference)
        assert model.config.mask_token_id not in reference.raw_tokens


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_counters_at_the_paper_threshold(family: str) -> None:
    model, gen = tiny_model(family), _gen(16, 16, 4, None)
    result = _vanilla(model, gen, DyLLMConfig(), fast=True)
    c, n, layers = result.cache, len(PROMPT) + 16, model.config.num_layers
    kinds = [step_kind(s, DyLLMConfig()) for s in range(16)]
    assert c["policy"] == "dyllm" and c["forwards"] == 16 and c["rows_total"] == 16 * n * layers
    assert c["full_steps"] == kinds.count("full") == 4
    assert c["response_only_steps"] == kinds.count("response") == 9
    # the FullSteps compute everything; the SparseSteps only part of it
    assert 4 * n * layers < c["rows_forwarded"] < c["rows_total"]
    assert 4 * n * layers < c["kv_rows"] < c["rows_total"]
    assert generate_vanilla(model, PROMPT, gen).raw_tokens != result.raw_tokens  # it does approximate


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("path", PATHS)
@torch.inference_mode()
def test_unchanged_tokens_compute_no_row(family: str, path: str) -> None:
    """Nothing changed since the FullStep: no row is salient, and the cached activations rebuild the same
    residual stream, hence the same logits."""
    model, gen = tiny_model(family), _gen(8, 8, 4, None)
    fn = PATHS[path](model, *_vanilla_args(model, gen), gen, DyLLMConfig(full_steps=1), DenseAttention())
    response, at = torch.full((8,), model.config.mask_token_id), torch.arange(4)
    full = fn(response, at)
    rows, kv = fn.stats.rows_forwarded, fn.stats.kv_rows
    torch.testing.assert_close(fn(response, at), full, rtol=1e-5, atol=1e-5)
    assert (fn.stats.rows_forwarded, fn.stats.kv_rows) == (rows, kv)


@pytest.mark.parametrize("family", ["dream", "llada"])
@torch.inference_mode()
def test_first_layer_contexts_follow_equation_3(family: str) -> None:
    """After a FullStep, one token changes: at layer 0 its row attends exactly over the new K/V, every other
    row keeps its context plus its softmax weight on the changed row times that row's value change."""
    model, gen = tiny_model(family), _gen(8, 8, 4, None)
    config = DyLLMConfig(full_steps=1, full_sequence_interval=1)
    fns = [cls(model, *_vanilla_args(model, gen), gen, config, DenseAttention()) for cls in PATHS.values()]
    response, at = torch.full((8,), model.config.mask_token_id), torch.arange(4)
    for fn in fns:
        fn(response, at)
    before = fns[0].cache.contexts[0].clone()  # type: ignore[union-attr]
    old_v = fns[0].cache.values[0][0]  # type: ignore[union-attr]
    changed = len(PROMPT) + 2
    response[2] = 42
    for fn in fns:
        fn(response, at[at != 2])
    # from scratch: layer 0 sees the embeddings, so K/V change at the changed row only
    layer, c = model.model.layers[0], model.config
    cos, sin = model.model.rotary_emb(torch.arange(len(PROMPT) + 8)[None], torch.float32)
    h = layer.input_layernorm(model.model.embed_tokens(fns[0].local[None]))[0]
    attn = layer.self_attn
    q = apply_rope(attn.q_proj(h).view(1, -1, c.num_heads, c.head_dim).transpose(1, 2), cos, sin)[0]
    k = apply_rope(attn.k_proj(h).view(1, -1, c.num_kv_heads, c.head_dim).transpose(1, 2), cos, sin)[0]
    v = attn.v_proj(h).view(-1, c.num_kv_heads, c.head_dim).transpose(0, 1)
    group = c.num_heads // c.num_kv_heads
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [Hq, N, D]
    weights = torch.softmax(q @ k.transpose(1, 2) / c.head_dim**0.5, dim=-1)  # [Hq, N, N]
    # ΔV [Hq, D] of the changed row; every other row's is zero
    delta = v[:, changed] - old_v.repeat_interleave(group, 0)[:, changed]
    expected = before.view(-1, c.num_heads, c.head_dim) + (
        weights[:, :, changed, None] * delta[:, None]
    ).transpose(0, 1)
    expected[changed] = (weights[:, changed, None] @ v)[:, 0]
    for fn in fns:
        got = fn.cache.contexts[0].view(-1, c.num_heads, c.head_dim)  # type: ignore[union-attr]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _static_prefix(model: DiffusionLM, length: int, seed: int) -> PrefixAttention:
    gen, c = torch.Generator().manual_seed(seed), model.config
    shape = (1, c.num_kv_heads, length, c.head_dim)
    return PrefixAttention(
        [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(c.num_layers)]
    )


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("schedule", SCHEDULES[::2], ids=str)
def test_over_static_kv(family: str, schedule: tuple) -> None:
    """pdllm's composition: the backend adds static K/V that DyLLM never sees; τ = 1 is the plain step over
    it."""
    model, gen = tiny_model(family), _gen(*schedule)
    static, query = 20, PROMPT[:6]
    local = torch.tensor(query + [model.config.mask_token_id] * gen.gen_length)
    positions = torch.arange(static, static + local.numel())[None]
    backend = _static_prefix(model, static, seed=5)

    def plain_fn(response: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        local[len(query) :] = response
        return model(local[None], positions, backend, logits_at=(at + len(query))[None])[0]

    plain = denoise(gen, model.config.mask_token_id, model.config.eos_token_id, plain_fn)
    one = denoise_with_dyllm(model, local.clone(), positions, len(query), gen, PLAIN, backend)
    assert one.raw_tokens == plain.raw_tokens


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_over_pdllm_static_kv(family: str) -> None:
    """The decode worker's composition: chunk-selected static KV in the "buffer" backend."""
    gen = _gen(12, 12, 6, None)
    engine = PrefillingEngine(
        tiny_model(family),
        None,
        EngineConfig(chunk_size=12, top_k=2, kv_mode="full-mask"),
        decode_attention="torch",
    )
    query = tokens(6, 2)
    static = engine.build(engine.prefill(tokens(50, 1), query, gen, [5, 7, 9]), gen)
    model, mask, eos = engine.model, engine.model.config.mask_token_id, engine.model.config.eos_token_id
    plain = denoise(gen, mask, eos, decode_logits_fn(model, query, static, gen, StaticPolicy("buffer")))

    local, positions = local_inputs(model, query, static, gen)
    inner = StaticPolicy("buffer")
    inner.begin(static, local.shape[0])
    one = denoise_with_dyllm(model, local, positions, len(query), gen, PLAIN, inner.backend(0, local))
    assert one.raw_tokens == plain.raw_tokens


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"threshold": 0.0}, r"dyllm_threshold must be in \(0, 1\]"),
        ({"threshold": 1.5}, r"dyllm_threshold must be in \(0, 1\]"),
        ({"threshold": float("nan")}, r"dyllm_threshold must be in \(0, 1\]"),
        ({"threshold": True}, r"dyllm_threshold must be in \(0, 1\]"),
        ({"full_steps": 0}, r"dyllm_full_steps must be an integer >= 1, got 0"),
        ({"full_steps": 2.5}, r"dyllm_full_steps must be an integer >= 1"),
        ({"full_sequence_interval": -1}, r"dyllm_full_sequence_interval must be an integer >= 1, got -1"),
        ({"approximate_attention": 1}, r"dyllm_approximate_attention must be a bool"),
    ],
)
def test_bad_knobs_are_refused(knobs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DyLLMConfig(**knobs)


def test_paper_defaults_and_refusals() -> None:
    config = DyLLMConfig()
    assert (config.full_steps, config.full_sequence_interval, config.approximate_attention) == (4, 4, True)
    assert (config.threshold_for("dream"), config.threshold_for("llada")) == (0.995, 0.99)
    gen = _gen(8, 8, 4, None)
    with pytest.raises(ValueError, match="not block diffusion"):
        vanilla_dyllm_logits(tiny_model("sdar"), torch.tensor(PROMPT[:8]), gen, config)
    with pytest.raises(ValueError, match="last gen_length local rows"):
        DyLLMLogits(
            tiny_model("llada"),
            torch.tensor(PROMPT),
            torch.arange(13)[None],
            3,
            gen,
            config,
            DenseAttention(),
        )
