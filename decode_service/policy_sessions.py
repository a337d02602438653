"""Decode-policy sessions outside the batched rounds, and the reference loops over a static KV.

DyLLM requests (vanilla or pdllm) run the policy's own loop (``policies/compute_skip.py``), one denoising
step per scheduler iteration (:func:`step_alone`). A pdllm
one reads its static KV through the reference attention backends (:func:`static_local_rows`; a KV landed
by a handoff is read out of its pool pages once, :func:`pooled_static`), so its answer equals
``engine.generate(..., decode_policy=...)`` token for token. :func:`static_policy_logits` is a caching
policy's reference loop over a static KV: the specification the rounds are tested against.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from pdllm.decode_service.decode import DecodePolicy, StaticPolicy, local_inputs
from pdllm.decode_service.kv_pool import DecodeKVPool, PooledKV
from pdllm.decode_service.policies import CachePolicy, DecodePolicyConfig, PolicyLogits
from pdllm.decode_service.policies.compute_skip import ComputeSkipLogits, compute_skip_logits
from pdllm.decode_service.request import DecodeRequest
from pdllm.kernels.paged_kv import ChunkPages
from pdllm.protos.pdllm.v1 import workers_pb2 as wpb
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.kv_transfer.payload import unpack_static
from pdllm.shared.model.attention import AttentionBackend
from pdllm.shared.model.transformer import DiffusionLM
from pdllm.shared.static_kv import StaticKV

_log = logging.getLogger("pdllm.decode.scheduler")


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
    cuda_graph: bool = False,
) -> ComputeSkipLogits:
    """Step 7 of a pdllm request under a compute-skipping policy (DyLLM, FOCUS): its loop over the query +
    answer rows around the same static-KV attention as :func:`static_policy_logits` (``cuda_graph``: see
    ``compute_skip_logits``)."""
    local, positions, inner = static_local_rows(model, query, static, gen, decode_attention, static_policy)
    return compute_skip_logits(model, local, positions, len(query), gen, config, inner, cuda_graph)


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


def pooled_static(pool: DecodeKVPool, pages: list[int], kv: PooledKV, handoff: wpb.KvHandoff) -> StaticKV:
    """A decode KV that ``handoff`` landed in ``pages``, copied out for the reference loop and split into
    the segments it was built as (so it reads exactly like the same KV pulled into a tensor)."""
    used = tuple(pages[: pool.pages_for(kv.num_tokens)])
    return unpack_static(pool.pool.read_chunk(ChunkPages(used, kv.num_tokens)), handoff)


def step_alone(
    reqs: Sequence[DecodeRequest], stopping: Callable[[], bool], observe: Callable[[float], None]
) -> tuple[list[DecodeRequest], list[DecodeRequest]]:
    """One step of each session outside the rounds (DyLLM's loop): (stepped, failed). A failed request has its exception queued for its caller.
    None runs once the scheduler is ``stopping`` or after its request was cancelled: such a step is long,
    and nobody would wait for it."""
    stepped: list[DecodeRequest] = []
    failed: list[DecodeRequest] = []
    for req in reqs:
        if req.cancelled.is_set() or stopping():
            continue
        session = req.session
        assert session is not None
        try:
            start = time.perf_counter()
            session.step()  # type: ignore[union-attr]
            observe(time.perf_counter() - start)
        except Exception as exc:
            _log.exception("decode step failed", extra={"request_id": req.request_id})
            req.events.put(exc)
            failed.append(req)
        else:
            stepped.append(req)
    return stepped, failed
