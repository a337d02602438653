"""The decode-policy config: which policy a decode runs and its knobs, as the decode loops take them.

Settings, not decode logic: prefill, the router, the RPC conversion and the composition carry it; the
policies themselves (``decode_service/policies``) run it. DyLLM's and FOCUS's knob sets
(:class:`DyLLMConfig`, :class:`FocusConfig`) are plain configs too and live here with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdllm.shared.decode_policy_settings import (
    COMPUTE_SKIP,
    DYLLM_DEFAULTS,
    DYLLM_KNOBS,
    FOCUS_DEFAULTS,
    FOCUS_SETTINGS,
    POLESTAR_DEFAULTS,
    POLESTAR_KNOBS,
    SPARSE_DEFAULTS,
    DecodePolicySettings,
)
from pdllm.shared.settings import Label, validate

# The paper's τ per model (§4.2.3: "0.99 for LLaDA and 0.995 for Dream"; Table 2 also runs Dream at 0.9975).
PAPER_THRESHOLDS = {"dream": 0.995, "llada": 0.99}


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
    """

    threshold: float | None = None
    full_steps: int = 4
    full_sequence_interval: int = 4
    approximate_attention: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise a ValueError naming the first knob out of its range."""
        t = self.threshold
        if t is not None and (
            isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 < t <= 1
        ):
            raise ValueError(f"dyllm_threshold must be in (0, 1] (1: every row salient), got {t!r}")
        for name, value in (
            ("dyllm_full_steps", self.full_steps),
            ("dyllm_full_sequence_interval", self.full_sequence_interval),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.approximate_attention, bool):
            raise ValueError(
                f"dyllm_approximate_attention must be a bool, got {self.approximate_attention!r}"
            )

    def threshold_for(self, family: str) -> float:
        """τ for a model family: the knob, or the paper's value for that family."""
        if self.threshold is not None:
            return float(self.threshold)
        if family not in PAPER_THRESHOLDS:
            raise ValueError(f"DyLLM has no paper threshold for family {family!r}; set dyllm_threshold")
        return PAPER_THRESHOLDS[family]


# Settings names the lead can wire (``--focus-alpha`` ...) -> FocusConfig fields.
FOCUS_KNOBS: dict[str, str] = {
    "focus_alpha": "alpha",
    "focus_pool_kernel": "pool_kernel",
    "focus_budget": "budget",
    "focus_delayed_cache": "delayed_cache",
}


@dataclass(frozen=True)
class FocusConfig:
    """FOCUS's knobs, the paper's values by default; checked on construction (:meth:`validate`).

    ``alpha``: Eq. 4's expansion factor (> 1; §5.2 adopts 1.5). ``pool_kernel``: Eq. 2's MaxPool1D kernel
    (odd; §F.1: 3; 1 = no pooling). ``budget``: a fixed K instead of Eq. 4 (§5.1's fixed-K study; None:
    dynamic); ``budget >= block length`` evicts nothing. ``delayed_cache``: §4.3's intra-block KV cache
    (frozen stable decoded rows; part of FOCUS, E.3.4). The paper's other defaults are generation
    settings, not FOCUS's: block length 32 and confidence threshold 0.8 (§5.2).
    """

    alpha: float = 1.5
    pool_kernel: int = 3
    budget: int | None = None
    delayed_cache: bool = True
    name: str = "focus"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise a ValueError naming the first knob out of its range."""
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a) or a <= 1:
            raise ValueError(f"focus alpha must be a finite number > 1 (Eq. 4 of the paper), got {a!r}")
        k = self.pool_kernel
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or k % 2 == 0:
            raise ValueError(f"focus pool_kernel must be an odd integer >= 1 (the paper: 3), got {k!r}")
        b = self.budget
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"focus budget must be None (dynamic, Eq. 4) or an integer >= 1, got {b!r}")
        if not isinstance(self.delayed_cache, bool):
            raise ValueError(f"focus delayed_cache must be a bool, got {self.delayed_cache!r}")

    @classmethod
    def from_settings(cls, values: dict[str, Any]) -> FocusConfig:
        """From settings names (:data:`FOCUS_KNOBS`); unset ones take the paper's values."""
        unknown = set(values) - set(FOCUS_KNOBS)
        if unknown:
            raise ValueError(f"unknown focus knobs {sorted(unknown)}; known: {list(FOCUS_KNOBS)}")
        return cls(**{FOCUS_KNOBS[n]: v for n, v in values.items() if v is not None})


_DEFAULTS = DecodePolicySettings()


@dataclass(frozen=True)
class DecodePolicyConfig:
    """The decode-policy settings (``settings.DecodePolicySettings``: defaults, bounds, help) as the decode
    loop runs them. ``refresh_steps``: also refresh every N steps within a block (None: at block starts).
    Sparse-dLLM's ``retention`` (r), ``pool_kernel`` (s) and ``delay_steps``: None takes the paper's value
    (:meth:`sparse`); set under another policy, they are refused."""

    name: str = _DEFAULTS.decode_policy
    refresh_steps: int | None = _DEFAULTS.cache_refresh_steps
    retention: float | None = None
    pool_kernel: int | None = None
    delay_steps: int | None = None
    # Polestar-Cache's knobs by setting name (``polestar_clusters``, ...); unset ones take the paper's.
    polestar: Mapping[str, Any] = field(default_factory=dict)
    # DyLLM's and FOCUS's knobs by setting name (``dyllm_threshold``, ``focus_alpha``, ...), likewise.
    dyllm: Mapping[str, Any] = field(default_factory=dict)
    focus: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, label: Label = str) -> None:
        """Raise a ``settings.SettingError`` (a ValueError) naming the first setting the schema refuses."""
        values = {
            "decode_policy": self.name,
            "cache_refresh_steps": self.refresh_steps,
            "sparse_retention": self.retention,
            "sparse_pool_kernel": self.pool_kernel,
            "sparse_delay_steps": self.delay_steps,
        }
        for group, knobs, given in (
            ("polestar", POLESTAR_KNOBS, self.polestar),
            ("dyllm", DYLLM_KNOBS, self.dyllm),
            ("focus", FOCUS_SETTINGS, self.focus),
        ):
            unknown = set(given) - set(knobs)
            if unknown:
                raise ValueError(f"unknown {group} knobs {sorted(unknown)}; known: {list(knobs)}")
            values |= dict(given)
        validate(DecodePolicySettings, values, label=label)

    def sparse(self) -> tuple[float, int, int]:
        """Sparse-dLLM's (retention, pool kernel, delay steps), the paper's values where unset."""
        r, s, d = self.retention, self.pool_kernel, self.delay_steps
        return (
            float(SPARSE_DEFAULTS["sparse_retention"] if r is None else r),
            int(SPARSE_DEFAULTS["sparse_pool_kernel"] if s is None else s),
            int(SPARSE_DEFAULTS["sparse_delay_steps"] if d is None else d),
        )

    def polestar_knobs(self) -> dict[str, Any]:
        """Polestar-Cache's knobs, the paper's values where unset."""
        return {n: self.polestar.get(n, POLESTAR_DEFAULTS[n]) for n in POLESTAR_KNOBS}

    def dyllm_config(self) -> DyLLMConfig:
        """DyLLM's knobs as its loop takes them, the paper's values where unset (threshold: per family)."""
        k = {n: self.dyllm.get(n, DYLLM_DEFAULTS[n]) for n in DYLLM_KNOBS}
        threshold = k["dyllm_threshold"]
        return DyLLMConfig(
            threshold=None if threshold is None else float(threshold),
            full_steps=int(k["dyllm_full_steps"]),
            full_sequence_interval=int(k["dyllm_full_sequence_interval"]),
            approximate_attention=k["dyllm_approximate_attention"] == "on",
        )

    def focus_config(self) -> FocusConfig:
        """FOCUS's knobs as its loop takes them, the paper's values where unset."""
        k = {n: self.focus.get(n, FOCUS_DEFAULTS[n]) for n in FOCUS_SETTINGS}
        budget = k["focus_budget"]
        return FocusConfig(
            alpha=float(k["focus_alpha"]),
            pool_kernel=int(k["focus_pool_kernel"]),
            budget=None if budget is None else int(budget),
            delayed_cache=k["focus_delayed_cache"] == "on",
        )

    @property
    def skips_compute(self) -> bool:
        """Whether it is a compute-skipping policy (``decode_service/policies/compute_skip.py``), not a
        cache policy."""
        return self.name in COMPUTE_SKIP

    @property
    def caches(self) -> bool:
        """Whether it changes the plain loop at all (``none`` runs it untouched; the compute-skipping
        policies reuse cached activations too)."""
        return self.name != "none"
