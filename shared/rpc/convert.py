"""Conversions between wire parameters (pdllm.v1 GenerationParams / MethodParams) and engine configs.

Workers call `generation_config` / `engine_config` on what the router sends; the router builds those
messages from a validated request with `generation_params` / `method_params`, pinning every field. Unset
optional fields keep the base value (a worker's configured defaults), except `top_b` (unset = keep all). Invalid
values raise ValueError (from the configs' own validation) for the caller to map to INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses

from pdllm.protos.pdllm.v1 import generation_pb2 as pb
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.rpc.validation import METHOD_FIELDS, ResolvedRequest

_OPTIONAL_SCALARS = {"chunk_size", "top_k", "pseudo_label_tokens", "pseudo_label_rounds", "query_window"}


def generation_config(gen: pb.GenerationParams, base: GenerationConfig | None = None) -> GenerationConfig:
    """GenerationConfig from wire params; unset fields come from `base`. An unset `steps` with a set
    `gen_length` means one step per token rather than base.steps (which was sized for base.gen_length)."""
    base = base or GenerationConfig()
    gen_length = gen.gen_length if gen.HasField("gen_length") else base.gen_length
    default_steps = gen_length if gen.HasField("gen_length") else base.steps
    steps = gen.steps if gen.HasField("steps") else default_steps
    config = dataclasses.replace(
        base,
        gen_length=gen_length,
        steps=steps,
        block_length=gen.block_length if gen.HasField("block_length") else base.block_length,
        threshold=gen.threshold if gen.HasField("threshold") else base.threshold,
        temperature=gen.temperature if gen.HasField("temperature") else base.temperature,
        seed=gen.seed if gen.HasField("seed") else base.seed,
    )
    config.validate()
    if config.seed < 0:
        raise ValueError(f"seed must be >= 0, got {config.seed}")
    return config


def engine_config(method: pb.MethodParams, base: EngineConfig | None = None) -> EngineConfig:
    """`base` with every field the caller set in `method` replaced (validated by EngineConfig).

    Exception: an unset `top_b` means "keep every token" (the documented wire meaning), not base.top_b.
    """
    base = base or EngineConfig()
    overrides: dict[str, object] = {"top_b": method.top_b if method.HasField("top_b") else None}
    for wire, field in METHOD_FIELDS.items():
        if wire in _OPTIONAL_SCALARS:
            if method.HasField(wire):
                overrides[field] = getattr(method, wire)
        elif getattr(method, wire):
            overrides[field] = getattr(method, wire)
    return dataclasses.replace(base, **overrides)


def generation_params(resolved: ResolvedRequest) -> pb.GenerationParams:
    """Every generation field pinned, so workers run exactly what the router validated."""
    params = pb.GenerationParams(
        gen_length=resolved.gen_length,
        steps=resolved.steps,
        block_length=resolved.block_length,
        temperature=resolved.temperature,
        seed=resolved.seed,
    )
    if resolved.threshold is not None:
        params.threshold = resolved.threshold
    return params


def method_params(resolved: ResolvedRequest) -> pb.MethodParams:
    params = pb.MethodParams(
        method=resolved.method,
        chunk_size=resolved.chunk_size,
        top_k=resolved.top_k,
        kv_mode=resolved.kv_mode,
        score_mode=resolved.score_mode,
        pseudo_label_tokens=resolved.pseudo_label_tokens,
        pseudo_label_rounds=resolved.pseudo_label_rounds,
        retention_score=resolved.retention_score,
        prefill_attention=resolved.prefill_attention,
    )
    if resolved.top_b is not None:
        params.top_b = resolved.top_b
    if resolved.query_window is not None:
        params.query_window = resolved.query_window
    return params
