"""Wire messages <-> engine dataclasses, in one place for the router and both worker roles."""

from __future__ import annotations

from dataclasses import replace

from pdllm.prefill_service.config import EngineConfig
from pdllm.protos.pdllm.v1 import generation_pb2 as pb
from pdllm.shared.generation.sampler import GenerationConfig


def generation_config(params: pb.GenerationParams) -> GenerationConfig:
    """Workers receive fully resolved parameters from the router (every field set)."""
    gen_length = params.gen_length
    return GenerationConfig(
        gen_length=gen_length,
        steps=params.steps if params.HasField("steps") else gen_length,
        block_length=params.block_length if params.HasField("block_length") else None,
        threshold=params.threshold if params.HasField("threshold") else None,
        temperature=params.temperature,
        seed=params.seed,
    )


def engine_config(method: pb.MethodParams, base: EngineConfig | None = None) -> EngineConfig:
    base = base or EngineConfig()
    changes: dict = {}
    if method.HasField("chunk_size"):
        changes["chunk_size"] = method.chunk_size
    if method.HasField("top_k"):
        changes["top_k"] = method.top_k
    changes["top_b"] = method.top_b if method.HasField("top_b") else None
    if method.kv_mode:
        changes["kv_mode"] = method.kv_mode
    if method.score_mode:
        changes["score_mode"] = method.score_mode
    if method.HasField("pseudo_label_tokens"):
        changes["pseudo_labels"] = method.pseudo_label_tokens
    if method.HasField("pseudo_label_rounds"):
        changes["pseudo_rounds"] = method.pseudo_label_rounds
    if method.retention_score:
        changes["retention_score"] = method.retention_score
    return replace(base, **changes)
