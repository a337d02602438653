"""A decode policy's loop over pdllm's static chunk KV, one request (the reference): step 7 under a cache
policy (:func:`static_policy_logits`) or a compute-skipping one (:func:`static_compute_skip_logits`), its
local rows the query suffix + answer, the static KV read by ``decode_service/decode.py``'s static-KV
attention. The decode worker's pdllm sessions under a decode policy (the batched rounds) are held to it.
"""

from __future__ import annotations

import torch

from pdllm.decode_service.decode import DecodePolicy, StaticPolicy, local_inputs
from pdllm.decode_service.policies import CachePolicy, DecodePolicyConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.model.attention import AttentionBackend
from pdllm.shared.model.transformer import DiffusionLM
from pdllm.shared.static_kv import StaticKV
from tests.reference.compute_skip import ComputeSkipLogits, compute_skip_logits
from tests.reference.policy import PolicyLogits


def static_policy_logits(
    model: DiffusionLM,
    query: list[int],
    static: StaticKV,
    gen: GenerationConfig,
    cache_policy: CachePolicy,
    decode_attention: str,
    static_policy: DecodePolicy | None = None,
) -> PolicyLogits:
    """Step 7 of a pdllm request under ``cache_policy``: the policy's loop over the query + answer rows,
    around the static-KV attention ``static_policy`` (default: every segment, in ``decode_attention``)."""
    local, positions, inner = static_local_rows(model, query, static, gen, decode_attention, static_policy)
    # The question's rows are protected from eviction (``StepContext.protected``).
    return PolicyLogits(model, local, positions, len(query), gen, cache_policy, inner, len(query))


def static_compute_skip_logits(
    model: DiffusionLM,
    query: list[int],
    static: StaticKV,
    gen: GenerationConfig,
    config: DecodePolicyConfig,
    decode_attention: str,
    static_policy: DecodePolicy | None = None,
) -> ComputeSkipLogits:
    """Step 7 of a pdllm request under a compute-skipping policy (DyLLM, FOCUS): its loop over the query +
    answer rows around the same static-KV attention as :func:`static_policy_logits`."""
    local, positions, inner = static_local_rows(model, query, static, gen, decode_attention, static_policy)
    return compute_skip_logits(model, local, positions, len(query), gen, config, inner)


def static_local_rows(
    model: DiffusionLM,
    query: list[int],
    static: StaticKV,
    gen: GenerationConfig,
    decode_attention: str,
    static_policy: DecodePolicy | None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionBackend]:
    """The local rows, their positions and the static-KV backend a decode policy's loop runs around."""
    if static_policy is not None and not static_policy.step_invariant:
        raise ValueError("a decode policy composes with step-invariant static-KV policies only")
    local, positions = local_inputs(model, query, static, gen)
    # The split-S kernel assumes as many local K/V rows as query rows, which a policy's step breaks
    # (cached or skipped rows); "buffer" is its eager stand-in (same SDPA over static + local K/V).
    inner = static_policy or StaticPolicy("buffer" if decode_attention == "triton" else decode_attention)
    inner.begin(static, local.shape[0])
    return local, positions, inner.backend(0, local)
