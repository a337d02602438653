"""pdllm's step 7 for one request over the static KV (the reference loop): iterative denoising over static
prefix KV, recomputing only the query suffix and response. It is the specification the batched rounds
(``decode_service/rounds.py``) are tested against; the decode server and the in-process engine both decode
through the rounds.

The loop is :func:`pdllm.shared.generation.sampler.denoise` (the shared unmasking logic) driven by a
logits function that forwards ``[query suffix, response]`` at positions after the static prefix. Which
*static* KV the tokens attend to is decided by a :class:`DecodePolicy`: the default attends to every static
segment every step (:class:`StaticPolicy`, in any of the decode attentions: segmented, buffered, the split-S
kernel); methods that evict or pick static KV would be other policies over the same :class:`StaticKV`.
Reusing the KV of the forwarded rows themselves across steps is a decode policy's business
(``decode_service/policies``): its loop runs around this attention backend and leaves the static KV as it
is, under a cache policy (:func:`static_policy_logits`) or a compute-skipping one
(:func:`static_compute_skip_logits`). The decode worker's pdllm sessions (the batched rounds) are held to
these loops token for token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pdllm.decode_service.attention import SegmentedAttention
from pdllm.decode_service.policies import CachePolicy, DecodePolicyConfig
from pdllm.shared.generation.sampler import GenerationConfig, GenerationResult, LogitsFn, denoise
from pdllm.shared.model.attention import AttentionBackend
from pdllm.shared.model.transformer import DiffusionLM
from pdllm.shared.static_kv import StaticKV
from tests.reference.compute_skip import ComputeSkipLogits, compute_skip_logits
from tests.reference.policy import PolicyLogits
from tests.reference.static_attention import BufferedAttention, PagedSplitSAttention


class DecodePolicy(Protocol):
    """Decides, step by step, which static KV the decode tokens attend to (and may update its state).

    ``step_invariant``: ``backend`` returns the same object every step and it reads only tensors whose
    storage never moves (what CUDA-graph replay needs); policies that evict or refresh KV set it False.
    """

    step_invariant: bool

    def begin(self, static: StaticKV, local_tokens: int) -> None: ...

    def backend(self, step: int, tokens: torch.Tensor) -> AttentionBackend: ...


STATIC_ATTENTIONS = ("segments", "buffer", "triton")


@dataclass
class StaticPolicy:
    """Prefilling-dLLM's own decode: every step attends to all static segments.

    ``mode``: "segments" (torch split over segments + LSE merge), "buffer" (contiguous buffer + SDPA) or
    "triton" (the split-S kernel over the static KV as pages; CUDA, or CPU under TRITON_INTERPRET=1).
    """

    mode: str = "segments"
    step_invariant: bool = True
    _backend: AttentionBackend | None = None

    def begin(self, static: StaticKV, local_tokens: int) -> None:
        if self.mode == "segments":
            self._backend = SegmentedAttention(static.segments)
        elif self.mode == "buffer":
            self._backend = BufferedAttention(static.tensor(), local_tokens)
        elif self.mode == "triton":
            self._backend = PagedSplitSAttention(static.tensor())
        else:
            raise ValueError(f"static attention must be one of {STATIC_ATTENTIONS}, got {self.mode!r}")

    def backend(self, step: int, tokens: torch.Tensor) -> AttentionBackend:
        assert self._backend is not None, "begin() must run before backend()"
        return self._backend


def local_inputs(
    model: DiffusionLM, query_ids: list[int], static: StaticKV, gen: GenerationConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode forward's own tokens ``[query suffix, masked response]`` and their positions
    ``[1, q + gen_length]`` right after the static prefix."""
    device = next(model.parameters()).device
    local = torch.full(
        (len(query_ids) + gen.gen_length,), model.config.mask_token_id, dtype=torch.long, device=device
    )
    local[: len(query_ids)] = torch.as_tensor(query_ids, device=device)
    positions = torch.arange(static.query_start, static.query_start + local.shape[0], device=device)[None]
    return local, positions


@torch.inference_mode()
def decode(
    model: DiffusionLM,
    query_ids: list[int],
    static: StaticKV,
    gen: GenerationConfig,
    policy: DecodePolicy | None = None,
    progress: bool = False,
) -> GenerationResult:
    """The reference loop: ``denoise`` over the eager decode step (:func:`decode_logits_fn`)."""
    gen.validate()
    return denoise(
        gen,
        model.config.mask_token_id,
        model.config.eos_token_id,
        decode_logits_fn(model, query_ids, static, gen, policy or StaticPolicy()),
        device=next(model.parameters()).device,
        progress=progress,
    )


def decode_logits_fn(
    model: DiffusionLM,
    query_ids: list[int],
    static: StaticKV,
    gen: GenerationConfig,
    policy: DecodePolicy,
) -> LogitsFn:
    """The eager decode step: forward ``[query, response]`` after ``static``, attention per ``policy``."""
    q = len(query_ids)
    local, positions = local_inputs(model, query_ids, static, gen)
    policy.begin(static, local.shape[0])
    step = 0

    def logits_fn(response: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        nonlocal step
        local[q:] = response
        backend = policy.backend(step, local)
        step += 1
        return model(local[None], positions, backend, logits_at=(at + q)[None])[0]

    return logits_fn


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
    """Step 7 of a pdllm request under a compute-skipping policy (DyLLM; FOCUS is SDAR only): its loop over
    the query + answer rows around the same static-KV attention as :func:`static_policy_logits`."""
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
