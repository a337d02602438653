"""The request settings, declared once; everything else about a setting is derived from here.

A setting is one pydantic field: name (the ``pdllm.v1`` proto field, the flag ``--top-k``, the variable
``PDLLM_TOP_K``), type, default, bounds or choices, help; a :class:`Spec` beside it says what pydantic cannot
(the tighter bounds of public requests, a bound that is another setting, when it applies, its engine name).
Derived from it: request validation (``rpc/validation.py``), wire <-> config conversion (``rpc/convert.py``),
``EngineConfig.validate`` / ``GenerationConfig.validate``, the ``generate`` / ``ask`` flags
(``settings_flags.py``). A violation is a :class:`SettingError` (a ValueError) naming the setting as its
caller spells it (``method.top_k`` on the wire, ``--top-k`` on the command line, ``top_k`` in
``EngineConfig``) with the accepted values, and a stable ``kind`` tag (``top_k_range``,
``unknown_kv_mode``) for clients.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar, get_args

from annotated_types import Ge, Gt, Le
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import core_schema

T = TypeVar("T")
S = TypeVar("S", bound="Settings")
Label = Callable[[str], str]

Method = Literal["vanilla", "pdllm"]
KVMode = Literal["full-mask", "chunk-query", "chunk-only"]
ScoreMode = Literal["pseudo-label", "self-info", "query-only"]
PrefillAttention = Literal["causal", "bidirectional"]
RetentionScore = Literal["bidirectional", "query-to-chunk"]
ChunkBoundary = Literal["fixed", "sentence"]

# Beyond these, logits / temperature leaves float32's range (tiny values give inf, huge ones inf in the
# divisor), and no useful setting lies there.
MIN_TEMPERATURE = 1e-4
MAX_TEMPERATURE = 1e4


class SettingError(ValueError):
    """A setting with a value it may not have; ``str()`` names it as the caller spells it."""

    def __init__(self, name: str, kind: str, message: str) -> None:
        super().__init__(message)
        self.name, self.kind, self.message = name, kind, message


@dataclass(frozen=True)
class Ref:
    """A bound that is another setting's value plus ``offset``."""

    name: str
    offset: int = 0


@dataclass(frozen=True)
class Spec:
    """The schema's words beyond pydantic's: ``request_ge`` / ``request_le`` tighten the bounds for public
    requests; ``le`` is an upper bound everywhere; ``when`` = (setting, value) under which it applies at all;
    ``engine`` is the ``EngineConfig`` field when named differently ("" = none); ``kinds`` = the error kinds
    below / above the bounds (default: ``{name}_range``, ``_nonpositive``, ``_negative``, ``_too_large``)."""

    request_ge: int | None = None
    request_le: int | Ref | None = None
    le: Ref | None = None
    when: tuple[str, str] | None = None
    engine: str | None = None
    kinds: tuple[str, str] | None = None


@dataclass(frozen=True)
class OrZero:
    """0 is accepted besides the field's bounds; ``note`` says what it means."""

    note: str

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        def zero_or(value: Any, validate: Callable[[Any], Any]) -> Any:
            return 0.0 if type(value) in (int, float) and value == 0 else validate(value)

        return core_schema.no_info_wrap_validator_function(zero_or, handler(source))


class Settings(BaseModel):
    """A group of settings; validating one checks every bound (pydantic's, then the :class:`Spec` ones and
    the group's ``_rules``). Use :func:`validate` to get a :class:`SettingError` with the caller's names."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> "Settings":
        context = info.context or {}
        label, request = context.get("label", str), context.get("request", False)
        values = dict(self)
        for name, value in values.items():
            if value is None or not active(type(self), name, values):
                continue
            lo, lo_open, hi, _ = bounds(type(self), name, values, request, label)
            outside = (lo is not None and (value <= lo if lo_open else value < lo)) or (
                hi is not None and value > hi
            )
            if outside and not (value == 0 and _meta(type(self).model_fields[name], OrZero)):
                raise violation(type(self), name, values, label, request)
        self._rules(label)
        return self

    def _rules(self, label: Label) -> None:
        """Cross-setting rules that are not a bound (none by default)."""


class GenerationFields(Settings):
    """How the answer is denoised (``pdllm.v1.GenerationParams``; ``GenerationConfig``)."""

    gen_length: Annotated[
        int, Spec(request_le=4096, kinds=("gen_length_nonpositive", "gen_length_too_large"))
    ] = Field(32, gt=0, description="answer tokens (masked slots) to denoise")
    steps: Annotated[
        int | None, Spec(request_le=Ref("gen_length"), kinds=("steps_nonpositive", "steps_too_many"))
    ] = Field(
        None,
        gt=0,
        description="denoising steps over all blocks (none: one per token; a threshold makes it a cap)",
    )
    block_length: int | None = Field(
        None, gt=0, description="semi-autoregressive block length (none: one block)"
    )
    threshold: float | None = Field(
        None, gt=0, le=1, description="unmask all predictions above this confidence (none: fixed schedule)"
    )
    temperature: Annotated[float, Field(ge=MIN_TEMPERATURE, le=MAX_TEMPERATURE), OrZero("greedy")] = Field(
        0.0, description="sampling temperature (0: greedy)"
    )
    seed: int = Field(0, ge=0, description="sampling seed")


class GenerationSettings(GenerationFields):
    """Generation settings and the rules that tie them together."""

    def _rules(self, label: Label) -> None:
        gen, block = self.gen_length, self.block_length or self.gen_length
        gen_label, block_label = label("gen_length"), label("block_length")
        if gen % block:
            message = f"{gen_label} ({gen}) must be divisible by {block_label} ({block})"
            raise SettingError("block_length", "block_not_divisor", message)
        if self.threshold is None and self.steps is not None and self.steps % (gen // block):
            message = f"{label('steps')} ({self.steps}) must be a multiple of the number of blocks "
            message += f"({gen // block} = {gen_label} {gen} / {block_label} {block})"
            raise SettingError("steps", "steps_not_multiple_of_blocks", message)


PSEUDO_LABEL = ("score_mode", "pseudo-label")


class MethodSettings(Settings):
    """Which method runs and how it chunks, scores and keeps the context (``pdllm.v1.MethodParams``)."""

    method: Annotated[Method, Spec(engine="")] = Field("pdllm", description="vanilla or pdllm")
    chunk_size: Annotated[int, Spec(request_ge=16, request_le=16384)] = Field(
        1024, gt=0, description="C: context tokens per chunk"
    )
    top_k: Annotated[int, Spec(request_le=1024)] = Field(4, gt=0, description="K: chunks kept for decoding")
    top_b: Annotated[int | None, Spec(request_le=Ref("chunk_size", 1))] = Field(
        None, gt=0, description="B: tokens kept per chunk, its BOS included (none: all)"
    )
    kv_mode: KVMode = Field("full-mask", description="what decoding attends to")
    score_mode: ScoreMode = Field("pseudo-label", description="how chunks are scored against the question")
    pseudo_label_tokens: Annotated[int, Spec(request_le=64, when=PSEUDO_LABEL, engine="pseudo_labels")] = (
        Field(4, gt=0, description="pseudo-label tokens of pseudo-label scoring")
    )
    pseudo_label_rounds: Annotated[
        int, Spec(le=Ref("pseudo_label_tokens"), when=PSEUDO_LABEL, engine="pseudo_rounds")
    ] = Field(2, gt=0, description="denoising rounds that make the pseudo-labels")
    retention_score: RetentionScore = Field("bidirectional", description="how top-B ranks a chunk's tokens")
    query_window: Annotated[int | None, Spec(request_le=4096)] = Field(
        None, gt=0, description="query-only scoring: trailing query tokens scored (none: all)"
    )
    prefill_attention: PrefillAttention = Field("causal", description="attention of chunk scoring")


class EngineOnlySettings(Settings):
    """Engine settings no request carries."""

    chunk_boundary: ChunkBoundary = Field("fixed", description="fixed or sentence (a chunk may end early)")
    prefill_batch: int = Field(64, gt=0, description="chunks per batched prefill / scoring forward")
    retention_block: int = Field(1024, gt=0, description="attention rows at once for top-B scores")


class EngineSettings(MethodSettings, EngineOnlySettings):
    """Everything ``EngineConfig`` holds (its ``method`` is always the default)."""


# ---------------------------------------------------------------------------------------------------------
# Reading the schema


def _meta(field: FieldInfo, kind: type[T]) -> T | None:
    return next((m for m in field.metadata if isinstance(m, kind)), None)


def spec(cls: type[Settings], name: str) -> Spec:
    return _meta(cls.model_fields[name], Spec) or Spec()


def choices(cls: type[Settings], name: str) -> tuple[str, ...]:
    annotation = cls.model_fields[name].annotation
    # An optional choice (``Literal[...] | None``: unset takes a policy's default) has the same options.
    literal = [a for a in (annotation, *get_args(annotation)) if getattr(a, "__origin__", None) is Literal]
    return get_args(literal[0]) if literal else ()


def value_type(cls: type[Settings], name: str) -> type:
    """int, float or str: what a flag or an environment variable is converted with."""
    annotation = cls.model_fields[name].annotation
    if choices(cls, name):
        return str
    return next((t for t in (int, float, str) if t is annotation or t in get_args(annotation)), str)


def engine_name(cls: type[Settings], name: str) -> str | None:
    """The ``EngineConfig`` field of a setting (None: it has none)."""
    engine = spec(cls, name).engine
    return name if engine is None else engine or None


def active(cls: type[Settings], name: str, values: Mapping[str, Any]) -> bool:
    when = spec(cls, name).when
    return when is None or values.get(when[0], cls.model_fields[when[0]].default) == when[1]


def bounds(
    cls: type[Settings], name: str, values: Mapping[str, Any], request: bool, label: Label = str
) -> tuple[float | None, bool, float | None, str]:
    """(low, low is exclusive, high, why high) of ``name`` given the other ``values``."""
    field, extra = cls.model_fields[name], spec(cls, name)
    lo = hi = None
    lo_open, why = False, ""
    for m in field.metadata:
        if isinstance(m, Ge | Gt):
            lo, lo_open = (m.ge, False) if isinstance(m, Ge) else (m.gt, True)
        elif isinstance(m, Le):
            hi = m.le
    if request and extra.request_ge is not None:
        lo, lo_open = extra.request_ge, False
    for bound in (extra.le, extra.request_le if request else None):
        if isinstance(bound, Ref):
            other = values.get(bound.name, cls.model_fields[bound.name].default)
            if isinstance(other, int) and (hi is None or other + bound.offset < hi):
                hi, why = other + bound.offset, f", at most {label(bound.name)}"
                why += f" + {bound.offset}" if bound.offset else ""
        elif bound is not None and (hi is None or bound < hi):
            hi, why = bound, ""
    if lo_open and hi is not None and value_type(cls, name) is int:
        lo, lo_open = lo + 1, False  # an integer in (0, 64] reads better as [1, 64]
    return lo, lo_open, hi, why


def _number(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def violation(
    cls: type[Settings], name: str, values: Mapping[str, Any], label: Label, request: bool
) -> SettingError:
    """The error for ``values[name]`` being outside what the schema accepts, stating what it accepts."""
    value = values.get(name)
    options = choices(cls, name)
    if options:
        return SettingError(
            name, f"unknown_{name}", f"{label(name)} must be one of {', '.join(options)} (got {value!r})"
        )
    lo, lo_open, hi, why = bounds(cls, name, values, request, label)
    if lo is not None and hi is not None:
        accepted, kind = f"in {'(' if lo_open else '['}{_number(lo)}, {_number(hi)}]{why}", f"{name}_range"
    elif hi is not None:
        accepted, kind = f"<= {_number(hi)}{why}", f"{name}_too_large"
    else:
        accepted = f"{'>' if lo_open else '>='} {_number(lo)}"
        kind = f"{name}_negative" if lo == 0 and not lo_open else f"{name}_nonpositive"
    zero = _meta(cls.model_fields[name], OrZero)
    if zero:
        accepted = f"0 ({zero.note}) or {accepted}"
    if type(value) not in ((int,) if value_type(cls, name) is int else (int, float)):
        accepted = f"{'an integer' if value_type(cls, name) is int else 'a number'} {accepted}"
    elif (kinds := spec(cls, name).kinds) is not None:
        kind = kinds[1] if hi is not None and value > hi else kinds[0]
    return SettingError(name, kind, f"{label(name)} must be {accepted} (got {value!r})")


# ---------------------------------------------------------------------------------------------------------
# Validating


def validate(cls: type[S], values: Mapping[str, Any], *, label: Label = str, request: bool = False) -> S:
    """``values`` (a partial dict; the rest take the schema's defaults) checked against ``cls``; the first
    problem is a SettingError naming the setting with ``label(name)``. ``request``: also the bounds a
    public request must keep. A setting that does not apply (``Spec.when``) is kept but not checked."""
    context = {"label": label, "request": request}
    try:
        return cls.model_validate(values, context=context)
    except ValidationError as err:
        errors = err.errors()
    idle = set()  # settings that do not apply (Spec.when): their errors do not count
    for e in errors:
        name = str(e["loc"][0]) if e["loc"] else ""
        if not name:  # a rule of the group: the SettingError it raised
            error = e.get("ctx", {}).get("error")
            raise error if isinstance(error, SettingError) else SettingError("", e["type"], e["msg"])
        if name not in cls.model_fields:
            raise SettingError(name, "unknown_setting", f"unknown setting {label(name)}") from None
        if active(cls, name, values):
            raise violation(cls, name, values, label, request) from None
        idle.add(name)
    checked = validate(cls, {k: v for k, v in values.items() if k not in idle}, label=label, request=request)
    return checked.model_copy(update={k: values[k] for k in idle})


def generation_config(values: Mapping[str, Any], *, label: Label = str) -> Any:
    """A validated ``GenerationConfig`` from generation settings (unset steps: one per answer token)."""
    from pdllm.shared.generation.sampler import GenerationConfig

    s = validate(GenerationSettings, values, label=label)
    return GenerationConfig(**{**dict(s), "steps": s.steps or s.gen_length})


def engine_values(config: Any) -> dict[str, Any]:
    """An ``EngineConfig`` as settings (schema names)."""
    return {
        n: getattr(config, e) for n in EngineSettings.model_fields if (e := engine_name(EngineSettings, n))
    }


def engine_config(values: Mapping[str, Any], *, label: Label = str) -> Any:
    """A validated ``EngineConfig`` from engine settings named as in this schema."""
    from pdllm.shared.config import EngineConfig

    s = validate(EngineSettings, values, label=label)
    return EngineConfig(**{e: v for n, v in s if (e := engine_name(EngineSettings, n))})


# The decode-policy group lives in ``decode_policy_settings`` (it builds on this module, so importing it here
# would be circular); its names are served from there on first use, as if declared here.
_DECODE_POLICY_NAMES = ("DecodePolicyName", "DecodePolicySettings", "decode_policy_config")


def __getattr__(name: str) -> Any:
    if name in _DECODE_POLICY_NAMES:
        from pdllm.shared import decode_policy_settings

        return getattr(decode_policy_settings, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
