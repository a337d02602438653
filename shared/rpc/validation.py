"""Validation of public GenerateRequests: resolve server defaults, then reject bad input with a clear message.

Every rejection is an InvalidRequestError (INVALID_ARGUMENT on the wire) whose `kind` is a stable tag, so
tests and clients can tell the cases apart without parsing messages. Malformed wire bytes (e.g. invalid
UTF-8 in a string field) never reach this module: the server's interceptor rejects them while decoding.
The rules mirror `GenerationConfig.validate` and `EngineConfig.validate`, so a request that passes here
never fails later inside the engine on a parameter.
"""

from __future__ import annotations

import re
import unicodedata
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from pdllm.protos.pdllm.v1 import generation_pb2 as pb
from pdllm.shared.config import (
    KV_MODES,
    PREFILL_ATTENTIONS,
    RETENTION_SCORES,
    SCORE_MODES,
    EngineConfig,
)
from pdllm.shared.generation.sampler import GenerationConfig, temperature_error
from pdllm.shared.rpc.errors import InvalidRequestError

# Mode choices and defaults come from the engine's configs, so the wire never drifts from the engine.
METHODS = ("vanilla", "pdllm")

REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:\-]+")


# MethodParams field (also RequestDefaults' name) -> EngineConfig field, for the optional scalars and the
# non-empty strings; top_b is the one optional field whose absence means "keep all" rather than a default.
METHOD_FIELDS = {
    "chunk_size": "chunk_size",
    "top_k": "top_k",
    "pseudo_label_tokens": "pseudo_labels",
    "pseudo_label_rounds": "pseudo_rounds",
    "query_window": "query_window",
    "kv_mode": "kv_mode",
    "score_mode": "score_mode",
    "retention_score": "retention_score",
    "prefill_attention": "prefill_attention",
}


@dataclass(frozen=True)
class RequestDefaults:
    """Values used for fields the client leaves unset (method defaults follow EngineConfig's)."""

    model: str = ""
    gen_length: int = GenerationConfig.gen_length
    steps: int | None = None  # None: one step per answer token
    block_length: int | None = None  # None: a single block; also used when the default does not divide
    threshold: float | None = GenerationConfig.threshold
    temperature: float = GenerationConfig.temperature
    seed: int = GenerationConfig.seed
    method: str = "pdllm"
    chunk_size: int = EngineConfig.chunk_size
    top_k: int = EngineConfig.top_k
    top_b: int | None = EngineConfig.top_b
    kv_mode: str = EngineConfig.kv_mode
    score_mode: str = EngineConfig.score_mode
    pseudo_label_tokens: int = EngineConfig.pseudo_labels
    pseudo_label_rounds: int = EngineConfig.pseudo_rounds
    retention_score: str = EngineConfig.retention_score
    query_window: int | None = EngineConfig.query_window
    prefill_attention: str = EngineConfig.prefill_attention

    @classmethod
    def for_engine(cls, settings: Mapping[str, Any], **values: Any) -> RequestDefaults:
        """Defaults whose method fields follow ``EngineConfig.from_settings(settings)`` (a checkpoint's
        recommended engine settings), so the router fills unset fields as the workers would."""
        e = EngineConfig.from_settings(settings)
        method = {wire: getattr(e, field) for wire, field in METHOD_FIELDS.items()}
        return cls(**{**method, "top_b": e.top_b, **values})


@dataclass(frozen=True)
class ValidationLimits:
    models: tuple[str, ...] = ()  # accepted model names; empty = no check (single-model deployments)
    max_prompt_bytes: int = 4 << 20  # UTF-8 bytes of instruction + context + question
    max_gen_length: int = 4096
    min_chunk_size: int = 16
    max_chunk_size: int = 16384
    max_top_k: int = 1024
    max_pseudo_label_tokens: int = 64
    max_query_window: int = 4096
    max_request_id_chars: int = 128


@dataclass(frozen=True)
class GenerationSettings:
    gen_length: int
    steps: int
    block_length: int
    threshold: float | None
    temperature: float
    seed: int


@dataclass(frozen=True)
class MethodSettings:
    method: str
    chunk_size: int
    top_k: int
    top_b: int | None
    kv_mode: str
    score_mode: str
    pseudo_label_tokens: int
    pseudo_label_rounds: int
    retention_score: str
    query_window: int | None
    prefill_attention: str


@dataclass(frozen=True)
class ResolvedRequest:
    """A validated request with every default filled in: what the engine should run (flat on purpose:
    `resolved.gen_length`, `resolved.kv_mode`; `generation_settings()` / `method_settings()` regroup)."""

    request_id: str
    model: str
    context: str
    question: str
    instruction: str | None
    gen_length: int
    steps: int
    block_length: int
    threshold: float | None
    temperature: float
    seed: int
    method: str
    chunk_size: int
    top_k: int
    top_b: int | None
    kv_mode: str
    score_mode: str
    pseudo_label_tokens: int
    pseudo_label_rounds: int
    retention_score: str
    query_window: int | None
    prefill_attention: str

    def generation_settings(self) -> GenerationSettings:
        return GenerationSettings(**{f.name: getattr(self, f.name) for f in fields(GenerationSettings)})

    def method_settings(self) -> MethodSettings:
        return MethodSettings(**{f.name: getattr(self, f.name) for f in fields(MethodSettings)})


def is_blank(text: str) -> bool:
    """True when ``text`` has nothing visible: only whitespace and format characters (zero-width space and
    joiners, word joiner, byte-order mark: Unicode category Cf)."""
    return all(ch.isspace() or unicodedata.category(ch) == "Cf" for ch in text)


def new_request_id() -> str:
    return uuid.uuid4().hex


def check_text(field: str, value: object) -> None:
    """Reject text that cannot travel as a proto3 string (lone surrogates) or that no tokenizer expects (NUL)."""
    if not isinstance(value, str):
        raise InvalidRequestError("not_text", f"{field} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidRequestError(
            "invalid_unicode",
            f"{field} is not valid Unicode text: {err.reason} at character {err.start}",
        ) from None
    if "\x00" in value:
        raise InvalidRequestError(
            "nul_character", f"{field} contains a NUL character at {value.index(chr(0))}"
        )


def _fail(kind: str, message: str, request_id: str) -> None:
    raise InvalidRequestError(kind, message, request_id=request_id or None)


def _choice(field: str, value: str, default: str, allowed: tuple[str, ...], kind: str, rid: str) -> str:
    resolved = value or default
    if resolved not in allowed:
        _fail(kind, f"{field} {resolved!r} is not supported; expected one of {', '.join(allowed)}", rid)
    return resolved


def _bounded(field: str, value: int, low: int, high: int, kind: str, rid: str) -> int:
    if not low <= value <= high:
        _fail(kind, f"{field} must be in [{low}, {high}] (got {value})", rid)
    return value


def _resolve_blocks(gen: pb.GenerationParams, gen_length: int, defaults: RequestDefaults, rid: str) -> int:
    if not gen.HasField("block_length"):
        block_length = defaults.block_length or gen_length
        return block_length if gen_length % block_length == 0 else gen_length
    block_length = gen.block_length
    if block_length <= 0:
        _fail("block_length_nonpositive", f"generation.block_length must be > 0 (got {block_length})", rid)
    if gen_length % block_length:
        _fail(
            "block_not_divisor",
            f"generation.gen_length ({gen_length}) must be divisible by generation.block_length ({block_length})",
            rid,
        )
    return block_length


def resolve_generation(
    gen: pb.GenerationParams, limits: ValidationLimits, defaults: RequestDefaults, rid: str = ""
) -> GenerationSettings:
    gen_length = gen.gen_length if gen.HasField("gen_length") else defaults.gen_length
    if gen_length <= 0:
        _fail("gen_length_nonpositive", f"generation.gen_length must be > 0 (got {gen_length})", rid)
    if gen_length > limits.max_gen_length:
        _fail(
            "gen_length_too_large",
            f"generation.gen_length must be <= {limits.max_gen_length} (got {gen_length})",
            rid,
        )
    block_length = _resolve_blocks(gen, gen_length, defaults, rid)
    num_blocks = gen_length // block_length
    threshold = gen.threshold if gen.HasField("threshold") else defaults.threshold
    if threshold is not None and not (0.0 < threshold <= 1.0):
        _fail("threshold_range", f"generation.threshold must be in (0, 1] (got {threshold})", rid)
    # The fixed schedule spreads steps evenly over blocks; with a threshold, steps is only a cap.
    even_split = threshold is None
    if gen.HasField("steps"):
        steps = gen.steps
        if steps <= 0:
            _fail("steps_nonpositive", f"generation.steps must be > 0 (got {steps})", rid)
        if steps > gen_length:
            _fail(
                "steps_too_many",
                f"generation.steps must be <= generation.gen_length ({gen_length}) (got {steps})",
                rid,
            )
        if even_split and steps % num_blocks:
            _fail(
                "steps_not_multiple_of_blocks",
                f"generation.steps ({steps}) must be a multiple of the number of blocks ({num_blocks} = "
                f"gen_length {gen_length} / block_length {block_length})",
                rid,
            )
    else:
        steps = defaults.steps or gen_length
        if steps > gen_length or (even_split and steps % num_blocks):
            steps = gen_length
    temperature = gen.temperature if gen.HasField("temperature") else defaults.temperature
    if (problem := temperature_error(temperature)) is not None:
        _fail("temperature_range", f"generation.temperature {problem}", rid)
    seed = gen.seed if gen.HasField("seed") else defaults.seed
    if seed < 0:
        _fail("seed_negative", f"generation.seed must be >= 0 (got {seed})", rid)
    return GenerationSettings(gen_length, steps, block_length, threshold, temperature, seed)


def resolve_method(
    m: pb.MethodParams, limits: ValidationLimits, defaults: RequestDefaults, rid: str = ""
) -> MethodSettings:
    method = _choice("method.method", m.method, defaults.method, METHODS, "unknown_method", rid)
    kv_mode = _choice("method.kv_mode", m.kv_mode, defaults.kv_mode, KV_MODES, "unknown_kv_mode", rid)
    score_mode = _choice(
        "method.score_mode", m.score_mode, defaults.score_mode, SCORE_MODES, "unknown_score_mode", rid
    )
    retention = _choice(
        "method.retention_score",
        m.retention_score,
        defaults.retention_score,
        RETENTION_SCORES,
        "unknown_retention_score",
        rid,
    )
    attention = _choice(
        "method.prefill_attention",
        m.prefill_attention,
        defaults.prefill_attention,
        PREFILL_ATTENTIONS,
        "unknown_prefill_attention",
        rid,
    )
    chunk_size = m.chunk_size if m.HasField("chunk_size") else defaults.chunk_size
    _bounded(
        "method.chunk_size", chunk_size, limits.min_chunk_size, limits.max_chunk_size, "chunk_size_range", rid
    )
    top_k = m.top_k if m.HasField("top_k") else defaults.top_k
    _bounded("method.top_k", top_k, 1, limits.max_top_k, "top_k_range", rid)
    top_b = m.top_b if m.HasField("top_b") else defaults.top_b
    if top_b is not None:
        # B counts the chunk's BOS, so a whole chunk is chunk_size + 1 tokens.
        _bounded("method.top_b", top_b, 1, chunk_size + 1, "top_b_range", rid)
    labels = m.pseudo_label_tokens if m.HasField("pseudo_label_tokens") else defaults.pseudo_label_tokens
    rounds = m.pseudo_label_rounds if m.HasField("pseudo_label_rounds") else defaults.pseudo_label_rounds
    if score_mode == "pseudo-label":
        kind = "pseudo_label_tokens_range"
        _bounded("method.pseudo_label_tokens", labels, 1, limits.max_pseudo_label_tokens, kind, rid)
        _bounded("method.pseudo_label_rounds", rounds, 1, labels, "pseudo_label_rounds_range", rid)
    window = m.query_window if m.HasField("query_window") else defaults.query_window
    if window is not None:
        _bounded("method.query_window", window, 1, limits.max_query_window, "query_window_range", rid)
    return MethodSettings(
        method, chunk_size, top_k, top_b, kv_mode, score_mode, labels, rounds, retention, window, attention
    )


def resolve_generate_request(
    req: pb.GenerateRequest,
    limits: ValidationLimits | None = None,
    defaults: RequestDefaults | None = None,
) -> ResolvedRequest:
    limits = limits or ValidationLimits()
    defaults = defaults or RequestDefaults()
    rid = req.request_id
    if len(rid) > limits.max_request_id_chars:
        _fail(
            "request_id_too_long",
            f"request_id must be at most {limits.max_request_id_chars} characters (got {len(rid)})",
            "",
        )
    if rid and not REQUEST_ID_PATTERN.fullmatch(rid):
        _fail("request_id_chars", "request_id may only contain letters, digits and . _ : -", "")
    for field in ("context", "question", "instruction"):
        check_text(field, getattr(req, field))
    if is_blank(req.context):
        _fail("empty_context", "context must not be empty (or only whitespace and invisible characters)", rid)
    if is_blank(req.question):
        _fail(
            "empty_question", "question must not be empty (or only whitespace and invisible characters)", rid
        )
    prompt_bytes = sum(len(getattr(req, f).encode("utf-8")) for f in ("instruction", "context", "question"))
    if prompt_bytes > limits.max_prompt_bytes:
        _fail(
            "prompt_too_large",
            f"instruction + context + question is {prompt_bytes} bytes; the limit is {limits.max_prompt_bytes}",
            rid,
        )
    model = req.model or defaults.model
    if limits.models and model not in limits.models:
        _fail(
            "unknown_model", f"model {model!r} is not served here; available: {', '.join(limits.models)}", rid
        )
    return ResolvedRequest(
        request_id=rid,
        model=model,
        context=req.context,
        question=req.question,
        instruction=req.instruction if req.HasField("instruction") else None,
        **asdict(resolve_generation(req.generation, limits, defaults, rid)),
        **asdict(resolve_method(req.method, limits, defaults, rid)),
    )


def validate_generate_request(
    req: pb.GenerateRequest,
    limits: ValidationLimits | None = None,
    defaults: RequestDefaults | None = None,
) -> None:
    """Raise InvalidRequestError (INVALID_ARGUMENT) describing the first problem with `req`, if any."""
    resolve_generate_request(req, limits, defaults)
