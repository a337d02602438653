"""Decode policies composed with pdllm's chunk selection: the static chunk KV stays as it is, the policy
reuses the K/V of the query suffix and the response only (tiny fp32 models)."""

from __future__ import annotations

import pytest

from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.config import EngineConfig
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.generation.sampler import GenerationConfig, GenerationResult
from tests.engine.helpers import model, tokens
from tests.generation.straightforward_cache import straightforward_cache_loop

C = 12
# (family, kv_mode, top_b, decode attention)
CASES = [
    ("dream", "full-mask", None, "torch"),
    ("llada", "full-mask", 5, "torch"),
    ("dream", "chunk-only", None, "torch"),
    ("llada", "chunk-query", None, "torch"),
]
GENS = [
    GenerationConfig(gen_length=16, steps=16, block_length=4, stop_at_eos=False),
    GenerationConfig(gen_length=12, steps=12, block_length=6, threshold=0.15, stop_at_eos=False),
]


def _engine(family: str, kv_mode: str, top_b: int | None, attention: str) -> PrefillingEngine:
    cfg = EngineConfig(chunk_size=C, top_k=2, top_b=top_b, kv_mode=kv_mode)
    return PrefillingEngine(model(family), None, cfg, decode_attention=attention)


def _decode(
    engine: PrefillingEngine, gen: GenerationConfig, policy: DecodePolicyConfig | None
) -> GenerationResult:
    sel = engine.prefill(tokens(50, 1), tokens(6, 2), gen, [5, 7, 9])
    return engine.decode(sel, gen, decode_policy=policy)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("gen", GENS, ids=["fixed", "threshold"])
@pytest.mark.parametrize("name", ["prefix-cache", "dual-cache"])
def test_refresh_every_step_is_pdllm_without_a_policy(case: tuple, gen: GenerationConfig, name: str) -> None:
    engine = _engine(*case)
    plain = _decode(engine, gen, None)
    cached = _decode(engine, gen, DecodePolicyConfig(name, refresh_steps=1))
    assert cached.raw_tokens == plain.raw_tokens and cached.steps == plain.steps
    assert cached.cache["refreshes"] == cached.steps


@pytest.mark.parametrize("family", ["dream", "llada"])
@pytest.mark.parametrize("gen", GENS, ids=["fixed", "threshold"])
@pytest.mark.parametrize("name", ["prefix-cache", "dual-cache"])
def test_cached_pdllm_matches_straightforward_loop(family: str, gen: GenerationConfig, name: str) -> None:
    """The policy over pdllm's static KV == the from-scratch loop given the same static KV ("torch": one
    SDPA over static + local K/V, as the from-scratch loop does)."""
    engine = _engine(family, "full-mask", None, "torch")
    query = tokens(6, 2)
    sel = engine.prefill(tokens(50, 1), query, gen, [5, 7, 9])
    static = engine.build(sel, gen)
    block = gen.block_length or gen.gen_length
    expected = straightforward_cache_loop(
        engine.model, query, gen.gen_length, block, gen.steps, name == "dual-cache", gen.threshold,
        static=static.tensor(), first_position=static.query_start,
    )  # fmt: skip
    cached = _decode(engine, gen, DecodePolicyConfig(name))
    assert cached.raw_tokens == expected
    assert cached.cache["refreshes"] == gen.gen_length // block


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("gen", GENS, ids=["fixed", "threshold"])
def test_sparse_dllm_refreshed_every_step_is_pdllm_without_a_policy(
    case: tuple, gen: GenerationConfig
) -> None:
    engine = _engine(*case)
    plain = _decode(engine, gen, None)
    sparse = _decode(engine, gen, DecodePolicyConfig("sparse-dllm", refresh_steps=1, retention=0.3))
    assert sparse.raw_tokens == plain.raw_tokens and sparse.steps == plain.steps


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("gen", GENS, ids=["fixed", "threshold"])
def test_sparse_dllm_keeping_all_without_delay_is_dual_cache(case: tuple, gen: GenerationConfig) -> None:
    """The identity of the vanilla path holds over the static chunk KV too: the eviction concerns the
    local rows only (query suffix and response), never the method's chunk KV."""
    engine = _engine(*case)
    dual = _decode(engine, gen, DecodePolicyConfig("dual-cache"))
    sparse = _decode(engine, gen, DecodePolicyConfig("sparse-dllm", retention=1.0, delay_steps=0))
    assert sparse.raw_tokens == dual.raw_tokens
    assert sparse.cache["rows_forwarded"] == dual.cache["rows_forwarded"]
    evicting = _decode(engine, gen, DecodePolicyConfig("sparse-dllm"))
    assert evicting.cache["cache_bytes"] < dual.cache["cache_bytes"]
