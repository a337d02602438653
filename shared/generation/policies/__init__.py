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
forward is unchanged; its per-session state lives in ``LocalKVCache.aux``).

**On the decode worker (now).** A request's ``decode_policy`` (``pdllm.v1.DecodePolicyParams``) runs this
reference loop, **not batched**: the scheduler steps its :class:`PolicySession` alone, one step per
iteration, beside the batched rounds of the other requests (``decode_service/policy_sessions.py``).

**Batched rounds (decided, not built yet).** A decode round of the server advances every active session
by one step. Sessions are grouped by the *shape of their step's plan*, not by policy name: each round runs
one forward per group, (a) full-row steps (no policy, and every policy's refresh steps), padded per shape
bucket as today, and (b) partial steps, keyed by the number of forwarded rows (dual cache: block length
(+1 on Dream), the same every cached step, so it buckets and graph-captures well; prefix cache: shrinking
as blocks complete, bucketed like query lengths; sparse-dllm: the dual cache's rows over
``floor((N - b) r)`` cached entries per layer, fixed per request). Mixing a 33-row cached step into a 1,000-row forward
would pad it away and lose what the cache saves; two forwards per round cost one more launch sequence.
Each session's local KV cache lives at a fixed address beside its static KV in the paged pool (a refresh
rewrites it in place), so the partial-step graphs stay replayable.
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
