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
stateless (:class:`CachePolicy`); the loop (``runner.PolicyLogits``, a logits function ``denoise`` drives)
owns the cache and the counters, and the sampler still decides what to unmask.

**Policies.** ``none`` (the plain loops), Fast-dLLM's ``prefix-cache`` / ``dual-cache`` (``fast_dllm.py``),
``sparse-dllm`` (``sparse_dllm.py``), ``polestar`` (``polestar.py``: the dual cache plus a drift-triggered
recompute of cached rows). ``dyllm`` (``dyllm*.py``) and ``focus`` (``focus*.py``) skip work inside the
forward instead: ``make_policy`` returns None for them and ``compute_skip.py`` builds their loops.

**On the decode worker** these loops are the reference. Caching policies (Polestar-Cache included) and
plain sessions, vanilla or pdllm, run in the batched rounds (``policy_rounds.py``, ``polestar_rounds.py``);
FOCUS too (``focus_rounds.py`` on Dream/LLaDA, ``sdar_focus_rounds.py`` on SDAR: its rows change after
layer 1, ``split_rounds.py``); DyLLM too (``dyllm_rounds.py``: its cached K/V, contexts and FFN outputs
edited inside each layer, ``layer_edits.py``).
"""

from pdllm.shared.decode_policy import DecodePolicyConfig

from .base import CachePolicy, RowSelector, StepContext, StepPlan
from .fast_dllm import DualCache, PrefixCache
from .polestar import Polestar
from .runner import CacheStats, PolicyLogits, denoise_with_policy, make_policy, run_policy
from .sparse_dllm import SaliencyKeep, SparseDLLM

__all__ = [
    "CachePolicy",
    "CacheStats",
    "DecodePolicyConfig",
    "DualCache",
    "PolicyLogits",
    "Polestar",
    "PrefixCache",
    "RowSelector",
    "SaliencyKeep",
    "SparseDLLM",
    "StepContext",
    "StepPlan",
    "denoise_with_policy",
    "make_policy",
    "run_policy",
]
