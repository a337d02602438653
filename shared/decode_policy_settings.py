"""The decode-policy settings group (as the decode loops take it: ``decode_policy.DecodePolicyConfig``).

Its own module to keep ``settings.py`` short; it uses that module's machinery, and ``settings`` re-exports
what is here (``settings.DecodePolicySettings``), so callers name every setting group the same way.
Derived from it like the other groups: the ``pdllm.v1.DecodePolicyParams`` fields of a request (validation,
wire <-> config conversion), the ``generate`` / ``eval`` / ``ask`` / ``serve`` flags.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field

from pdllm.shared.settings import Label, Ref, SettingError, Settings, Spec, validate

DecodePolicyName = Literal["none", "prefix-cache", "dual-cache", "sparse-dllm", "polestar", "dyllm", "focus"]
CACHING = "prefix-cache, dual-cache, sparse-dllm or polestar"
# Policies that skip computation inside a step instead of planning a KV cache
# (``decode_service/policies/compute_skip.py``):
# they have no cache to refresh, so cache_refresh_steps is refused under them as under none.
COMPUTE_SKIP = ("dyllm", "focus")
# Sparse-dLLM's own knobs: None takes the paper's value (``SPARSE_DEFAULTS``), so a knob that is set can be
# told apart from one that is not, and refused under another policy instead of silently ignored.
SPARSE_KNOBS = ("sparse_retention", "sparse_pool_kernel", "sparse_delay_steps")
SPARSE_DEFAULTS: dict[str, float | int] = {
    "sparse_retention": 0.5,
    "sparse_pool_kernel": 3,
    "sparse_delay_steps": 1,
}
# Polestar-Cache's knobs, likewise (``POLESTAR_DEFAULTS``: the paper's C = 8, M = 2, T = 4; a drift
# threshold of 0 selects the top-M clusters whatever their KL, as the paper's §4.2 does).
POLESTAR_KNOBS = (
    "polestar_clusters",
    "polestar_top_clusters",
    "polestar_update_threshold",
    "polestar_drift_threshold",
    "polestar_residual_format",
)
POLESTAR_DEFAULTS: dict[str, float | int | str] = {
    "polestar_clusters": 8,
    "polestar_top_clusters": 2,
    "polestar_update_threshold": 4,
    "polestar_drift_threshold": 0.0,
    "polestar_residual_format": "int8",
}
ResidualFormat = Literal["int8", "fp8", "none"]
# A switch of a knob group: a string choice, so that flags, variables and the wire field (optional string)
# take it like any other choice setting (the schema is strict and has no bool settings).
Switch = Literal["on", "off"]
# DyLLM's knobs (``decode_policy.DyLLMConfig``); unset ones take the paper's values (``DYLLM_DEFAULTS``;
# the threshold's is per model family: 0.995 Dream, 0.99 LLaDA).
DYLLM_KNOBS = (
    "dyllm_threshold",
    "dyllm_full_steps",
    "dyllm_full_sequence_interval",
    "dyllm_approximate_attention",
)
DYLLM_DEFAULTS: dict[str, float | int | str | None] = {
    "dyllm_threshold": None,
    "dyllm_full_steps": 4,
    "dyllm_full_sequence_interval": 4,
    "dyllm_approximate_attention": "on",
}
# FOCUS's knobs (``decode_policy.FocusConfig``, ``FOCUS_KNOBS``), likewise (budget unset: Eq. 4's dynamic K).
FOCUS_SETTINGS = ("focus_alpha", "focus_pool_kernel", "focus_budget", "focus_delayed_cache")
FOCUS_DEFAULTS: dict[str, float | int | str | None] = {
    "focus_alpha": 1.5,
    "focus_pool_kernel": 3,
    "focus_budget": None,
    "focus_delayed_cache": "on",
}
# Every knob group: (its knobs, the policy they need).
KNOB_GROUPS = ((SPARSE_KNOBS, "sparse-dllm"), (POLESTAR_KNOBS, "polestar"), (DYLLM_KNOBS, "dyllm"))
KNOB_GROUPS += ((FOCUS_SETTINGS, "focus"),)


class DecodePolicySettings(Settings):
    """Decode-side KV reuse across denoising steps."""

    decode_policy: DecodePolicyName = Field(
        "none",
        description="reuse question/answer KV across the steps of a block: none, prefix-cache (Fast-dLLM: "
        "the KV before the current block), dual-cache (also the KV of the later blocks) or sparse-dllm "
        "(dual cache taken one step late, keeping only the KV the block attends to most), polestar (dual "
        "cache recomputing drifting cached rows), dyllm (per layer, only rows whose attention context moved "
        "recompute) or focus (only the block tokens predicted decodable go past layer 1)",
    )
    cache_refresh_steps: int | None = Field(
        None,
        gt=0,
        le=4096,
        description="also refresh the decode cache every N steps within a block (none: only when a block "
        "starts; 1: every step, the same as no cache)",
    )
    sparse_retention: float | None = Field(
        None,
        gt=0,
        le=1,
        description="sparse-dllm: share r of the KV outside the current block that the cache keeps "
        "(none: 0.5, the paper's; 1: keep all)",
    )
    sparse_pool_kernel: int | None = Field(
        None,
        gt=0,
        le=255,
        description="sparse-dllm: odd max-pooling kernel s over the saliency scores, so neighbours of a "
        "salient token are kept too (none: 3, the paper's; 1: no pooling)",
    )
    sparse_delay_steps: int | None = Field(
        None,
        ge=0,
        le=4096,
        description="sparse-dllm: full steps at a block's start before the cache is taken (none: 1, the "
        "paper's; 0: at the block's first step, as Fast-dLLM)",
    )

    polestar_clusters: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="polestar: spherical k-means clusters C of the cached hidden states per layer, split "
        "between the rows before and after the block by length (none: 8, the paper's)",
    )
    polestar_top_clusters: Annotated[int | None, Spec(le=Ref("polestar_clusters"))] = Field(
        None,
        ge=1,
        le=1024,
        description="polestar: clusters M with the largest drift (KL proxy) refreshed per layer and update, "
        "at most polestar_clusters (none: 2, the paper's)",
    )
    polestar_update_threshold: int | None = Field(
        None,
        ge=0,
        le=4096,
        description="polestar: a drift update runs once more than T tokens were unmasked since the last one "
        "(none: 4, the paper's; 0: every step)",
    )
    polestar_drift_threshold: float | None = Field(
        None,
        ge=0,
        le=1e6,
        description="polestar: a cluster is refreshed only if its KL proxy is at least this (none: 0, "
        "the paper's top-M rule alone)",
    )
    polestar_residual_format: ResidualFormat | None = Field(
        None,
        description="polestar: format of the hidden-state residuals offloaded to CPU memory: int8 or fp8 "
        "(e4m3, per-row scale) or none (kept exact; none: int8)",
    )

    dyllm_threshold: float | None = Field(
        None,
        gt=0,
        le=1,
        description="dyllm: a row is salient at a layer when the cosine similarity of its attention context "
        "to the last step's is below this (none: the paper's, 0.995 Dream, 0.99 LLaDA; 1: every row)",
    )
    dyllm_full_steps: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="dyllm: the decode's first forwards that compute every row and fill the caches (none: 4)",
    )
    dyllm_full_sequence_interval: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="dyllm: every N-th forward queries every local row, the others the answer only "
        "(none: 4; 1: every forward)",
    )
    dyllm_approximate_attention: Switch | None = Field(
        None,
        description="dyllm: on: stable rows update their cached context by the salient rows' value deltas; "
        "off: they attend exactly (none: on)",
    )
    focus_alpha: float | None = Field(
        None,
        gt=1,
        le=64,
        description="focus: expansion factor of the dynamic budget K = ceil(alpha * tokens decoded per "
        "step) (none: 1.5, the paper's)",
    )
    focus_pool_kernel: int | None = Field(
        None,
        ge=1,
        le=255,
        description="focus: odd max-pooling kernel over the importance scores (none: 3; 1: no pooling)",
    )
    focus_budget: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="focus: a fixed budget K of block tokens kept past layer 1 (none: the dynamic budget; "
        "the block length: nothing evicted)",
    )
    focus_delayed_cache: Switch | None = Field(
        None,
        description="focus: on: a decoded token whose right neighbour is decoded is forwarded once more, "
        "then frozen (its K/V reused) for the rest of the block; off: never frozen (none: on)",
    )

    def _rules(self, label: Label) -> None:
        policy = self.decode_policy
        if (policy == "none" or policy in COMPUTE_SKIP) and self.cache_refresh_steps is not None:
            message = f"{label('cache_refresh_steps')} needs a caching {label('decode_policy')} "
            message += f"({CACHING}), not {policy}"
            raise SettingError("cache_refresh_steps", "cache_refresh_steps_without_policy", message)
        for knobs, owner in KNOB_GROUPS:
            for name in knobs:
                if policy != owner and getattr(self, name) is not None:
                    message = f"{label(name)} needs {label('decode_policy')} {owner}, not {policy}"
                    raise SettingError(name, f"{name}_without_{owner.replace('-', '_')}", message)
        # The schema bound (Spec) applies when polestar_clusters is set; unset, it is the paper's 8.
        clusters = self.polestar_clusters or int(POLESTAR_DEFAULTS["polestar_clusters"])
        top = self.polestar_top_clusters
        if top is not None and top > clusters:
            message = f"{label('polestar_top_clusters')} must be at most {label('polestar_clusters')} "
            message += f"({clusters}), got {top}"
            raise SettingError("polestar_top_clusters", "polestar_top_clusters_above_clusters", message)
        kernel = self.sparse_pool_kernel
        if kernel is not None and kernel % 2 == 0:
            # Stride-1 pooling padded by s // 2 keeps one score per candidate only for an odd s.
            message = f"{label('sparse_pool_kernel')} must be odd (got {kernel}): max-pooling with an even "
            message += "kernel does not keep one score per token"
            raise SettingError("sparse_pool_kernel", "sparse_pool_kernel_even", message)
        kernel = self.focus_pool_kernel
        if kernel is not None and kernel % 2 == 0:
            message = f"{label('focus_pool_kernel')} must be odd (got {kernel}): max-pooling with an even "
            message += "kernel does not keep one score per token"
            raise SettingError("focus_pool_kernel", "focus_pool_kernel_even", message)


def decode_policy_config(values: Mapping[str, Any], *, label: Label = str) -> Any:
    """A validated ``DecodePolicyConfig`` from decode-policy settings."""
    from pdllm.shared.decode_policy import DecodePolicyConfig

    s = validate(DecodePolicySettings, values, label=label)
    return DecodePolicyConfig(
        name=s.decode_policy,
        refresh_steps=s.cache_refresh_steps,
        retention=s.sparse_retention,
        pool_kernel=s.sparse_pool_kernel,
        delay_steps=s.sparse_delay_steps,
        polestar={n: getattr(s, n) for n in POLESTAR_KNOBS if getattr(s, n) is not None},
        dyllm={n: getattr(s, n) for n in DYLLM_KNOBS if getattr(s, n) is not None},
        focus={n: getattr(s, n) for n in FOCUS_SETTINGS if getattr(s, n) is not None},
    )
