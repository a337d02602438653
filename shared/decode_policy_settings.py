"""The decode-policy settings group (``shared/generation/policies``; ``DecodePolicyConfig``).

Its own module to keep ``settings.py`` short; it uses that module's machinery, and ``settings`` re-exports
what is here (``settings.DecodePolicySettings``), so callers name every setting group the same way.
Derived from it like the other groups: the ``pdllm.v1.DecodePolicyParams`` fields of a request (validation,
wire <-> config conversion), the ``generate`` / ``eval`` / ``ask`` / ``serve`` flags.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from pdllm.shared.settings import Label, SettingError, Settings, validate

DecodePolicyName = Literal["none", "prefix-cache", "dual-cache", "sparse-dllm"]
CACHING = "prefix-cache, dual-cache or sparse-dllm"
# Sparse-dLLM's own knobs: None takes the paper's value (``SPARSE_DEFAULTS``), so a knob that is set can be
# told apart from one that is not, and refused under another policy instead of silently ignored.
SPARSE_KNOBS = ("sparse_retention", "sparse_pool_kernel", "sparse_delay_steps")
SPARSE_DEFAULTS: dict[str, float | int] = {
    "sparse_retention": 0.5,
    "sparse_pool_kernel": 3,
    "sparse_delay_steps": 1,
}


class DecodePolicySettings(Settings):
    """Decode-side KV reuse across denoising steps."""

    decode_policy: DecodePolicyName = Field(
        "none",
        description="reuse question/answer KV across the steps of a block: none, prefix-cache (Fast-dLLM: "
        "the KV before the current block), dual-cache (also the KV of the later blocks) or sparse-dllm "
        "(dual cache taken one step late, keeping only the KV the block attends to most)",
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

    def _rules(self, label: Label) -> None:
        policy = self.decode_policy
        if policy == "none" and self.cache_refresh_steps is not None:
            message = f"{label('cache_refresh_steps')} needs a caching {label('decode_policy')} "
            message += f"({CACHING}), not none"
            raise SettingError("cache_refresh_steps", "cache_refresh_steps_without_policy", message)
        for name in SPARSE_KNOBS:
            if policy != "sparse-dllm" and getattr(self, name) is not None:
                message = f"{label(name)} needs {label('decode_policy')} sparse-dllm, not {policy}"
                raise SettingError(name, f"{name}_without_sparse_dllm", message)
        kernel = self.sparse_pool_kernel
        if kernel is not None and kernel % 2 == 0:
            # Stride-1 pooling padded by s // 2 keeps one score per candidate only for an odd s.
            message = f"{label('sparse_pool_kernel')} must be odd (got {kernel}): max-pooling with an even "
            message += "kernel does not keep one score per token"
            raise SettingError("sparse_pool_kernel", "sparse_pool_kernel_even", message)


def decode_policy_config(values: Mapping[str, Any], *, label: Label = str) -> Any:
    """A validated ``DecodePolicyConfig`` from decode-policy settings."""
    from pdllm.shared.generation.policies.base import DecodePolicyConfig

    s = validate(DecodePolicySettings, values, label=label)
    return DecodePolicyConfig(
        name=s.decode_policy,
        refresh_steps=s.cache_refresh_steps,
        retention=s.sparse_retention,
        pool_kernel=s.sparse_pool_kernel,
        delay_steps=s.sparse_delay_steps,
    )
