"""The token ids of a ``DecodeRequest``, and what an SDAR model cannot decode, checked before the request
reaches the scheduler.

The decode server already checks a request's settings (``rpc/convert.py``), its chunk handles' and
handoff's KV identity (``check_kv_spec``) and its vanilla prompt length; the prefill worker checks its ids
in ``layout.make_request``. Decode ids come from the router's tokenizer, so a bad one means a router bug
or a client calling the worker directly: without this check it fails in the embedding lookup on the
scheduler thread, and the caller gets INTERNAL instead of INVALID_ARGUMENT naming the field.

On an SDAR (block-diffusion) model a request runs exact block diffusion (``decode_service/sdar_decode.py``),
plain or under FOCUS; :func:`check_block_diffusion` refuses, with INVALID_ARGUMENT naming the option, what that
decode does not run. On Dream/LLaDA, :func:`check_policy_family` refuses decode policy ``focus`` (SDAR only)
with INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from pdllm.decode_service import sdar_decode, sessions
from pdllm.protos.pdllm.v1 import workers_pb2 as wpb
from pdllm.shared.config import EngineConfig
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.model.transformer import DiffusionLM
from pdllm.shared.rpc.errors import PdllmError

_SDAR = "the decode worker on SDAR (block-diffusion) models"


def check_token_ids(request: wpb.DecodeRequest, vocab_size: int) -> None:
    """INVALID_ARGUMENT for a token id outside ``[0, vocab_size)`` or a chunk handle without tokens."""
    fields: list[tuple[str, Sequence[int]]] = [
        ("instruction_ids", request.instruction_ids),
        ("context_ids", request.context_ids),
        ("question_ids", request.question_ids),
    ]
    for i, handle in enumerate(request.chunks):
        if not handle.token_ids:
            raise PdllmError(f"chunks[{i}] has no token ids", code=grpc.StatusCode.INVALID_ARGUMENT)
        fields.append((f"chunks[{i}].token_ids", handle.token_ids))
    for name, ids in fields:
        if not ids:
            continue
        low, high = min(ids), max(ids)  # C loops: a vanilla context has up to --max-vanilla-tokens ids
        if low < 0 or high >= vocab_size:
            raise PdllmError(
                f"{name} has token id {low if low < 0 else high} outside the vocabulary [0, {vocab_size})",
                code=grpc.StatusCode.INVALID_ARGUMENT,
            )


def check_block_diffusion(
    method: str,
    config: EngineConfig,
    gen: GenerationConfig,
    policy: DecodePolicyConfig,
    model: DiffusionLM,
) -> None:
    """INVALID_ARGUMENT for what an SDAR request cannot run: ``kv_mode`` chunk-only and ``top_b`` (method
    pdllm), a ``block_length`` that is not a multiple of the model's block size, a ``decode_policy`` other
    than none and focus (either method: ``sdar_decode.POLICIES``)."""
    try:
        if method != "vanilla":
            sdar_decode.check_config(config, None, model)
        sdar_decode.check_generation(gen, model)
    except ValueError as exc:
        raise PdllmError(str(exc), code=grpc.StatusCode.INVALID_ARGUMENT) from exc
    if policy.name not in sdar_decode.POLICIES:
        raise PdllmError(
            f"decode_policy {policy.name!r} is not supported by {_SDAR} (use decode_policy focus or none)",
            code=grpc.StatusCode.INVALID_ARGUMENT,
        )


def check_policy_family(policy: DecodePolicyConfig, model: DiffusionLM) -> None:
    """INVALID_ARGUMENT for a decode policy a Dream/LLaDA model does not run (``focus``: SDAR only,
    ``sessions.check_policy_family``)."""
    try:
        sessions.check_policy_family(policy, model)
    except ValueError as exc:
        raise PdllmError(str(exc), code=grpc.StatusCode.INVALID_ARGUMENT) from exc
