"""Validation of public GenerateRequests: resolve server defaults, then reject bad input with a clear message.

Every rejection is an InvalidRequestError (INVALID_ARGUMENT on the wire) whose `kind` is a stable tag, so
tests and clients can tell the cases apart without parsing messages. Malformed wire bytes (e.g. invalid
UTF-8 in a string field) never reach this module: the server's interceptor rejects them while decoding.
The settings' rules are the schema's (`shared/settings.py`), the very ones `GenerationConfig.validate` and
`EngineConfig.validate` apply, plus the tighter bounds the schema sets for public requests; so a request
that passes here never fails later inside the engine on a parameter.
"""

from __future__ import annotations

import re
import unicodedata
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message

from pdllm.protos.pdllm.v1 import generation_pb2 as pb
from pdllm.shared import settings
from pdllm.shared.config import EngineConfig
from pdllm.shared.decode_policy_settings import DecodePolicySettings
from pdllm.shared.rpc.errors import InvalidRequestError
from pdllm.shared.settings import GenerationFields, GenerationSettings, MethodSettings, SettingError

METHODS = settings.choices(MethodSettings, "method")

REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:\-]+")


class RequestDefaults(GenerationFields, MethodSettings, DecodePolicySettings):
    """Values for the settings a request leaves unset, and the model name (method settings follow
    EngineConfig's). ``steps`` None: one per answer token; ``block_length`` None: a single block, also used
    when the default does not divide the request's ``gen_length``. The decode-policy ones apply to a
    request that names no policy (``serve --decode-policy``; default none)."""

    model: str = ""

    @classmethod
    def for_engine(cls, engine: Mapping[str, Any], **values: Any) -> RequestDefaults:
        """Defaults whose method fields follow ``EngineConfig.from_settings(engine)`` (a checkpoint's
        recommended engine settings), so the router fills unset fields as the workers would."""
        config = settings.engine_values(EngineConfig.from_settings(engine))
        return cls(**{k: v for k, v in config.items() if k in MethodSettings.model_fields} | values)


@dataclass(frozen=True)
class ValidationLimits:
    """Limits of a deployment; the bounds of each setting are the schema's (``shared/settings.py``)."""

    models: tuple[str, ...] = ()  # accepted model names; empty = no check (single-model deployments)
    max_prompt_bytes: int = 4 << 20  # UTF-8 bytes of instruction + context + question
    max_request_id_chars: int = 128


@dataclass(frozen=True)
class ResolvedRequest:
    """A validated request with every default filled in: what the engine should run. Its settings read flat
    (``resolved.gen_length``, ``resolved.kv_mode``, ``resolved.decode_policy``); ``generation_settings()``
    / ``method_settings()`` / ``decode_policy_settings()`` group them."""

    request_id: str
    model: str
    context: str
    question: str
    instruction: str | None
    generation: GenerationSettings
    method_config: MethodSettings
    policy_config: DecodePolicySettings = DecodePolicySettings()

    def __getattr__(self, name: str) -> Any:
        for group in ("generation", "method_config", "policy_config"):
            values = self.__dict__.get(group)
            if values is not None and name in type(values).model_fields:
                return getattr(values, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def generation_settings(self) -> GenerationSettings:
        return self.generation

    def method_settings(self) -> MethodSettings:
        return self.method_config

    def decode_policy_settings(self) -> DecodePolicySettings:
        return self.policy_config


def set_fields(message: Message, names: Iterable[str]) -> dict[str, Any]:
    """The fields among ``names`` that ``message`` sets: optional ones that are present, others non-empty."""
    fields = message.DESCRIPTOR.fields_by_name
    return {
        n: getattr(message, n)
        for n in names
        if (message.HasField(n) if fields[n].has_presence else getattr(message, n))
    }


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


def _check(cls: type[settings.S], values: dict[str, Any], group: str, rid: str) -> settings.S:
    try:
        return settings.validate(cls, values, label=lambda name: f"{group}.{name}", request=True)
    except SettingError as err:
        raise InvalidRequestError(err.kind, err.message, request_id=rid or None) from None


def resolve_generation(
    gen: pb.GenerationParams, defaults: RequestDefaults, rid: str = ""
) -> GenerationSettings:
    """The request's generation settings, unset ones from ``defaults`` (the bounds are the schema's). A
    default block or step count that does not fit the request's length becomes one block, one step per
    token."""
    given = set_fields(gen, GenerationSettings.model_fields)
    values = {name: getattr(defaults, name) for name in GenerationSettings.model_fields} | given
    length = values["gen_length"]
    if isinstance(length, int) and length > 0:
        if "block_length" not in given:
            block = defaults.block_length or length
            values["block_length"] = block if length % block == 0 else length
        if "steps" not in given:
            block = values["block_length"]
            blocks = length // block if isinstance(block, int) and block > 0 and length % block == 0 else 1
            steps = defaults.steps or length
            # The fixed schedule spreads steps evenly over blocks; with a threshold, steps is only a cap.
            values["steps"] = (
                length if steps > length or (values["threshold"] is None and steps % blocks) else steps
            )
    return _check(GenerationSettings, values, "generation", rid)


def resolve_method(m: pb.MethodParams, defaults: RequestDefaults, rid: str = "") -> MethodSettings:
    values = {name: getattr(defaults, name) for name in MethodSettings.model_fields}
    return _check(MethodSettings, values | set_fields(m, MethodSettings.model_fields), "method", rid)


def resolve_decode_policy(
    p: pb.DecodePolicyParams, defaults: RequestDefaults, rid: str = ""
) -> DecodePolicySettings:
    """The request's decode-policy settings. A request that names a policy sets its knobs itself (unset
    ones: the schema's, i.e. the paper's values); one that names none takes the server's policy and knobs,
    its own knobs over them (a knob the resulting policy does not have is refused, not ignored)."""
    given = set_fields(p, DecodePolicySettings.model_fields)
    values = (
        {}
        if "decode_policy" in given
        else {n: getattr(defaults, n) for n in DecodePolicySettings.model_fields}
    )
    return _check(DecodePolicySettings, values | given, "decode_policy", rid)


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
        generation=resolve_generation(req.generation, defaults, rid),
        method_config=resolve_method(req.method, defaults, rid),
        policy_config=resolve_decode_policy(req.decode_policy, defaults, rid),
    )
