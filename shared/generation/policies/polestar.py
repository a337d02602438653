"""Polestar-Cache (Lee et al., ``../shared/papers/polestar-cache.txt``): drift-aware KV recalibration on top
of Fast-dLLM's dual cache. Reference path, written from the paper's §4; what the paper leaves open is
decided here and marked **choice**.

Per block (the block at local rows ``[o, e)``, forwarded rows ``F = [o - lead, e)``, cached rows
``I = local rows \\ F``, eq. 8):

1. **Refresh** (the block's first step, as the dual cache; also every ``refresh_steps``): a full forward.
   Per layer l the *input* hidden states ``h_i^l`` of the rows in I are kept (§4.1), clustered by
   spherical k-means, the prefix ``I ∩ [0, o)`` and suffix ``I ∩ [e, N)`` apart, with C clusters split by
   length (**choice**: ``C_pre = round(C n_pre / n)`` clamped so each non-empty span gets >= 1 and at
   most its rows; with C = 1 and both spans non-empty each gets one). K-means (**choice**, deterministic):
   unit rows ``u_i``, initial directions the rows ``floor(j n / k)``, assignment ``argmax_j u_i . c_j``
   (ties: lowest j), update ``c_j = normalize(sum of its u_i)`` (an empty cluster keeps its direction),
   until no assignment changes or 20 rounds.
2. **Centroids on the device, residuals on the CPU** (§4.1, delta quantization): per cluster the centroid
   ``mu_c`` = mean of its members' hidden states (**choice**: the mean, not the unit direction, so that
   residuals ``r_i = h_i - mu_c`` are small); residuals go to CPU memory as int8 (per-row scale absmax /
   127) or fp8 e4m3 (per-row scale absmax / 448), the CPU's stand-in for the paper's NVFP4; ``none``
   keeps ``h_i`` exact (no delta: ``mu + (h - mu)`` need not round back to ``h``). ``num_bytes`` counts it.
3. **Drift proxy** (§4.2), per layer on an update step: the proxy query of cluster c is the layer's
   query of its centroid, ``q_c = RoPE(W_q RMSNorm(mu_c), p_c)`` (**choice**: ``p_c`` = the members' mean
   position, rounded), against the keys of every local row as the step sees them (cache + the block's
   fresh K; the static chunk KV of pdllm is left out: it does not drift), ``P_c = softmax(q_c K^T /
   sqrt(d))`` per query head; drift ``KL_c = mean_heads sum_j P_c^t log(P_c^t / P_c^prev)``. **choice**:
   ``prev`` is the proxy of the previous *update* (or of the refresh), not of the previous step: steps
   without an update do not compute it, and drift accumulates until the cache is recalibrated.
4. **Selective refresh** (§4.2): the M clusters of largest KL among those with ``KL >= drift_threshold``
   (the paper's intro: "when drift exceeds a threshold"; 0 = §4.2's top-M alone; ties: lower cluster)
   give the rows ``D_l``; with the rows recomputed at earlier layers (their inputs changed: "propagates
   update signals to subsequent layers") ``D_l = D_{l-1} ∪ members``. Each row of ``D_l`` runs layer l
   in full: its input (exact for ``D_{l-1}``, dequantized from the CPU for the newly selected),
   RMSNorm, q/k/v, RoPE, attention over every local row (its own new K/V included) through the method's
   backend, o_proj, residual, MLP. Its new K/V replace the cache's (this and later steps read them) and
   its output becomes its input at layer l + 1, where the kept hidden states and the touched clusters'
   centroids (and their residuals, re-encoded) are updated ("we update the corresponding cluster
   centroids"). Cluster membership stays until the next refresh.
5. **When to update** (§4.3): an update runs when more than T tokens of the block were unmasked since the
   last one (the refresh counts as one). "More than T in one step" is contained in "more than T
   cumulatively", so one rule covers both; T = 0 updates at every step.

**Exact identities** (tested): with ``none`` residuals, T = 0 and M = C, every cached row is recomputed from
layer 0 at every step: plain decoding (the same rows through the same layers; row order in the GEMMs aside).
With a drift threshold no KL reaches (or T beyond the block), no row is ever recomputed: the dual cache.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from pdllm.shared.model.attention import AttentionBackend
from pdllm.shared.model.local_cache import LocalKVCache
from pdllm.shared.model.transformer import apply_rope

from .base import StepContext, StepPlan, refresh_due
from .polestar_store import ClusteredHidden, split_clusters

KMEANS_ROUNDS = 20


def proxy_log_attention(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``log softmax(q k^T / sqrt(d))`` ``[Hq, C, N]`` from proxy queries ``q`` ``[1, Hq, C, D]`` and keys
    ``k`` ``[1, Hkv, N, D]`` (GQA: query head h reads KV head h // group), in float32."""
    groups = q.shape[1] // k.shape[1]
    keys = k[0].float().repeat_interleave(groups, dim=0)
    logits = torch.einsum("hcd,hnd->hcn", q[0].float(), keys) / math.sqrt(q.shape[-1])
    return torch.log_softmax(logits, dim=-1)


def kl_drift(log_p: torch.Tensor, log_prev: torch.Tensor) -> torch.Tensor:
    """Per cluster ``mean_heads KL(P || P_prev)`` ``[C]`` from ``[Hq, C, N]`` log-probabilities."""
    return (log_p.exp() * (log_p - log_prev)).sum(-1).mean(0)


def select_clusters(kl: torch.Tensor, top: int, threshold: float) -> list[int]:
    """The ``top`` clusters of largest KL among those with ``KL >= threshold`` (ties: the lower index)."""
    order = torch.sort(kl, descending=True, stable=True).indices.tolist()
    return [c for c in order if float(kl[c]) >= threshold][:top]


@dataclass
class PolestarState:
    """One session's Polestar state (kept in ``LocalKVCache.aux``): per layer the clustered hidden states
    and the last proxy; the block's unmasked count at the last update; counters."""

    stores: list[ClusteredHidden] = field(default_factory=list)
    log_prev: list[torch.Tensor] = field(default_factory=list)
    unmasked_at_update: int = 0
    updates: int = 0
    rows_recomputed: int = 0
    # Set per update step: rows recomputed at the previous layer and their inputs to this layer.
    carried_rows: torch.Tensor | None = None
    carried_x: torch.Tensor | None = None
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # refresh: layer inputs, by layer

    def num_bytes(self) -> int:
        return sum(s.num_bytes() for s in self.stores)


def _project(layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Layer ``layer``'s RoPE'd q, k, v ``[1, H, n, D]`` of inputs ``x`` ``[1, n, hidden]`` (the eager ops
    of ``transformer.SelfAttention``, so a recomputed row matches a forwarded one)."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    q, k, v = attn.qkv(h) if attn.qkv is not None else (attn.q_proj(h), attn.k_proj(h), attn.v_proj(h))
    n = x.shape[1]
    q = q.view(1, n, attn.num_heads, attn.head_dim).transpose(1, 2)
    k = k.view(1, n, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    v = v.view(1, n, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


@dataclass
class PolestarStep:
    """One step's per-layer hook (a ``local_cache.RowsHook``): at a refresh, cluster and offload each
    layer's cached hidden states; at a partial step, detect drift and recompute the drifting rows."""

    policy: Polestar
    lo: int  # forwarded rows [lo, hi): the block (and the lead row)
    hi: int
    block_start: int
    block_end: int
    unmasked: int
    model: Any = None
    positions: torch.Tensor | None = None
    update: bool = False
    _state_holder: dict[int, torch.Tensor] = field(default_factory=dict)  # layer inputs (refresh)

    @contextmanager
    def attach(self, model: Any, positions: torch.Tensor) -> Iterator[None]:
        """Around the forward: keep the model (layer weights, RoPE) and, at a refresh, each layer's input."""
        self.model, self.positions = model, positions
        self._state_holder = {}
        handles = []
        for i, layer in enumerate(model.model.layers):

            def grab(_module: Any, args: tuple[Any, ...], i: int = i) -> None:
                self._state_holder[i] = args[0]

            handles.append(layer.register_forward_pre_hook(grab))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _state(self, cache: LocalKVCache) -> PolestarState:
        state = cache.aux.get("polestar")
        if not isinstance(state, PolestarState):
            state = cache.aux["polestar"] = PolestarState()
        return state

    def _proxy(self, layer: int, store: ClusteredHidden, k: torch.Tensor) -> torch.Tensor:
        assert self.model is not None and self.positions is not None
        pos = store.centroid_positions[None]
        cos, sin = self.model.model.rotary_emb(pos, store.centroids.dtype)
        q, _, _ = _project(self.model.model.layers[layer], store.centroids[None], cos, sin)
        return proxy_log_attention(q, k)

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LocalKVCache,
        inner: AttentionBackend,
        record: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.model is None or self.positions is None:
            raise RuntimeError("polestar's rows hook runs attached to the model (PolicyLogits does it)")
        state = self._state(cache)
        if record:
            self._record(layer, k, state)
            return k, v
        if layer == 0:
            due = self.unmasked - state.unmasked_at_update > self.policy.update_threshold
            self.update = due
            if due:
                state.unmasked_at_update, state.updates = self.unmasked, state.updates + 1
                state.carried_rows, state.carried_x = None, None
        if not self.update:
            return k, v
        return self._update(layer, k, v, cache, inner, state)

    def _record(self, layer: int, k: torch.Tensor, state: PolestarState) -> None:
        if layer == 0:
            state.stores.clear()
            state.log_prev.clear()
            state.unmasked_at_update = self.unmasked
        x = self._state_holder[layer][0]  # [N, hidden]: this layer's input, every local row
        n = x.shape[0]
        rows = torch.cat([torch.arange(0, self.lo), torch.arange(self.hi, n)]).to(x.device)
        spans = split_clusters(self.policy.clusters, self.lo, n - self.hi)
        assert self.positions is not None
        store = ClusteredHidden.build(
            x, rows, self.positions[0], self.lo, spans, self.policy.residual_format, KMEANS_ROUNDS
        )
        state.stores.append(store)
        state.log_prev.append(self._proxy(layer, store, k) if store.clusters else torch.empty(0))

    def _update(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LocalKVCache,
        inner: AttentionBackend,
        state: PolestarState,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.model is not None and self.positions is not None
        store = state.stores[layer]
        if state.carried_rows is not None:  # the previous layer's recomputed rows: their new inputs here
            store.update(state.carried_rows, state.carried_x)
        chosen: list[int] = []
        if store.clusters:
            log_p = self._proxy(layer, store, k)
            kl = kl_drift(log_p, state.log_prev[layer])
            chosen = select_clusters(kl, self.policy.top_clusters, self.policy.drift_threshold)
            state.log_prev[layer] = log_p
        fresh = store.members(chosen)
        carried = state.carried_rows
        rows = fresh if carried is None else torch.unique(torch.cat([carried, fresh]))  # ascending
        if rows.numel() == 0:
            state.carried_rows, state.carried_x = None, None
            return k, v
        x = store.hidden(rows)  # fetched and dequantized; the carried rows' exact inputs replace theirs
        if carried is not None and state.carried_x is not None:
            at = torch.searchsorted(rows, carried)
            x = x.index_copy(0, at, state.carried_x)
        layer_mod = self.model.model.layers[layer]
        cos, sin = self.model.model.rotary_emb(self.positions[:, rows], x.dtype)
        qd, kd, vd = _project(layer_mod, x[None], cos, sin)
        cache.replace(layer, rows, kd, vd)
        k, v = k.index_copy(2, rows, kd), v.index_copy(2, rows, vd)
        attn = layer_mod.self_attn
        n = rows.numel()
        # Queries padded to a power of two: the recomputed row count changes at every layer and update, and
        # on CUDA SDPA's cuDNN backend builds a plan per new shape (~37 ms each). Rows attend independently.
        padded = F.pad(qd, (0, 0, 0, (1 << max(n - 1, 15).bit_length()) - n))
        out = inner(layer, padded, k, v)[:, :, :n].transpose(1, 2).reshape(1, n, -1)
        h = x[None] + attn.o_proj(out)
        state.carried_x = (h + layer_mod.mlp(layer_mod.post_attention_layernorm(h)))[0]
        state.carried_rows = rows
        state.rows_recomputed += int(rows.numel())
        return k, v


@dataclass(frozen=True)
class Polestar:
    """Fast-dLLM's dual cache with Polestar-Cache's drift-triggered per-layer recompute of cached rows."""

    clusters: int = 8
    top_clusters: int = 2
    update_threshold: int = 4
    drift_threshold: float = 0.0
    residual_format: str = "int8"
    refresh_steps: int | None = None
    name: str = "polestar"

    def __post_init__(self) -> None:
        # The settings schema says the same for users; this guards direct construction.
        if not 1 <= self.top_clusters <= self.clusters or self.update_threshold < 0:
            raise ValueError(f"need 1 <= top_clusters <= clusters and update_threshold >= 0, got {self}")
        if self.drift_threshold < 0 or self.residual_format not in ("int8", "fp8", "none"):
            raise ValueError(f"need drift_threshold >= 0 and residual_format int8|fp8|none, got {self}")

    def plan(self, ctx: StepContext) -> StepPlan:
        lo, hi = ctx.block_start - ctx.lead, ctx.block_end
        hook = PolestarStep(self, lo, hi, ctx.block_start, ctx.block_end, ctx.unmasked)
        if refresh_due(ctx, self.refresh_steps):
            return StepPlan(refresh=True, lo=0, hi=ctx.rows, rows_hook=hook)
        return StepPlan(refresh=False, lo=lo, hi=hi, rows_hook=hook)
