"""The decode-policy settings group (as the decode loops take it: ``decode_policy.DecodePolicyConfig``).

Its own module to keep ``settings.py`` short; it uses that module's machinery, and ``settings`` re-exports
what is here (``settings.DecodePolicySettings``), so callers name every setting group the same way.
Derived from it like the other groups: the ``pdllm.v1.DecodePolicyParams`` fields of a request (validation,
wire <-> config conversion), the ``generate`` / ``eval`` / ``ask`` / ``serve`` flags. Each policy's knob is
declared once, by :func:`knob`: its name, type, bounds, help and the paper's value an unset knob takes; the
knob groups, :func:`paper_default` and the runtime configs (``decode_policy.py``: ``DecodePolicyConfig`` is
this model with the decode loops' accessors; ``DyLLMConfig``, ``FocusConfig``) read them from the fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field

from pdllm.shared.settings import Label, Ref, SettingError, Settings, Spec, validate

DecodePolicyName = Literal["none", "prefix-cache", "dual-cache", "sparse-dllm", "polestar", "dyllm", "focus"]
CACHING = "prefix-cache, dual-cache, sparse-dllm or polestar"
# Policies that skip computation inside a step instead of planning a KV cache (DyLLM, FOCUS): they have no
# cache to refresh, so cache_refresh_steps is refused under them as under none.
COMPUTE_SKIP = ("dyllm", "focus")
ResidualFormat = Literal["int8", "fp8", "none"]
PolestarRecompute = Literal["propagated", "per-layer"]
# A switch of a knob group: a string choice, so that flags, variables and the wire field (optional string)
# take it like any other choice setting (the schema is strict and has no bool settings).
Switch = Literal["on", "off"]
# DyLLM's τ per model family (§4.2.3: "0.99 for LLaDA and 0.995 for Dream"; Table 2 also runs Dream at
# 0.9975): what an unset dyllm_threshold takes.
PAPER_THRESHOLDS = {"dream": 0.995, "llada": 0.99}


def _shown(value: Any) -> str:
    return str(value) if value is None or isinstance(value, str) else f"{value:g}"


def knob(policy: str, paper: Any, description: str, **bounds: Any) -> Any:
    """The field of one knob of ``policy``: unset (None) it takes ``paper``, the paper's value, which is
    declared here only: ``{paper}`` in ``description`` shows it, :func:`paper_default` reads it, and the
    runtime configs (``decode_policy.py``, the policies' dataclasses) take it from there. A knob set under
    another policy is refused (``_rules``), so set and unset stay apart. ``bounds``: pydantic's."""
    return Field(
        None,
        description=f"{policy}: " + description.format(paper=_shown(paper)),
        json_schema_extra={"policy": policy, "paper": paper},
        **bounds,
    )


class DecodePolicySettings(Settings):
    """Decode-side KV reuse across denoising steps."""

    decode_policy: DecodePolicyName = Field(
        "none",
        description="reuse question/answer KV across the steps of a block: none, prefix-cache (Fast-dLLM: "
        "the KV before the current block), dual-cache (also the KV of the later blocks) or sparse-dllm "
        "(dual cache taken one step late, keeping only the KV the block attends to most), polestar (dual "
        "cache recomputing drifting cached rows), dyllm (per layer, only rows whose attention context moved "
        "recompute) or focus (SDAR block-diffusion models only: only the block tokens predicted decodable go "
        "past layer 1)",
    )
    cache_refresh_steps: int | None = Field(
        None,
        gt=0,
        le=4096,
        description="also refresh the decode cache every N steps within a block (none: only when a block "
        "starts; 1: every step, the same as no cache)",
    )
    sparse_retention: float | None = knob(
        "sparse-dllm",
        0.5,
        "share r of the KV outside the current block that the cache keeps (none: {paper}, the paper's; "
        "1: keep all)",
        gt=0,
        le=1,
    )
    sparse_pool_kernel: int | None = knob(
        "sparse-dllm",
        3,
        "odd max-pooling kernel s over the saliency scores, so neighbours of a salient token are kept too "
        "(none: {paper}, the paper's; 1: no pooling)",
        gt=0,
        le=255,
    )
    sparse_delay_steps: int | None = knob(
        "sparse-dllm",
        1,
        "full steps at a block's start before the cache is taken (none: {paper}, the paper's; 0: at the "
        "block's first step, as Fast-dLLM)",
        ge=0,
        le=4096,
    )

    polestar_clusters: int | None = knob(
        "polestar",
        8,
        "spherical k-means clusters C of the cached hidden states per layer, split between the rows before "
        "and after the block by length (none: {paper}, the paper's)",
        ge=1,
        le=1024,
    )
    polestar_top_clusters: Annotated[int | None, Spec(le=Ref("polestar_clusters"))] = knob(
        "polestar",
        2,
        "clusters M with the largest drift (KL proxy) refreshed per layer and update, at most "
        "polestar_clusters (none: {paper}, the paper's)",
        ge=1,
        le=1024,
    )
    polestar_update_threshold: int | None = knob(
        "polestar",
        4,
        "a drift update runs once more than T tokens were unmasked since the last one (none: {paper}, the "
        "paper's; 0: every step)",
        ge=0,
        le=4096,
    )
    # 0: the top-M clusters are refreshed whatever their KL, as the paper's §4.2 does.
    polestar_drift_threshold: float | None = knob(
        "polestar",
        0.0,
        "a cluster is refreshed only if its KL proxy is at least this (none: {paper}, the paper's top-M "
        "rule alone)",
        ge=0,
        le=1e6,
    )
    polestar_residual_format: ResidualFormat | None = knob(
        "polestar",
        "int8",
        "format of the hidden-state residuals offloaded to CPU memory: int8 or fp8 (e4m3, per-row scale) "
        "or none (kept exact; none: {paper})",
    )
    polestar_recompute: PolestarRecompute | None = knob(
        "polestar",
        "propagated",
        "rows an update recomputes at a layer: its drifting clusters' rows plus every row recomputed at the "
        "layers before (propagated, the paper's 'propagates update signals to subsequent layers') or its "
        "drifting clusters' rows alone (per-layer) (none: {paper})",
    )

    # Unset, the threshold is the paper's for the model family (``PAPER_THRESHOLDS``).
    dyllm_threshold: float | None = knob(
        "dyllm",
        None,
        "a row is salient at a layer when the cosine similarity of its attention context to the last "
        f"step's is below this (none: the paper's, {PAPER_THRESHOLDS['dream']} Dream, "
        f"{PAPER_THRESHOLDS['llada']} LLaDA; 1: every row)",
        gt=0,
        le=1,
    )
    dyllm_full_steps: int | None = knob(
        "dyllm",
        4,
        "the decode's first forwards that compute every row and fill the caches (none: {paper})",
        ge=1,
        le=4096,
    )
    dyllm_full_sequence_interval: int | None = knob(
        "dyllm",
        4,
        "every N-th forward queries every local row, the others the answer only (none: {paper}; 1: every "
        "forward)",
        ge=1,
        le=4096,
    )
    dyllm_approximate_attention: Switch | None = knob(
        "dyllm",
        "on",
        "on: stable rows update their cached context by the salient rows' value deltas; off: they attend "
        "exactly (none: {paper})",
    )
    focus_alpha: float | None = knob(
        "focus",
        1.5,
        "expansion factor of the dynamic budget K = ceil(alpha * tokens decoded per step) (none: {paper}, "
        "the paper's)",
        gt=1,
        le=64,
    )
    focus_pool_kernel: int | None = knob(
        "focus",
        3,
        "odd max-pooling kernel over the importance scores (none: {paper}; 1: no pooling)",
        ge=1,
        le=255,
    )
    # Unset: Eq. 4's dynamic K.
    focus_budget: int | None = knob(
        "focus",
        None,
        "a fixed budget K of block tokens kept past layer 1 (none: the dynamic budget; the block length: "
        "nothing evicted)",
        ge=1,
        le=4096,
    )
    focus_delayed_cache: Switch | None = knob(
        "focus",
        "on",
        "on: a decoded token whose right neighbour is decoded is forwarded once more, then frozen (its K/V "
        "reused) for the rest of the block; off: never frozen (none: {paper})",
    )

    def _rules(self, label: Label) -> None:
        policy = self.decode_policy
        if (policy == "none" or policy in COMPUTE_SKIP) and self.cache_refresh_steps is not None:
            message = f"{label('cache_refresh_steps')} needs a caching {label('decode_policy')} "
            message += f"({CACHING}), not {policy}"
            raise SettingError("cache_refresh_steps", "cache_refresh_steps_without_policy", message)
        for owner, knobs in KNOB_GROUPS.items():
            for name in knobs:
                if policy != owner and getattr(self, name) is not None:
                    message = f"{label(name)} needs {label('decode_policy')} {owner}, not {policy}"
                    raise SettingError(name, f"{name}_without_{owner.replace('-', '_')}", message)
        # The schema bound (Spec) applies when polestar_clusters is set; unset, it is the paper's.
        clusters = self.polestar_clusters or paper_default("polestar_clusters")
        top = self.polestar_top_clusters
        if top is not None and top > clusters:
            message = f"{label('polestar_top_clusters')} must be at most {label('polestar_clusters')} "
            message += f"({clusters}), got {top}"
            raise SettingError("polestar_top_clusters", "polestar_top_clusters_above_clusters", message)
        for name in ("sparse_pool_kernel", "focus_pool_kernel"):
            kernel = getattr(self, name)
            if kernel is not None and kernel % 2 == 0:
                # Stride-1 pooling padded by s // 2 keeps one score per candidate only for an odd s.
                message = f"{label(name)} must be odd (got {kernel}): max-pooling with an even "
                message += "kernel does not keep one score per token"
                raise SettingError(name, f"{name}_even", message)


def _extra(name: str) -> dict[str, Any]:
    extra = DecodePolicySettings.model_fields[name].json_schema_extra
    return extra if isinstance(extra, dict) else {}


# Each policy's knobs (setting names, in declaration order), read from the fields (:func:`knob`).
KNOB_GROUPS: dict[str, tuple[str, ...]] = {}
for _name in DecodePolicySettings.model_fields:
    if "policy" in _extra(_name):
        KNOB_GROUPS.setdefault(str(_extra(_name)["policy"]), ())
        KNOB_GROUPS[str(_extra(_name)["policy"])] += (_name,)
SPARSE_KNOBS = KNOB_GROUPS["sparse-dllm"]
POLESTAR_KNOBS = KNOB_GROUPS["polestar"]
DYLLM_KNOBS = KNOB_GROUPS["dyllm"]
FOCUS_SETTINGS = KNOB_GROUPS["focus"]


def paper_default(name: str) -> Any:
    """The value the knob ``name`` takes when unset: the paper's, declared once in its field (:func:`knob`)."""
    extra = _extra(name)
    if "paper" not in extra:
        raise KeyError(f"{name} is no decode-policy knob; knobs: {sum(KNOB_GROUPS.values(), ())}")
    return extra["paper"]


def decode_policy_config(values: Mapping[str, Any], *, label: Label = str) -> Any:
    """A validated ``DecodePolicyConfig`` (the settings themselves, with the decode loops' accessors)."""
    from pdllm.shared.decode_policy import DecodePolicyConfig

    # Checked here, not by DecodePolicyConfig's own constructor, so that errors name settings by ``label``.
    return DecodePolicyConfig(**dict(validate(DecodePolicySettings, values, label=label)))
