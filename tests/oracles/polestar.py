"""Oracle of Polestar-Cache (``/work/shared/papers/polestar-cache.txt`` §4) on top of Fast-dLLM's dual cache,
with the choices the paper leaves open taken as the runtime documents them.

Per block (block rows ``[o, e)``, forwarded rows ``F = [o - lead, e)``, cached rows ``I`` = the others):

1. **Refresh** (a block's first step; also once ``refresh_every`` steps ran since the last refresh): a full
   forward keeping every row's K/V. Per layer the *input* hidden states of the rows of I are clustered by
   spherical k-means, the rows before F and the rows after F apart, C clusters split between the two by
   length (``round(C n_pre / n)`` clamped so that each non-empty side gets at least one and at most one per
   row). K-means: unit rows, initial directions the rows ``floor(j n / k)``, assignment to the most similar
   direction (ties: the lower cluster), directions the normalized sums, until stable or 20 rounds.
2. Per cluster the centroid is the members' mean hidden state, its position their mean position rounded;
   each member keeps its residual to the centroid as int8 codes with a per-row scale ``absmax / 127``, or
   as float8 (e4m3) codes with a per-row scale ``absmax / 448`` (format ``none``: the exact hidden state).
3. **Drift proxy**: per layer and cluster, the query of the centroid (the layer's input norm, q
   projection, RoPE at the centroid's position) against the keys of every local row as the step sees them,
   ``P = softmax(q k / sqrt(d))`` per query head; the drift is ``mean_heads KL(P_now || P_prev)``, P_prev
   the proxy of the previous update (or of the refresh).
4. **Update**: at a cached step where more than T tokens of the block were unmasked since the last update
   (or the refresh), per layer: the M clusters of largest drift among those with drift >= the drift
   threshold (ties: the lower cluster) give rows to recompute, joined with the rows recomputed at the layer
   before ("propagated"; "per-layer": not joined). Each such row runs the layer from its hidden state (dequantized; the exact output of the layer
   before for the carried rows): new K/V (replacing the cache's for this and later steps), attention over
   every local row, o_proj, MLP; its output is its input at the next layer, where its cluster's centroid
   moves to the members' new mean and that cluster's residuals are re-encoded. The block then attends to
   the K/V with those rows replaced.

Counters: forwards, refreshes, local rows forwarded, updates, rows recomputed (summed over layers), and the
largest cache held (K/V of every row plus, per layer, centroids, codes and scales).
"""

from __future__ import annotations

import math

import torch

from .plain import Static, Step, attend, finish, head, project, rope, source_rows, unmask

ROUNDS = 20


def split(clusters: int, prefix: int, suffix: int) -> tuple[int, int]:
    if prefix and suffix:
        c_pre = min(max(round(clusters * prefix / (prefix + suffix)), 1), max(clusters - 1, 1))
        c_suf = max(clusters - c_pre, 1)
    else:
        c_pre, c_suf = (clusters if prefix else 0), (clusters if suffix else 0)
    return min(c_pre, prefix), min(c_suf, suffix)


def unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def kmeans(x: torch.Tensor, k: int) -> list[int]:
    """Cluster of every row of ``x`` ``[n, H]`` by cosine similarity."""
    n = x.shape[0]
    u = unit(x.float())
    directions = u[[j * n // k for j in range(k)]]
    assign: torch.Tensor | None = None
    for _ in range(ROUNDS):
        new = (u @ directions.T).argmax(dim=1)
        if assign is not None and torch.equal(new, assign):
            break
        assign = new
        sums = torch.zeros_like(directions).index_add_(0, assign, u)
        filled = torch.bincount(assign, minlength=k) > 0
        directions = torch.where(filled[:, None], unit(sums), directions)
    assert assign is not None
    return assign.tolist()


class LayerStore:
    """One layer's clustered hidden states of the cached ``rows`` (ascending local rows)."""

    def __init__(
        self,
        x: torch.Tensor,
        prefix: list[int],
        suffix: list[int],
        spans: tuple[int, int],
        positions,
        fmt: str,
    ) -> None:
        c_pre, c_suf = spans
        self.rows, self.fmt, self.dtype = prefix + suffix, fmt, x.dtype
        self.entry = {r: i for i, r in enumerate(self.rows)}
        assign = kmeans(x[prefix], c_pre) if c_pre else []
        assign += [c + c_pre for c in kmeans(x[suffix], c_suf)] if c_suf else []
        self.assign = torch.tensor(assign, dtype=torch.long)
        self.clusters = c_pre + c_suf
        self.centroids = torch.zeros(self.clusters, x.shape[1], dtype=x.dtype)
        self.positions = []
        for c in range(self.clusters):
            members = [int(positions[r]) for r, a in zip(self.rows, assign) if a == c]
            self.positions.append(round(sum(members) / len(members)) if members else 0)
        code_type = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}.get(fmt, x.dtype)
        self.codes = torch.zeros(len(self.rows), x.shape[1], dtype=code_type)
        self.scales = torch.zeros(len(self.rows)) if fmt != "none" else torch.zeros(0)
        self._encode(list(range(self.clusters)), list(range(len(self.rows))), x[self.rows])

    def _encode(self, touched: list[int], entries: list[int], h: torch.Tensor) -> None:
        """Centroids of the ``touched`` clusters from the hidden states ``h`` of all their member
        ``entries``, and those members' residual codes."""
        ids = self.assign[entries]
        sums = torch.zeros(self.clusters, h.shape[1]).index_add_(0, ids, h.float())
        counts = torch.bincount(ids, minlength=self.clusters).clamp_min(1)
        mean = (sums / counts[:, None]).to(self.dtype)
        self.centroids[touched] = mean[touched]
        if self.fmt == "none":
            self.codes[entries] = h
            return
        r = (h - self.centroids[ids]).float()
        scale = r.abs().amax(dim=-1) / (127.0 if self.fmt == "int8" else 448.0)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        y = r / scale[:, None]
        self.codes[entries] = (
            y.round().clamp(-127, 127).to(torch.int8) if self.fmt == "int8" else y.to(self.codes.dtype)
        )
        self.scales[entries] = scale

    def hidden(self, rows: list[int]) -> torch.Tensor:
        entries = [self.entry[r] for r in rows]
        if self.fmt == "none":
            return self.codes[entries].clone()
        r = self.codes[entries].float() * self.scales[entries][:, None]
        return (self.centroids[self.assign[entries]].float() + r).to(self.dtype)

    def members(self, clusters: list[int]) -> list[int]:
        return [r for r, a in zip(self.rows, self.assign.tolist()) if a in clusters]

    def update(self, rows: list[int], x: torch.Tensor) -> None:
        """New hidden states ``x`` of ``rows``: their clusters' centroids and residuals follow."""
        touched = sorted({int(self.assign[self.entry[r]]) for r in rows})
        entries = [i for i, a in enumerate(self.assign.tolist()) if a in touched]
        h = self.hidden([self.rows[i] for i in entries])
        where = {e: j for j, e in enumerate(entries)}
        for r, row in zip(rows, x):
            h[where[self.entry[r]]] = row
        self._encode(touched, entries, h)

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.centroids, self.codes, self.scales))


class PolestarOracle:
    def __init__(
        self,
        model,
        head_tokens: list[int],
        gen_length: int,
        clusters: int,
        top_clusters: int,
        update_threshold: int,
        drift_threshold: float,
        fmt: str,
        refresh_every: int | None = None,
        static: Static = None,
        first_position: int = 0,
        recompute: str = "propagated",
    ) -> None:
        self.model, self.static = model, static
        self.clusters, self.top, self.update_threshold = clusters, top_clusters, update_threshold
        self.drift_threshold, self.fmt, self.every = drift_threshold, fmt, refresh_every
        self.recompute = recompute
        self.local = torch.tensor(head_tokens + [model.config.mask_token_id] * gen_length)
        self.rows = self.local.numel()
        self.positions = list(range(first_position, first_position + self.rows))
        self.cos, self.sin = rope(model, torch.tensor(self.positions))
        self.response_start = len(head_tokens)
        self.lead = 1 if model.config.shift_logits else 0
        self.layers = list(model.model.layers)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.stores: list[LayerStore] = []
        self.previous: list[torch.Tensor] = []  # per layer: the last proxy (log-probabilities)
        self.since_refresh = 0
        self.unmasked_at_update = 0
        self.recomputed: list[list[list[int]]] = []  # per update step, per layer: the rows recomputed
        self.counters = dict.fromkeys(
            ("forwards", "refreshes", "rows_forwarded", "cache_bytes", "updates", "rows_recomputed"), 0
        )

    def proxy(self, li: int, keys: torch.Tensor) -> torch.Tensor:
        """Log attention ``[Hq, C, N]`` of layer ``li``'s centroid queries against ``keys``
        ``[1, Hkv, N, D]``."""
        store = self.stores[li]
        at = torch.tensor(store.positions)
        cos, sin = rope(self.model, at)
        q, _, _ = project(self.layers[li], store.centroids, cos, sin)
        k = keys[0].float().repeat_interleave(q.shape[1] // keys.shape[1], dim=0)
        logits = torch.einsum("hcd,hnd->hcn", q[0].float(), k) / math.sqrt(q.shape[-1])
        return torch.log_softmax(logits, dim=-1)

    def logits(self, response: torch.Tensor, step: Step) -> tuple[torch.Tensor, None]:
        self.local[self.response_start :] = response
        lo = self.response_start + step.lo - self.lead
        hi = self.response_start + step.hi
        unmasked = (step.hi - step.lo) - len(step.masked)
        refresh = step.step_in_block == 0 or (self.every is not None and self.since_refresh == self.every)
        if refresh:
            self.since_refresh = 0
            x = self._refresh(lo, hi, unmasked)
            a = 0
        else:
            x = self._cached(lo, hi, unmasked)
            a = lo
        self.since_refresh += 1
        c = self.counters
        c["forwards"] += 1
        c["refreshes"] += int(refresh)
        c["rows_forwarded"] += self.rows if refresh else hi - lo
        held = sum(k.numel() * k.element_size() * 2 for k in self.keys)
        c["cache_bytes"] = max(c["cache_bytes"], held + sum(s.num_bytes() for s in self.stores))
        rows = [r - a for r in source_rows(self.model, self.response_start, step.masked)]
        return head(self.model, x[rows]), None

    def observe(self, step: Step, picked: list[int]) -> None:
        pass

    def _refresh(self, lo: int, hi: int, unmasked: int) -> torch.Tensor:
        self.unmasked_at_update = unmasked
        x = self.model.model.embed_tokens(self.local[None])[0]
        prefix, suffix = list(range(lo)), list(range(hi, self.rows))
        spans = split(self.clusters, len(prefix), len(suffix))
        self.keys, self.values, self.stores, self.previous = [], [], [], []
        for li, layer in enumerate(self.layers):
            q, k, v = project(layer, x, self.cos, self.sin)
            self.keys.append(k)
            self.values.append(v)
            self.stores.append(LayerStore(x, prefix, suffix, spans, self.positions, self.fmt))
            self.previous.append(self.proxy(li, k) if self.stores[li].clusters else torch.empty(0))
            x = finish(layer, x, attend(q, k, v, self.static, li))
        return x

    def _cached(self, lo: int, hi: int, unmasked: int) -> torch.Tensor:
        update = unmasked - self.unmasked_at_update > self.update_threshold
        if update:
            self.unmasked_at_update = unmasked
            self.counters["updates"] += 1
            self.recomputed.append([])
        forwarded = list(range(lo, hi))
        x = self.model.model.embed_tokens(self.local[None, lo:hi])[0]
        carried: list[int] = []
        carried_x: torch.Tensor | None = None
        for li, layer in enumerate(self.layers):
            q, k, v = project(layer, x, self.cos[lo:hi], self.sin[lo:hi])
            keys, values = self.keys[li].clone(), self.values[li].clone()
            keys[:, :, forwarded], values[:, :, forwarded] = k, v
            if update:
                store = self.stores[li]
                if carried:
                    store.update(carried, carried_x)
                chosen: list[int] = []
                if store.clusters:
                    now = self.proxy(li, keys)
                    drift = (now.exp() * (now - self.previous[li])).sum(-1).mean(0).tolist()
                    order = sorted(range(store.clusters), key=lambda c: (-drift[c], c))
                    chosen = [c for c in order if drift[c] >= self.drift_threshold][: self.top]
                    self.previous[li] = now
                joined = set(carried) if self.recompute == "propagated" else set()
                rows = sorted(joined | set(store.members(chosen)))
                self.recomputed[-1].append(rows)
                if rows:
                    h = store.hidden(rows)
                    if carried_x is not None:  # the exact inputs of the rows recomputed at the layer before
                        for r, row in zip(carried, carried_x):
                            if r in rows:
                                h[rows.index(r)] = row
                    qr, kr, vr = project(layer, h, self.cos[rows], self.sin[rows])
                    self.keys[li] = self.keys[li].clone()
                    self.values[li] = self.values[li].clone()
                    self.keys[li][:, :, rows], self.values[li][:, :, rows] = kr, vr
                    keys[:, :, rows], values[:, :, rows] = kr, vr
                    carried_x = finish(layer, h, attend(qr, keys, values, self.static, li))
                    self.counters["rows_recomputed"] += len(rows)
                carried = rows
                if not rows:
                    carried_x = None
            x = finish(layer, x, attend(q, keys, values, self.static, li))
        return x


@torch.inference_mode()
def polestar_decode(
    model,
    head_tokens: list[int],
    gen_length: int,
    block: int,
    steps: int,
    threshold: float | None,
    clusters: int = 8,
    top_clusters: int = 2,
    update_threshold: int = 4,
    drift_threshold: float = 0.0,
    fmt: str = "int8",
    refresh_every: int | None = None,
    static: Static = None,
    first_position: int = 0,
    recompute: str = "propagated",
) -> tuple[list[int], dict[str, int], PolestarOracle]:
    oracle = PolestarOracle(
        model, head_tokens, gen_length, clusters, top_clusters, update_threshold, drift_threshold, fmt,
        refresh_every, static, first_position, recompute,
    )  # fmt: skip
    tokens, _ = unmask(model.config.mask_token_id, gen_length, block, steps, threshold, oracle)
    return tokens, oracle.counters, oracle
