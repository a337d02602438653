"""Decode policies: which rows a denoising step recomputes and which K/V it reuses from a cache (issue 17).

**What a policy concerns.** A plain decode step forwards its *local rows*: vanilla's prompt + response,
pdllm's query suffix + response. Anything else the step attends to belongs to the method and stays as it
is: pdllm's static chunk KV (chunk selection, top-B) is read by the method's attention backend
(``decode_service.decode.StaticPolicy``: which *static* KV the decode sees), never by a decode policy. A
decode policy only decides about local rows, so every policy composes with every method and kv mode.

**The interface** (``base.py``). Per step the loop builds a :class:`StepContext` (step, block, step in
block, the block's local rows, the rows before it whose hidden states its logits need) and the policy
returns a :class:`StepPlan`:

- ``refresh``: forward every local row and keep each layer's K/V as the cache (a full step, the same
  computation as a plain step), or
- rows ``[lo, hi)``: forward those rows only; at every layer they attend to the cached K/V of the other
  rows and their own fresh K/V (``shared/model/local_cache.py``, a wrapper around the method's backend);
- ``keep`` (refresh steps, optional): per layer, the rows whose K/V the cache holds, chosen from that
  layer's queries and keys during the refresh forward itself (Sparse-dLLM's saliency top-k): the later
  partial steps see only those rows and their own. The selection is made *in* the forward because it
  needs that forward's queries; the cache then holds the kept rows only (memory falls with them, and a
  cached step gathers nothing);
- ``record`` (refresh steps): False makes a plain full step that leaves the cache as it is (Sparse-dLLM's
  steps before its delayed cache update);
- ``visible`` (per layer, optional): the local rows that layer's queries may see, over a cache that holds
  every row (a mask decided before the forward).

The plan must cover the rows the step's logits come from (the block, plus the row before it on Dream).
Policies are stateless (:class:`CachePolicy`); the loop (``runner.PolicyLogits``) owns the cache and the
counters. The sampler (``generation/sampler.py``) is still the one place that decides what to unmask: the
policy-driven loop is a logits function like any other, driven by ``denoise``.

**Policies so far.** ``none`` (the plain loops, untouched), Fast-dLLM's ``prefix-cache`` and
``dual-cache`` (``fast_dllm.py``: refresh at each block's first step, optionally every N steps),
``sparse-dllm`` (``sparse_dllm.py``: the cache taken one step late, ``keep`` = the block queries'
max-pooled attention over the rows outside the block at retention r), ``polestar`` (``polestar.py``,
reference path: the dual cache plus, per layer, a drift-triggered recompute of some cached rows from their
kept hidden states: ``StepPlan.rows_hook``, called by ``local_cache.LocalCacheAttention`` at every layer
with the merged K/V; it reads layer inputs through forward pre-hooks on the model's layers, so the model's
forward is unchanged; its per-session state lives in ``LocalKVCache.aux``). The compute-skipping ``dyllm``
(``dyllm.py``) and ``focus`` (``focus.py``) are no :class:`CachePolicy` (they skip work inside the forward,
not rows of it): ``make_policy`` returns None for them and ``compute_skip.py`` builds their loops for
vanilla, the engine and the decode worker alike.

**On the decode worker.** Prefix-cache, dual-cache and Sparse-dLLM sessions of pdllm requests run in the **batched
rounds** (``decode_service/policy_rounds.py``): one forward per round for every active session, whatever
its policy. Rows are packed ragged, so a session contributes what its plan forwards (a cached dual-cache
step: the block, +1 row on Dream) and nothing is padded to the longest session. Each session's cache of
local K/V lives in pool pages reserved after its static KV, written by its refresh steps inside the round's
forward, and read by its cached steps as paged KV through the same split-S call as the static KV, so the
round graphs (one per padded shape bucket) replay for them too. Those sessions equal this reference loop
token for token (``tests/decode/test_policy_rounds.py``); Sparse-dLLM's ``keep`` is chosen inside the
round's forward and compacted into the cache slots (a fixed ``floor((N - b) r)`` per layer), that round
running eagerly. Plans with ``visible`` or ``rows_hook`` (Polestar-Cache), the compute-skipping policies
and any policy on a vanilla request still run their reference loops, stepped alone beside the rounds
(``decode_service/policy_sessions.py``).
"""

from .base import CachePolicy, DecodePolicyConfig, RowSelector, StepContext, StepPlan
from .fast_dllm import DualCache, PrefixCache
from .polestar import Polestar
from .runner import CacheStats, PolicyLogits, PolicySession, denoise_with_policy, make_policy, run_policy
from .sparse_dllm import SaliencyKeep, SparseDLLM

__all__ = [
    "CachePolicy",
    "CacheStats",
    "DecodePolicyConfig",
    "DualCache",
    "PolicyLogits",
    "Polestar",
    "PolicySession",
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
