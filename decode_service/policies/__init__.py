"""Decode policies: which local rows a denoising step recomputes and which K/V it reuses from a cache.

A step's *local rows* are what a plain step forwards (vanilla: prompt + response; pdllm: query suffix +
response). pdllm's static chunk KV is the method's (read by its attention backend), never a policy's, so
every policy composes with every method. The config that names a policy and its knobs is a setting
(``shared/decode_policy.py``: ``DecodePolicyConfig``); this package runs it.

**Interface** (``base.py``). Per step the loop builds a :class:`StepContext` and the policy returns a
:class:`StepPlan`: ``refresh`` (forward every local row, its K/V becoming the cache; ``record=False``: a
plain full step), or rows ``[lo, hi)`` over the cached K/V of the others (``decode_service/local_cache.py``);
optionally ``keep`` (per layer, the rows the cache keeps, chosen inside the refresh forward), ``visible``
(per layer, the rows its queries see) and ``rows_hook`` (per-layer recompute of cached rows). Policies are
stateless (:class:`CachePolicy`); the session running them (the decode worker's rounds,
``policy_rounds.py``; the reference loop, ``tests/reference/policy.py``) owns the cache and the counters
(:class:`CacheStats`), and the sampler still decides what to unmask.

**Policies.** ``none`` (the plain loops), Fast-dLLM's ``prefix-cache`` / ``dual-cache`` (``fast_dllm.py``),
``sparse-dllm`` (``sparse_dllm.py``), ``polestar`` (``polestar.py``: the dual cache plus a drift-triggered
recompute of cached rows). ``dyllm`` (``dyllm_base.py``) and ``focus`` (``focus*.py``; SDAR only) skip
work inside the forward instead: :func:`make_policy` returns None for them.

**On the decode worker** every policy runs in the batched rounds; the one-request reference loops they are
tested against are ``tests/reference/``'s. Caching policies (Polestar-Cache included) and plain sessions,
vanilla or pdllm, run in ``policy_rounds.py`` and ``polestar_rounds.py``; FOCUS, on SDAR (block
diffusion) models only, in ``sdar_focus_rounds.py`` (its rows change after layer 1, ``split_rounds.py``);
DyLLM in ``dyllm_rounds.py`` (its cached K/V, contexts and FFN outputs edited inside each layer,
``layer_edits.py``).
"""

from pdllm.shared.decode_policy import DecodePolicyConfig

from .base import CachePolicy, CacheStats, RowSelector, StepContext, StepPlan
from .fast_dllm import DualCache, PrefixCache
from .polestar import Polestar
from .sparse_dllm import SaliencyKeep, SparseDLLM

__all__ = [
    "CachePolicy",
    "CacheStats",
    "DecodePolicyConfig",
    "DualCache",
    "Polestar",
    "PrefixCache",
    "RowSelector",
    "SaliencyKeep",
    "SparseDLLM",
    "StepContext",
    "StepPlan",
    "make_policy",
]


def make_policy(config: DecodePolicyConfig) -> CachePolicy | None:
    """The policy a config names (None for ``none``, ``dyllm`` and ``focus``: no cache policy)."""
    config.validate()
    if config.name == "prefix-cache":
        return PrefixCache(config.refresh_steps)
    if config.name == "dual-cache":
        return DualCache(config.refresh_steps)
    if config.name == "sparse-dllm":
        retention, kernel, delay = config.sparse()
        return SparseDLLM(retention, kernel, delay, config.refresh_steps)
    if config.name == "polestar":
        knobs = {n.removeprefix("polestar_"): v for n, v in config.polestar_knobs().items()}
        return Polestar(**knobs, refresh_steps=config.refresh_steps)
    return None
