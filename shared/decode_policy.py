"""The decode-policy config: which policy a decode runs and its knobs, as the decode loops take them.

Settings, not decode logic: prefill, the router, the RPC conversion and the composition carry it; the
policies themselves (``decode_service/policies``) run it. :class:`DecodePolicyConfig` is the settings model
(``decode_policy_settings.DecodePolicySettings``) with the loops' accessors, not a copy of it. DyLLM's and
FOCUS's knob sets (:class:`DyLLMConfig`, :class:`FocusConfig`) are the typed configs their loops take; their
fields are the knobs without the policy's prefix and their defaults are read from the settings fields.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdllm.shared.decode_policy_settings import (
    COMPUTE_SKIP,
    DYLLM_KNOBS,
    FOCUS_SETTINGS,
    KNOB_GROUPS,
    PAPER_THRESHOLDS,
    POLESTAR_KNOBS,
    SPARSE_KNOBS,
    DecodePolicySettings,
    paper_default,
)
from pdllm.shared.settings import Label, bounds, choices, validate


def _runtime(name: str, value: Any) -> Any:
    """A knob's setting value as a runtime config holds it: a switch (on / off) as a bool."""
    return value == "on" if choices(DecodePolicySettings, name) == ("on", "off") else value


def _paper(name: str) -> Any:
    """The paper's value of a knob (declared in its settings field) as a runtime config holds it."""
    return _runtime(name, paper_default(name))


def _below(name: str, value: float) -> bool:
    """Whether ``value`` is under a knob's lower bound, read from its settings field (a runtime config built
    directly keeps that bound, not the upper one that settings keep)."""
    lo, lo_open, _, _ = bounds(DecodePolicySettings, name, {}, request=False)
    return value <= lo if lo_open else value < lo


def _least(name: str) -> str:
    """A knob's lower bound as the runtime configs' errors state it: ``>= 1``, ``> 1``."""
    lo, lo_open, _, _ = bounds(DecodePolicySettings, name, {}, request=False)
    return f"{'>' if lo_open else '>='} {lo:g}"


def replay_ceil(value: float) -> int:
    """``ceil(value)`` with float rounding under 1e-9 forgiven (``0.7 * 10`` is 7, not 8): the row counts
    the ``replay_*`` knobs below force."""
    return math.ceil(value - 1e-9)


def check_replay_knob(
    name: str, value: float | None, top: float | None = 1.0, above_zero: bool = False
) -> None:
    """A ``replay_*`` knob: None, or a finite number in ``[0, top]`` (``top`` None: no upper bound;
    ``above_zero``: 0 excluded)."""
    if value is None:
        return
    bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
    if bad or value < 0 or (above_zero and value == 0) or (top is not None and value > top):
        low = "> 0" if above_zero else ">= 0"
        span = low if top is None else f"in {'(' if above_zero else '['}0, {top:g}]"
        raise ValueError(f"{name} must be None or a number {span}, got {value!r}")


def _from_settings(group: str, fields: Mapping[str, str], values: Mapping[str, Any]) -> dict[str, Any]:
    """Runtime-config keyword arguments from knobs named as settings; unset (None) ones are left out."""
    unknown = set(values) - set(fields)
    if unknown:
        raise ValueError(f"unknown {group} knobs {sorted(unknown)}; known: {list(fields)}")
    return {fields[n]: _runtime(n, v) for n, v in values.items() if v is not None}


@dataclass(frozen=True)
class DyLLMConfig:
    """DyLLM's knobs, named as the settings would name them (``dyllm_<knob>``); defaults are the paper's.

    ``threshold`` (τ, §3.2): a row is salient at a layer when the cosine similarity of its attention
    context to the previous step's is below τ; None takes the paper's value for the model family
    (:data:`PAPER_THRESHOLDS`). τ = 1 makes every row salient at every layer, the incoming rows of the
    first layer included (plain decoding when every step also queries the full sequence).
    ``full_steps`` (§3.2, App. C.1: 4): the decode's first forwards are FullSteps that compute every row and
    fill the caches. ``full_sequence_interval`` (§3.5, App. C.1: 4): every N-th forward queries all local
    rows, the others the response only (plus the row before it on shifted-logit models); 1: every step
    queries all. ``approximate_attention`` (§3.3, Table 1's "Salient + Approx."): stable rows update their
    cached context by the salient rows' value deltas; False: they attend exactly ("Salient").

    ``replay_ffn_frac`` (benchmarks only, not a setting; None: τ decides): at each layer of a SparseStep the
    ``ceil(f x queried rows)`` rows of lowest context cosine (ties: the lower row) are salient instead of
    those under τ, so a recorded share of FFN rows (``schedule.policy_fractions``' ``ffn_frac``) can be
    replayed on other weights. FullSteps and the first layer's incoming rows are unchanged.
    """

    threshold: float | None = _paper("dyllm_threshold")
    full_steps: int = _paper("dyllm_full_steps")
    full_sequence_interval: int = _paper("dyllm_full_sequence_interval")
    approximate_attention: bool = _paper("dyllm_approximate_attention")
    replay_ffn_frac: float | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise a ValueError naming the first knob out of its range."""
        t = self.threshold
        lo, lo_open, hi, _ = bounds(DecodePolicySettings, "dyllm_threshold", {}, request=False)
        if t is not None and (
            isinstance(t, bool)
            or not isinstance(t, (int, float))
            or not math.isfinite(t)
            or _below("dyllm_threshold", t)
            or t > hi
        ):
            interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
            raise ValueError(f"dyllm_threshold must be in {interval} (1: every row salient), got {t!r}")
        for name, value in (
            ("dyllm_full_steps", self.full_steps),
            ("dyllm_full_sequence_interval", self.full_sequence_interval),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or _below(name, value):
                raise ValueError(f"{name} must be an integer {_least(name)}, got {value!r}")
        if not isinstance(self.approximate_attention, bool):
            raise ValueError(
                f"dyllm_approximate_attention must be a bool, got {self.approximate_attention!r}"
            )
        check_replay_knob("dyllm replay_ffn_frac", self.replay_ffn_frac)

    def threshold_for(self, family: str) -> float:
        """τ for a model family: the knob, or the paper's value for that family."""
        if self.threshold is not None:
            return float(self.threshold)
        if family not in PAPER_THRESHOLDS:
            raise ValueError(f"DyLLM has no paper threshold for family {family!r}; set dyllm_threshold")
        return PAPER_THRESHOLDS[family]

    @classmethod
    def from_settings(cls, values: Mapping[str, Any]) -> DyLLMConfig:
        """From settings names (:data:`DYLLM_FIELDS`); unset ones take the paper's values."""
        return cls(**_from_settings("dyllm", DYLLM_FIELDS, values))


# Settings names (``--dyllm-threshold`` ...) -> DyLLMConfig fields, and (``--focus-alpha`` ...) -> FocusConfig
# fields: the name without its policy's prefix.
DYLLM_FIELDS: dict[str, str] = {n: n.removeprefix("dyllm_") for n in DYLLM_KNOBS}
FOCUS_KNOBS: dict[str, str] = {n: n.removeprefix("focus_") for n in FOCUS_SETTINGS}


@dataclass(frozen=True)
class FocusConfig:
    """FOCUS's knobs, the paper's values by default; checked on construction (:meth:`validate`).

    ``alpha``: Eq. 4's expansion factor (> 1; §5.2 adopts 1.5). ``pool_kernel``: Eq. 2's MaxPool1D kernel
    (odd; §F.1: 3; 1 = no pooling). ``budget``: a fixed K instead of Eq. 4 (§5.1's fixed-K study; None:
    dynamic); ``budget >= block length`` evicts nothing. ``delayed_cache``: §4.3's intra-block KV cache
    (frozen stable decoded rows; part of FOCUS, E.3.4). The paper's other defaults are generation
    settings, not FOCUS's: block length 32 and confidence threshold 0.8 (§5.2).

    ``replay_retained_frac`` f (benchmarks only, not a setting; None: Eq. 4 or ``budget`` decides; in
    ``(0, 1]``): K is ``ceil(f x block rows)``, at least 1 and still raised to a fixed schedule's quota; the
    top-K masked rows by dI then take the same AR-context, placeholder and context rows, so a recorded
    share of rows retained (``schedule.policy_fractions``' ``retained_frac``) can be replayed on other
    weights.
    """

    alpha: float = _paper("focus_alpha")
    pool_kernel: int = _paper("focus_pool_kernel")
    budget: int | None = _paper("focus_budget")
    delayed_cache: bool = _paper("focus_delayed_cache")
    name: str = "focus"
    replay_retained_frac: float | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise a ValueError naming the first knob out of its range."""
        a = self.alpha
        if (
            isinstance(a, bool)
            or not isinstance(a, (int, float))
            or not math.isfinite(a)
            or _below("focus_alpha", a)
        ):
            least = _least("focus_alpha")
            raise ValueError(f"focus alpha must be a finite number {least} (Eq. 4 of the paper), got {a!r}")
        k = self.pool_kernel
        if isinstance(k, bool) or not isinstance(k, int) or _below("focus_pool_kernel", k) or k % 2 == 0:
            least, paper = _least("focus_pool_kernel"), _paper("focus_pool_kernel")
            raise ValueError(
                f"focus pool_kernel must be an odd integer {least} (the paper: {paper}), got {k!r}"
            )
        b = self.budget
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or _below("focus_budget", b)):
            least = _least("focus_budget")
            raise ValueError(f"focus budget must be None (dynamic, Eq. 4) or an integer {least}, got {b!r}")
        if not isinstance(self.delayed_cache, bool):
            raise ValueError(f"focus delayed_cache must be a bool, got {self.delayed_cache!r}")
        check_replay_knob("focus replay_retained_frac", self.replay_retained_frac, above_zero=True)

    @classmethod
    def from_settings(cls, values: Mapping[str, Any]) -> FocusConfig:
        """From settings names (:data:`FOCUS_KNOBS`); unset ones take the paper's values."""
        return cls(**_from_settings("focus", FOCUS_KNOBS, values))


class DecodePolicyConfig(DecodePolicySettings):
    """The decode-policy settings (``settings.DecodePolicySettings``: defaults, bounds, help) as the decode
    loop runs them: the validated settings themselves, plus the loops' accessors. Constructed from the
    loops' names: ``name`` (the policy), ``refresh_steps`` (also refresh every N steps within a block; None:
    at block starts), Sparse-dLLM's ``retention`` (r), ``pool_kernel`` (s) and ``delay_steps``, and the
    other knob groups by setting name (``polestar={"polestar_clusters": 4}``, ``dyllm=...``,
    ``focus=...``); or from setting names (``decode_policy=...``). Unset knobs take the paper's values
    (:meth:`sparse`, :meth:`polestar_knobs`, :meth:`dyllm_config`, :meth:`focus_config`); a knob set
    under another policy is refused (``settings.SettingError``, a ValueError)."""

    def __init__(
        self,
        name: str | None = None,
        refresh_steps: int | None = None,
        *,
        retention: float | None = None,
        pool_kernel: int | None = None,
        delay_steps: int | None = None,
        polestar: Mapping[str, Any] | None = None,
        dyllm: Mapping[str, Any] | None = None,
        focus: Mapping[str, Any] | None = None,
        **values: Any,
    ) -> None:
        named = zip(
            ("decode_policy", "cache_refresh_steps", *SPARSE_KNOBS),
            (name, refresh_steps, retention, pool_kernel, delay_steps),
            strict=True,
        )
        values |= {n: v for n, v in named if v is not None}
        for group, given in (("polestar", polestar), ("dyllm", dyllm), ("focus", focus)):
            knobs = KNOB_GROUPS[group]
            unknown = set(given or {}) - set(knobs)
            if unknown:
                raise ValueError(f"unknown {group} knobs {sorted(unknown)}; known: {list(knobs)}")
            values |= dict(given or {})
        # Checked as every group is, for the SettingError naming the first setting the schema refuses.
        super().__init__(**dict(validate(DecodePolicySettings, values)))

    def __repr_args__(self) -> Any:
        return [(n, v) for n, v in super().__repr_args__() if v is not None]

    def validate(self, label: Label = str) -> None:  # type: ignore[override]
        """Raise a ``settings.SettingError`` (a ValueError) naming the first setting the schema refuses."""
        validate(DecodePolicySettings, dict(self), label=label)

    # The loops' names of the settings; a knob group's set knobs by setting name (``polestar_clusters``, ...).
    name = property(lambda self: self.decode_policy)
    refresh_steps = property(lambda self: self.cache_refresh_steps)
    retention = property(lambda self: self.sparse_retention)
    pool_kernel = property(lambda self: self.sparse_pool_kernel)
    delay_steps = property(lambda self: self.sparse_delay_steps)
    polestar = property(lambda self: {n: v for n in POLESTAR_KNOBS if (v := getattr(self, n)) is not None})
    dyllm = property(lambda self: {n: v for n in DYLLM_KNOBS if (v := getattr(self, n)) is not None})
    focus = property(lambda self: {n: v for n in FOCUS_SETTINGS if (v := getattr(self, n)) is not None})

    def knobs(self, policy: str) -> dict[str, Any]:
        """A policy's knobs by setting name, the paper's values where unset."""
        return {n: paper_default(n) if (v := getattr(self, n)) is None else v for n in KNOB_GROUPS[policy]}

    def sparse(self) -> tuple[float, int, int]:
        """Sparse-dLLM's (retention, pool kernel, delay steps), the paper's values where unset."""
        r, s, d = self.knobs("sparse-dllm").values()
        return float(r), int(s), int(d)

    def polestar_knobs(self) -> dict[str, Any]:
        """Polestar-Cache's knobs, the paper's values where unset."""
        return self.knobs("polestar")

    def dyllm_config(self) -> DyLLMConfig:
        """DyLLM's knobs as its loop takes them, the paper's values where unset (threshold: per family)."""
        return DyLLMConfig.from_settings(self.dyllm)

    def focus_config(self) -> FocusConfig:
        """FOCUS's knobs as its loop takes them, the paper's values where unset."""
        return FocusConfig.from_settings(self.focus)

    @property
    def skips_compute(self) -> bool:
        """Whether it is a compute-skipping policy (DyLLM, FOCUS: work skipped inside the forward), not a
        cache policy."""
        return self.name in COMPUTE_SKIP

    @property
    def caches(self) -> bool:
        """Whether it changes the plain loop at all (``none`` runs it untouched; the compute-skipping
        policies reuse cached activations too)."""
        return self.name != "none"
