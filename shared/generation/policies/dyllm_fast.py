"""DyLLM's fast path: the reference SparseStep (``dyllm.py``) with fixed-capacity row buffers and no host
read inside the step.

Per layer the salient rows are a device mask. A stable sort puts them first (ascending), and the first
``capacity`` rows of that order form the layer's buffer: K/V projections and the FFN run on the buffer, its
rows past the salient count are padding whose results are discarded (the cached values are written back in
their place), and every cache update is one ``index_copy`` out of place, committed once the step is done.
So a step's shapes depend only on the capacity (graph-friendly), and its only host read is the per-layer
salient counts at its end, which also feed the counters. If a layer had more salient rows than the
capacity, the step runs again with room for every queried row (the cache was not touched yet). The next
capacity of the same kind of step (response-only or full-sequence) is this step's largest count plus a
quarter, in multiples of 8.

The arithmetic is the reference's, on differently shaped GEMMs (buffer rows instead of the salient rows
alone), so activations can differ in the last bits; the tests hold it to the reference token for token.
"""

from __future__ import annotations

import torch

from pdllm.shared.model.attention import AttentionBackend
from pdllm.shared.model.transformer import DiffusionLM

from ..sampler import GenerationConfig
from .dyllm_base import DyLLMBase, DyLLMCache, DyLLMConfig, context_cosine, flat, project_kv, project_q


def _slots(mask: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The buffer of ``mask`` (``[M]`` bool): ``capacity`` row indices, the set rows first (both groups
    ascending), which of those slots hold a set row, and the number of set rows (device scalar)."""
    order = torch.argsort((~mask).to(torch.int8), stable=True)[:capacity]
    count = mask.sum()
    valid = torch.arange(capacity, device=mask.device) < count
    return order, valid, count


def _bucket(rows: int) -> int:
    """Buffer rows for a step whose largest layer had ``rows`` salient rows: a quarter more, in 8s."""
    return max(8, -(-(rows + rows // 4) // 8) * 8)


class DyLLMFastLogits(DyLLMBase):
    """DyLLM's fast path (see the module docstring); same contract, counters and tokens as the reference."""

    def __init__(
        self,
        model: DiffusionLM,
        local: torch.Tensor,
        positions: torch.Tensor,
        response_start: int,
        gen: GenerationConfig,
        config: DyLLMConfig,
        inner: AttentionBackend,
    ) -> None:
        super().__init__(model, local, positions, response_start, gen, config, inner)
        # Per first queried row (response-only and full-sequence steps differ): the buffers' rows.
        self.capacity: dict[int, int] = {}

    def _sparse(self, at: torch.Tensor, first: int) -> torch.Tensor:
        m = self.local.shape[0] - first
        capacity = min(self.capacity.get(first, m), m)
        logits, cache, counts = self._attempt(at, first, capacity)
        host = counts.tolist()  # the step's one host read: [kv rows, ffn rows] per layer
        if capacity < m and max(max(host[0]), max(host[1])) > capacity:
            self.stats.reruns += 1
            logits, cache, counts = self._attempt(at, first, m)
            host = counts.tolist()
        self.cache = cache
        self.stats.kv_rows += sum(host[0])
        self.stats.rows_forwarded += sum(host[1])
        self.capacity[first] = _bucket(max(max(host[0]), max(host[1])))
        return logits

    def _attempt(
        self, at: torch.Tensor, first: int, capacity: int
    ) -> tuple[torch.Tensor, DyLLMCache, torch.Tensor]:
        """One SparseStep over queried rows ``[first, N)`` with ``capacity``-row buffers: the logits, the
        caches it would leave, and its salient counts ``[2, layers]`` (K/V rows, FFN rows) on the device."""
        old, model = self.cache, self.model
        assert old is not None, "a SparseStep follows at least one FullStep"
        x = model.model.embed_tokens(self.local[None, first:])
        cos, sin = self.cos[:, first:], self.sin[:, first:]
        salient = self.first_salient(first)
        new = DyLLMCache([], [], [], [])
        counts: list[torch.Tensor] = []
        for layer in model.model.layers:
            attn = layer.self_attn
            li = attn.layer
            h = layer.input_layernorm(x)
            q = project_q(attn, h, cos, sin)
            order, valid, n_kv = _slots(salient, capacity)
            rows = order + first
            k, v = project_kv(attn, h[:, order], cos[:, order], sin[:, order])
            old_k, old_v = old.keys[li], old.values[li]
            slot = valid.view(1, 1, -1, 1)
            keys = old_k.index_copy(2, rows, torch.where(slot, k, old_k.index_select(2, rows)))
            values = old_v.index_copy(2, rows, torch.where(slot, v, old_v.index_select(2, rows)))
            exact = flat(self.inner(li, q, keys, values))
            before = old.contexts[li][first:]
            context = exact
            if self.config.approximate_attention:
                approx = before + (exact - flat(self.inner(li, q, keys, old_v)))
                context = torch.where(salient[:, None], exact, approx)
            chosen = context_cosine(context, before) < self.threshold
            if self.all_salient:
                chosen = torch.ones_like(chosen)
            x = x + attn.o_proj(context[None])
            order, valid, n_ffn = _slots(chosen, capacity)
            rows = order + first
            out = layer.mlp(layer.post_attention_layernorm(x[:, order]))[0]
            old_f = old.ffn[li]
            ffn = old_f.index_copy(0, rows, torch.where(valid[:, None], out, old_f.index_select(0, rows)))
            x = x + ffn[first:][None]
            new.keys.append(keys)
            new.values.append(values)
            new.contexts.append(torch.cat([old.contexts[li][:first], context]))
            new.ffn.append(ffn)
            counts.append(torch.stack([n_kv, n_ffn]))
            salient = chosen
        return self._logits(x, at, first), new, torch.stack(counts, dim=1)
