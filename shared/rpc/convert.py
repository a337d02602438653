"""Conversions between wire parameters (pdllm.v1 GenerationParams / MethodParams / DecodePolicyParams) and
engine configs.

Workers call `generation_config` / `engine_config` / `decode_policy_config` on what the router sends; the
router builds those messages from a validated request with `generation_params` / `method_params` /
`decode_policy_params`, pinning every field. Unset
fields keep the base value (a worker's configured defaults), except `top_b` (unset = keep all). Which fields
exist and what they may hold comes from the schema (`shared/settings.py`); invalid values raise its
SettingError, a ValueError, for the caller to map to INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses

from pdllm.protos.pdllm.v1 import generation_pb2 as pb
from pdllm.shared import settings
from pdllm.shared.config import EngineConfig
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.decode_policy_settings import DecodePolicySettings
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.rpc.validation import ResolvedRequest, set_fields
from pdllm.shared.settings import GenerationSettings, MethodSettings


def generation_config(gen: pb.GenerationParams, base: GenerationConfig | None = None) -> GenerationConfig:
    """GenerationConfig from wire params; unset fields come from `base`. An unset `steps` with a set
    `gen_length` means one step per token rather than base.steps (which was sized for base.gen_length)."""
    values = set_fields(gen, GenerationSettings.model_fields)
    if "gen_length" in values:
        values.setdefault("steps", values["gen_length"])
    config = dataclasses.replace(base or GenerationConfig(), **values)
    config.validate()
    return config


def engine_config(method: pb.MethodParams, base: EngineConfig | None = None) -> EngineConfig:
    """`base` with every field the caller set in `method` replaced (validated by EngineConfig).

    Exception: an unset `top_b` means "keep every token" (the documented wire meaning), not base.top_b.
    """
    values = {"top_b": None} | set_fields(method, MethodSettings.model_fields)
    overrides = {engine: v for n, v in values.items() if (engine := settings.engine_name(MethodSettings, n))}
    return dataclasses.replace(base or EngineConfig(), **overrides)


def decode_policy_config(params: pb.DecodePolicyParams) -> DecodePolicyConfig:
    """DecodePolicyConfig from wire params, validated by the schema (unset: the schema's defaults, i.e.
    policy "none"; a worker has no decode-policy defaults of its own: the router pins every field)."""
    values = set_fields(params, DecodePolicySettings.model_fields)
    return settings.decode_policy_config(values, label=lambda name: f"decode_policy.{name}")


def generation_params(resolved: ResolvedRequest) -> pb.GenerationParams:
    """Every generation field pinned, so workers run exactly what the router validated."""
    return pb.GenerationParams(**{k: v for k, v in resolved.generation_settings() if v is not None})


def method_params(resolved: ResolvedRequest) -> pb.MethodParams:
    return pb.MethodParams(**{k: v for k, v in resolved.method_settings() if v is not None})


def decode_policy_params(resolved: ResolvedRequest) -> pb.DecodePolicyParams:
    return pb.DecodePolicyParams(**{k: v for k, v in resolved.decode_policy_settings() if v is not None})
