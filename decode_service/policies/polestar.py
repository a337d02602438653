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
   update signals to subsequent layers") ``D_l = D_{l-1} ∪ members`` (``recompute="propagated"``, the
   default), or ``D_l = members`` (``"per-layer"``: a row recomputed at l - 1 keeps its cached K/V at l
   unless its own cluster drifts there; its new input still updates the kept hidden states). Each row of
   ``D_l`` runs layer l in full: its input (exact where it was recomputed at l - 1, dequantized from the
   CPU otherwise),
   RMSNorm, q/k/v, RoPE, attention over every local row (its own new K/V included) through the method's
   backend, o_proj, residual, MLP. Its new K/V replace the cache's (this and later steps read them) and
   its output becomes its input at layer l + 1, where the kept hidden states and the touched clusters'
   centroids (and their residuals, re-encoded) are updated ("we update the corresponding cluster
   centroids"). Cluster membership stays until the next refresh.
5. **When to update** (§4.3): an update runs when more than T tokens of the block were unmasked since the
   last one (the refresh counts as one). "More than T in one step" is contained in "more than T
   cumulatively", so one rule covers both; T = 0 updates at every step.

**Replayed work** (benchmarks only; :class:`Polestar`'s ``replay_*`` fields, None by default): an update
recomputes ``ceil(r)`` cached rows per layer, the rows carried from the layer before first (``propagated``),
then the members of the clusters in descending drift (ties: the lower cluster), each cluster's rows
ascending (:func:`forced_rows`); the drift threshold and M no longer count. Updates run at a rate u
instead of step 5's rule: the i-th forward (refreshes counted) updates, if it is a cached step, while fewer
than ``floor(u i)`` updates ran (:func:`replay_due`); a refresh cannot update, so its share carries over.

**Exact identities** (tested): with ``none`` residuals, T = 0 and M = C, every cached row is recomputed from
layer 0 at every step: plain decoding (the same rows through the same layers; row order in the GEMMs aside).
With a drift threshold no KL reaches (or T beyond the block), no row is ever recomputed: the dual cache.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, get_args

import torch
import torch.nn.functional as F

from pdllm.decode_service.local_cache import LocalKVCache
from pdllm.shared.decode_policy import check_replay_knob, replay_ceil
from pdllm.shared.decode_policy_settings import PolestarRecompute, ResidualFormat, paper_default
from pdllm.shared.model.attention import AttentionBackend
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
    values = kl.tolist()  # one read of the device, not one per cluster
    return [c for c in order if values[c] >= threshold][:top]


def replay_due(rate: float, forwards: int, updates: int) -> bool:
    """Whether a cached step that is the ``forwards``-th forward (refreshes counted) updates at a replayed
    rate of updates per forward, ``updates`` having run: while fewer than ``floor(rate x forwards)``."""
    return updates < math.floor(rate * forwards + 1e-9)


def forced_rows(
    store: ClusteredHidden, kl: torch.Tensor | None, carried: torch.Tensor | None, count: int
) -> torch.Tensor:
    """The ``count`` cached rows (ascending) an update recomputes at a layer under a replayed count: the
    ``carried`` rows first, then the members of ``store``'s clusters by descending drift ``kl`` (ties: the
    lower cluster), each cluster's rows ascending."""
    ranked = [] if carried is None else carried.tolist()
    if kl is not None:
        values, taken = kl.tolist(), set(ranked)  # one read of the device
        for c in sorted(range(len(values)), key=lambda c: (-values[c], c)):
            ranked += [r for r in store.members([c]).tolist() if r not in taken]
    return torch.tensor(sorted(ranked[:count]), dtype=torch.long, device=store.assign.device)


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


def layer_proxy(model: Any, layer: int, store: ClusteredHidden, k: torch.Tensor) -> torch.Tensor:
    """Layer ``layer``'s drift proxy ``[Hq, C, N]`` of ``store``'s centroids against the keys ``k``
    ``[1, Hkv, N, D]`` of every local row, in row order (the KL compares proxies key by key)."""
    pos = store.centroid_positions[None]
    cos, sin = model.model.rotary_emb(pos, store.centroids.dtype)
    q, _, _ = _project(model.model.layers[layer], store.centroids[None], cos, sin)
    return proxy_log_attention(q, k)


@dataclass
class PolestarState:
    """One session's Polestar state: per layer the clustered hidden states and the last proxy; the block's
    unmasked count at the last update; counters. Its methods are the per-layer work of a step in the
    reference hook (:class:`PolestarStep`); the batched rounds (``decode_service/polestar_rounds``) run
    ``polestar_device.DevicePolestarState``, the same values chosen and kept on the device."""

    stores: list[ClusteredHidden] = field(default_factory=list)
    log_prev: list[torch.Tensor] = field(default_factory=list)
    unmasked_at_update: int = 0
    updates: int = 0
    rows_recomputed: int = 0
    forwards: int = 0  # refreshes and cached steps (a replayed update rate counts them)
    # Set per update step: rows recomputed at the previous layer and their inputs to this layer.
    carried_rows: torch.Tensor | None = None
    carried_x: torch.Tensor | None = None

    def num_bytes(self) -> int:
        return sum(s.num_bytes() for s in self.stores)

    def update_due(self, policy: Polestar, unmasked: int) -> bool:
        """§4.3's trigger at a cached step (``unmasked``: the block's unmasked tokens), or a replayed rate's
        (:func:`replay_due`); starts the update."""
        self.forwards += 1
        rate = policy.replay_updates_per_forward
        if rate is not None and not replay_due(rate, self.forwards, self.updates):
            return False
        if rate is None and unmasked - self.unmasked_at_update <= policy.update_threshold:
            return False
        self.unmasked_at_update, self.updates = unmasked, self.updates + 1
        self.carried_rows, self.carried_x = None, None
        return True

    def record(
        self,
        policy: Polestar,
        model: Any,
        layer: int,
        x: torch.Tensor,
        k: torch.Tensor,
        span: tuple[int, int],
        positions: torch.Tensor,
    ) -> None:
        """A refresh at ``layer``: cluster and offload the inputs ``x`` ``[N, hidden]`` of the rows outside
        the forwarded ``span`` ``[lo, hi)``, keep their proxy against ``k`` ``[1, Hkv, N, D]`` (every row,
        in row order; ``positions`` ``[N]``)."""
        if layer == 0:
            self.stores.clear()
            self.log_prev.clear()
        lo, hi = span
        n = x.shape[0]
        rows = torch.cat([torch.arange(0, lo), torch.arange(hi, n)]).to(x.device)
        spans = split_clusters(policy.clusters, lo, n - hi)
        store = ClusteredHidden.build(x, rows, positions, lo, spans, policy.residual_format, KMEANS_ROUNDS)
        self.stores.append(store)
        self.log_prev.append(layer_proxy(model, layer, store, k) if store.clusters else torch.empty(0))

    def drifting(
        self, policy: Polestar, model: Any, layer: int, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An update at ``layer``, before its attention: the rows to recompute there (ascending) and their
        inputs ``[n, hidden]``, or None; ``k`` ``[1, Hkv, N, D]``: every local row's keys as the step sees
        them, in row order."""
        store = self.stores[layer]
        if self.carried_rows is not None:  # the previous layer's recomputed rows: their new inputs here
            store.update(self.carried_rows, self.carried_x)
        chosen: list[int] = []
        kl: torch.Tensor | None = None
        forced = policy.replay_rows_per_update_layer
        if store.clusters:
            log_p = layer_proxy(model, layer, store, k)
            kl = kl_drift(log_p, self.log_prev[layer])
            if forced is None:
                chosen = select_clusters(kl, policy.top_clusters, policy.drift_threshold)
            self.log_prev[layer] = log_p
        carried = self.carried_rows
        if forced is not None:
            keep = carried if policy.recompute == "propagated" else None
            rows = forced_rows(store, kl, keep, replay_ceil(forced))
        elif carried is None or policy.recompute == "per-layer":
            rows = store.members(chosen)
        else:
            rows = torch.unique(torch.cat([carried, store.members(chosen)]))  # ascending
        if rows.numel() == 0:
            self.carried_rows, self.carried_x = None, None
            return None
        x = store.hidden(rows)  # fetched and dequantized; the carried rows' exact inputs replace theirs
        if carried is not None and self.carried_x is not None:
            at = torch.searchsorted(rows, carried).clamp(max=rows.numel() - 1)
            among = rows[at] == carried
            x = x.index_copy(0, at[among], self.carried_x[among])
        return rows, x

    @staticmethod
    def project(model: Any, layer: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v ``[1, H, n, D]`` of the recomputed rows (inputs ``x`` ``[n, hidden]`` at ``positions``
        ``[1, n]``): the caller stores k/v where this and later steps read them, and attends with q."""
        cos, sin = model.model.rotary_emb(positions, x.dtype)
        return _project(model.model.layers[layer], x[None], cos, sin)

    def finish(self, model: Any, layer: int, rows: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> None:
        """The rest of layer ``layer`` for the recomputed ``rows`` from their attention output ``out``
        ``[1, Hq, n, D]``: o_proj, residual, MLP; the outputs are their inputs at the next layer."""
        layer_mod = model.model.layers[layer]
        n = rows.numel()
        h = x[None] + layer_mod.self_attn.o_proj(out.transpose(1, 2).reshape(1, n, -1))
        self.carried_x = (h + layer_mod.mlp(layer_mod.post_attention_layernorm(h)))[0]
        self.carried_rows = rows
        self.rows_recomputed += n


@dataclass
class PolestarStep:
    """One step's per-layer hook (a ``local_cache.RowsHook``) of the reference loop: at a refresh, cluster
    and offload each layer's cached hidden states; at a partial step, detect drift and recompute the
    drifting rows over the :class:`~pdllm.decode_service.local_cache.LocalKVCache`."""

    policy: Polestar
    lo: int  # forwarded rows [lo, hi): the block (and the lead row)
    hi: int
    block_start: int
    block_end: int
    unmasked: int
    model: Any = None
    positions: torch.Tensor | None = None
    update: bool = False
    _inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # layer inputs (refresh)

    @contextmanager
    def attach(self, model: Any, positions: torch.Tensor) -> Iterator[None]:
        """Around the forward: keep the model (layer weights, RoPE) and, at a refresh, each layer's input."""
        self.model, self.positions = model, positions
        self._inputs = {}
        with layer_inputs(model, self._inputs):
            yield

    def _state(self, cache: LocalKVCache) -> PolestarState:
        state = cache.aux.get("polestar")
        if not isinstance(state, PolestarState):
            state = cache.aux["polestar"] = PolestarState()
        return state

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
            raise RuntimeError("polestar's rows hook runs attached to the model (call attach() first)")
        state = self._state(cache)
        if record:
            if layer == 0:
                state.unmasked_at_update = self.unmasked
                state.forwards += 1
            x = self._inputs[layer][0]  # [N, hidden]: this layer's input, every local row
            state.record(self.policy, self.model, layer, x, k, (self.lo, self.hi), self.positions[0])
            return k, v
        if layer == 0:
            self.update = state.update_due(self.policy, self.unmasked)
        if not self.update:
            return k, v
        picked = state.drifting(self.policy, self.model, layer, k)
        if picked is None:
            return k, v
        rows, x = picked
        qd, kd, vd = state.project(self.model, layer, x, self.positions[:, rows])
        cache.replace(layer, rows, kd, vd)
        k, v = k.index_copy(2, rows, kd), v.index_copy(2, rows, vd)
        n = rows.numel()
        # Queries padded to a power of two: the recomputed row count changes at every layer and update, and
        # on CUDA SDPA's cuDNN backend builds a plan per new shape (~37 ms each). Rows attend independently.
        padded = F.pad(qd, (0, 0, 0, (1 << max(n - 1, 15).bit_length()) - n))
        state.finish(self.model, layer, rows, x, inner(layer, padded, k, v)[:, :, :n])
        return k, v


@contextmanager
def layer_inputs(model: Any, into: dict[int, torch.Tensor]) -> Iterator[None]:
    """While open, each decoder layer's input ``[B, T, hidden]`` of a forward lands in ``into[layer]``."""
    handles = []
    for i, layer in enumerate(model.model.layers):

        def grab(_module: Any, args: tuple[Any, ...], i: int = i) -> None:
            into[i] = args[0]

        handles.append(layer.register_forward_pre_hook(grab))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@dataclass(frozen=True)
class Polestar:
    """Fast-dLLM's dual cache with Polestar-Cache's drift-triggered per-layer recompute of cached rows."""

    clusters: int = paper_default("polestar_clusters")
    top_clusters: int = paper_default("polestar_top_clusters")
    update_threshold: int = paper_default("polestar_update_threshold")
    drift_threshold: float = paper_default("polestar_drift_threshold")
    residual_format: str = paper_default("polestar_residual_format")
    recompute: str = paper_default("polestar_recompute")
    refresh_steps: int | None = None
    name: str = "polestar"
    # benchmarks only, not settings (module docstring's "Replayed work"): rows per update and layer, and
    # updates per forward, as ``schedule.policy_fractions`` records them
    replay_rows_per_update_layer: float | None = None
    replay_updates_per_forward: float | None = None

    def __post_init__(self) -> None:
        # The settings schema says the same for users; this guards direct construction.
        if not 1 <= self.top_clusters <= self.clusters or self.update_threshold < 0:
            raise ValueError(f"need 1 <= top_clusters <= clusters and update_threshold >= 0, got {self}")
        if self.drift_threshold < 0 or self.residual_format not in get_args(ResidualFormat):
            raise ValueError(f"need drift_threshold >= 0 and residual_format int8|fp8|none, got {self}")
        if self.recompute not in get_args(PolestarRecompute):
            raise ValueError(f"need recompute propagated|per-layer, got {self}")
        check_replay_knob("polestar replay_rows_per_update_layer", self.replay_rows_per_update_layer, None)
        check_replay_knob("polestar replay_updates_per_forward", self.replay_updates_per_forward)

    def plan(self, ctx: StepContext) -> StepPlan:
        lo, hi = ctx.block_start - ctx.lead, ctx.block_end
        hook = PolestarStep(self, lo, hi, ctx.block_start, ctx.block_end, ctx.unmasked)
        if refresh_due(ctx, self.refresh_steps):
            return StepPlan(refresh=True, lo=0, hi=ctx.rows, rows_hook=hook)
        return StepPlan(refresh=False, lo=lo, hi=hi, rows_hook=hook)
