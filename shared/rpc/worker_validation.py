"""Validation of the internal Prefill / Decode requests a worker receives from the router.

The router validates the public request first, so failures here mean a router bug or a client talking to
a worker directly; they still get INVALID_ARGUMENT with a precise message instead of an engine crash.
Chunk handles made for a different model/layout get FAILED_PRECONDITION: the request is fine, this worker
is the wrong one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdllm.protos.pdllm.v1 import workers_pb2 as wpb
from pdllm.shared.kv_transfer.payload import check_kv_spec
from pdllm.shared.rpc.errors import InvalidRequestError
from pdllm.shared.rpc.validation import (
    REQUEST_ID_PATTERN,
    GenerationSettings,
    MethodSettings,
    RequestDefaults,
    ValidationLimits,
    resolve_generation,
    resolve_method,
)


@dataclass(frozen=True)
class WorkerLimits:
    vocab_size: int
    max_prompt_tokens: int = 1 << 20
    request: ValidationLimits = ValidationLimits()


@dataclass(frozen=True)
class ResolvedPrefill:
    request_id: str
    model: str
    instruction_ids: list[int]
    context_ids: list[int]
    question_ids: list[int]
    generation: GenerationSettings
    method: MethodSettings


@dataclass(frozen=True)
class ResolvedDecode:
    request_id: str
    model: str
    chunks: list[wpb.ChunkHandle]
    context_ids: list[int]  # method "vanilla" only
    instruction_ids: list[int]
    question_ids: list[int]
    generation: GenerationSettings
    method: MethodSettings
    stream_partials: bool


def _fail(kind: str, message: str, rid: str) -> None:
    raise InvalidRequestError(kind, message, request_id=rid or None)


def _check_request_id(rid: str, limits: ValidationLimits) -> None:
    if len(rid) > limits.max_request_id_chars or (rid and not REQUEST_ID_PATTERN.fullmatch(rid)):
        _fail(
            "request_id_chars",
            f"request_id must be <= {limits.max_request_id_chars} chars of [A-Za-z0-9._:-]",
            "",
        )


def _check_ids(field: str, ids: Sequence[int], vocab_size: int, rid: str, required: bool = True) -> None:
    if required and not ids:
        _fail(f"empty_{field}", f"{field} must not be empty", rid)
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            _fail(
                "token_id_range", f"{field}[{i}] = {token} is outside the vocabulary [0, {vocab_size})", rid
            )


def _check_model(model: str, limits: ValidationLimits, rid: str) -> None:
    if limits.models and model and model not in limits.models:
        _fail(
            "unknown_model", f"model {model!r} is not served here; available: {', '.join(limits.models)}", rid
        )


def resolve_prefill_request(
    req: wpb.PrefillRequest, limits: WorkerLimits, defaults: RequestDefaults | None = None
) -> ResolvedPrefill:
    defaults = defaults or RequestDefaults()
    rid = req.request_id
    _check_request_id(rid, limits.request)
    _check_model(req.model, limits.request, rid)
    _check_ids("instruction_ids", req.instruction_ids, limits.vocab_size, rid, required=False)
    _check_ids("context_ids", req.context_ids, limits.vocab_size, rid)
    _check_ids("question_ids", req.question_ids, limits.vocab_size, rid)
    total = len(req.instruction_ids) + len(req.context_ids) + len(req.question_ids)
    if total > limits.max_prompt_tokens:
        _fail(
            "prompt_too_long",
            f"prompt has {total} tokens; this worker takes at most {limits.max_prompt_tokens}",
            rid,
        )
    return ResolvedPrefill(
        request_id=rid,
        model=req.model or defaults.model,
        instruction_ids=list(req.instruction_ids),
        context_ids=list(req.context_ids),
        question_ids=list(req.question_ids),
        generation=resolve_generation(req.generation, limits.request, defaults, rid),
        method=resolve_method(req.method, limits.request, defaults, rid),
    )


def _check_spec(got: wpb.KvSpec, expected: wpb.KvSpec, rid: str) -> None:
    check_kv_spec(got, expected, "chunk KV", rid)


def _check_handle(index: int, handle: wpb.ChunkHandle, vocab_size: int, rid: str) -> None:
    where = f"chunks[{index}]"
    n = len(handle.token_ids)
    if n == 0:
        _fail("empty_chunk", f"{where} has no token ids", rid)
    _check_ids(f"{where}.token_ids", handle.token_ids, vocab_size, rid)
    if len(handle.positions) != n:
        _fail("handle_positions", f"{where} has {len(handle.positions)} positions for {n} tokens", rid)
    if any(p < 0 for p in handle.positions):
        _fail("handle_positions", f"{where}.positions must be >= 0", rid)
    kept = list(handle.kept_indices)
    if kept and (kept[0] < 0 or kept[-1] >= n or any(b <= a for a, b in zip(kept, kept[1:]))):
        _fail(
            "handle_kept_indices",
            f"{where}.kept_indices must be strictly increasing indices in [0, {n})",
            rid,
        )


def resolve_decode_request(
    req: wpb.DecodeRequest,
    limits: WorkerLimits,
    kv_spec: wpb.KvSpec | None = None,
    defaults: RequestDefaults | None = None,
) -> ResolvedDecode:
    """Validate a DecodeRequest; `kv_spec` is this worker's layout (None: do not check handles against it)."""
    defaults = defaults or RequestDefaults()
    rid = req.request_id
    _check_request_id(rid, limits.request)
    _check_model(req.model, limits.request, rid)
    method = resolve_method(req.method, limits.request, defaults, rid)
    if method.method == "pdllm" and not req.chunks:
        _fail("empty_chunks", "method 'pdllm' needs at least one chunk handle", rid)
    if kv_spec is not None and req.chunks:
        _check_spec(req.kv_spec, kv_spec, rid)
    for i, handle in enumerate(req.chunks):
        _check_handle(i, handle, limits.vocab_size, rid)
    _check_ids("instruction_ids", req.instruction_ids, limits.vocab_size, rid, required=False)
    _check_ids("context_ids", req.context_ids, limits.vocab_size, rid, required=method.method == "vanilla")
    _check_ids("question_ids", req.question_ids, limits.vocab_size, rid)
    total = len(req.instruction_ids) + len(req.context_ids) + len(req.question_ids)
    total += sum(len(h.token_ids) for h in req.chunks)
    if total > limits.max_prompt_tokens:
        _fail("prompt_too_long", f"decode prompt has {total} tokens; at most {limits.max_prompt_tokens}", rid)
    return ResolvedDecode(
        request_id=rid,
        model=req.model or defaults.model,
        chunks=list(req.chunks),
        context_ids=list(req.context_ids),
        instruction_ids=list(req.instruction_ids),
        question_ids=list(req.question_ids),
        generation=resolve_generation(req.generation, limits.request, defaults, rid),
        method=method,
        stream_partials=req.stream_partials,
    )
