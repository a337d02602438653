"""Wire params <-> engine configs: router-pinned values round-trip exactly; unset fields keep the base."""

from __future__ import annotations

import dataclasses

import pytest

from pdllm.protos.pdllm.v1 import generation_pb2 as pb
from pdllm.shared.config import EngineConfig
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.rpc.convert import (
    decode_policy_config,
    decode_policy_params,
    engine_config,
    generation_config,
    generation_params,
    method_params,
)
from pdllm.shared.rpc.validation import resolve_generate_request


def test_resolved_request_round_trips_into_engine_configs() -> None:
    req = pb.GenerateRequest(
        context="c",
        question="q",
        generation=pb.GenerationParams(gen_length=16, steps=8, block_length=8, threshold=0.9, seed=3),
        method=pb.MethodParams(
            chunk_size=256,
            top_k=3,
            top_b=100,
            kv_mode="chunk-query",
            score_mode="query-only",
            query_window=32,
        ),
    )
    resolved = resolve_generate_request(req)
    gen = generation_config(generation_params(resolved))
    assert gen == GenerationConfig(
        gen_length=16, steps=8, block_length=8, threshold=0.9, temperature=0.0, seed=3
    )
    eng = engine_config(method_params(resolved), EngineConfig(prefill_batch=7))
    assert eng == EngineConfig(
        chunk_size=256,
        top_k=3,
        top_b=100,
        kv_mode="chunk-query",
        score_mode="query-only",
        pseudo_labels=4,
        pseudo_rounds=2,
        retention_score="bidirectional",
        prefill_attention="causal",
        query_window=32,
        prefill_batch=7,  # not a wire field: the worker's own setting survives
    )


def test_unset_fields_keep_the_base_except_top_b() -> None:
    base = EngineConfig(chunk_size=512, top_k=8, top_b=64, kv_mode="chunk-only")
    eng = engine_config(pb.MethodParams(score_mode="self-info"), base)
    assert eng == dataclasses.replace(base, score_mode="self-info", top_b=None)
    gen = generation_config(
        pb.GenerationParams(gen_length=64), GenerationConfig(gen_length=32, steps=16, seed=5)
    )
    assert (gen.gen_length, gen.steps, gen.seed) == (64, 64, 5)
    assert generation_config(pb.GenerationParams()) == GenerationConfig()


@pytest.mark.parametrize(
    ("gen", "method"),
    [
        (pb.GenerationParams(gen_length=10, block_length=4), None),
        (pb.GenerationParams(gen_length=8, threshold=1.5), None),
        (pb.GenerationParams(gen_length=8, seed=-1), None),
        (None, pb.MethodParams(kv_mode="half")),
        (None, pb.MethodParams(top_k=0)),
        (None, pb.MethodParams(pseudo_label_tokens=2, pseudo_label_rounds=3)),
    ],
)
def test_invalid_values_raise_value_error(gen, method) -> None:
    with pytest.raises(ValueError):
        if gen is not None:
            generation_config(gen)
        else:
            engine_config(method)


def test_decode_policy_round_trips_and_unset_is_none() -> None:
    req = pb.GenerateRequest(
        context="c",
        question="q",
        decode_policy=pb.DecodePolicyParams(
            decode_policy="sparse-dllm", sparse_retention=0.25, sparse_pool_kernel=5, cache_refresh_steps=8
        ),
    )
    params = decode_policy_params(resolve_generate_request(req))
    assert not params.HasField("sparse_delay_steps")  # unset stays unset: the paper's value
    assert decode_policy_config(params) == DecodePolicyConfig(
        "sparse-dllm", refresh_steps=8, retention=0.25, pool_kernel=5
    )
    assert decode_policy_config(pb.DecodePolicyParams()) == DecodePolicyConfig("none")


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (pb.DecodePolicyParams(decode_policy="lru-cache"), "decode_policy.decode_policy must be one of"),
        (pb.DecodePolicyParams(sparse_retention=0.5), "needs decode_policy.decode_policy sparse-dllm"),
        (
            pb.DecodePolicyParams(decode_policy="sparse-dllm", sparse_retention=2.0),
            "decode_policy.sparse_retention must be in (0, 1]",
        ),
    ],
)
def test_invalid_decode_policy_raises_value_error(params: pb.DecodePolicyParams, message: str) -> None:
    """A decode worker's own check (a router pins valid values; a direct caller may not)."""
    with pytest.raises(ValueError) as info:
        decode_policy_config(params)
    assert message in str(info.value)
