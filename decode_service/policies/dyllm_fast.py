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

**CUDA graphs** (``cuda_graph``): a sparse step is ~60 small kernels per layer, so an eager step on a 7B
model is bound by kernel launches, not by the GPU (H100, 1K prompt: ~70 ms eager against ~17 ms of kernels).
So every buffer a step touches has a fixed address: the cache, a *stage* of the same shapes that the step
writes its new activations into (rows ``[first, N)``; the cache is only read), the local tokens and the
previous step's. One graph is captured per (first queried row, capacity) and replayed; after the host read
of the counts, the stage's rows are copied into the cache (the commit), and the logits of the masked rows
(whose count changes every step) are computed eagerly from the step's output residual. Capacities are
powers of two, so a session captures a handful of graphs. Off CUDA, or with ``cuda_graph`` off, the same
step runs eagerly, stage and commit included: the CPU tests exercise every line the graphs replay.
"""

from __future__ import annotations

import torch

from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.model.attention import AttentionBackend
from pdllm.shared.model.transformer import DiffusionLM

from .dyllm_base import DyLLMBase, DyLLMCache, DyLLMConfig, context_cosine, flat, project_kv, project_q


def _slots(mask: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The buffer of ``mask`` (``[M]`` bool): ``capacity`` row indices, the set rows first (both groups
    ascending), which of those slots hold a set row, and the number of set rows (device scalar)."""
    order = torch.argsort((~mask).to(torch.int8), stable=True)[:capacity]
    count = mask.sum()
    valid = torch.arange(capacity, device=mask.device) < count
    return order, valid, count


def _bucket(rows: int) -> int:
    """Buffer rows for a step whose largest layer had ``rows`` salient rows: a quarter more, rounded up to a
    power of two (>= 8), so that a session meets few distinct capacities (one captured graph each)."""
    need = max(8, rows + rows // 4)
    return 1 << (need - 1).bit_length()


StepOutput = tuple[torch.Tensor, torch.Tensor]  # the last layer's residual [1, M, H]; counts [2, layers]


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
        cuda_graph: bool = False,
    ) -> None:
        super().__init__(model, local, positions, response_start, gen, config, inner)
        if cuda_graph and local.device.type != "cuda":
            raise ValueError(f"DyLLM's cuda_graph needs a CUDA device, not {local.device}")
        self.cuda_graph = cuda_graph
        # Per first queried row (response-only and full-sequence steps differ): the buffers' rows.
        self.capacity: dict[int, int] = {}
        self.stage: DyLLMCache | None = None
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, StepOutput]] = {}
        self.pool: tuple[int, int] | None = None  # one memory pool for the session's graphs

    def _full(self, at: torch.Tensor) -> torch.Tensor:
        if self.stage is not None:  # step_kind puts every FullStep first; the graphs hold the cache's address
            raise RuntimeError("a DyLLM FullStep after a SparseStep")
        return super()._full(at)

    def _sparse(self, at: torch.Tensor, first: int) -> torch.Tensor:
        m = self.local.shape[0] - first
        capacity = min(self.capacity.get(first, m), m)
        x, counts = self._run(first, capacity)
        host = counts.tolist()  # the step's one host read: [kv rows, ffn rows] per layer
        if capacity < m and max(max(host[0]), max(host[1])) > capacity:
            self.stats.reruns += 1
            x, counts = self._run(first, m)
            host = counts.tolist()
        self._commit(first)
        self.stats.kv_rows += sum(host[0])
        self.stats.rows_forwarded += sum(host[1])
        self.capacity[first] = _bucket(max(max(host[0]), max(host[1])))
        return self._logits(x, at, first)

    def _run(self, first: int, capacity: int) -> StepOutput:
        """One attempt at the step, eager or by replaying its captured graph; it writes only the stage."""
        if self.stage is None:
            assert self.cache is not None, "a SparseStep follows at least one FullStep"
            self.stage = DyLLMCache(*([t.clone() for t in ts] for ts in _fields(self.cache)))
        if not self.cuda_graph:
            return self._attempt(first, capacity)
        key = (first, capacity)
        if key not in self.graphs:
            self.graphs[key] = self._capture(first, capacity)
        graph, output = self.graphs[key]
        graph.replay()
        return output

    def _capture(self, first: int, capacity: int) -> tuple[torch.cuda.CUDAGraph, StepOutput]:
        if self.pool is None:  # the session's first capture: warm up outside it (library handles, workspaces)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._attempt(first, capacity)
            torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = self._attempt(first, capacity)
        self.pool = graph.pool()
        return graph, output

    def _commit(self, first: int) -> None:
        """The stage's rows ``[first, N)`` become the cache's (rows before ``first`` were not queried)."""
        assert self.cache is not None and self.stage is not None
        for cached, staged in zip(_fields(self.cache), _fields(self.stage), strict=True):
            for c, s in zip(cached, staged, strict=True):
                rows = c.narrow(c.dim() - 2, first, c.shape[-2] - first)  # K/V [1, H, N, D]; others [N, .]
                rows.copy_(s.narrow(s.dim() - 2, first, s.shape[-2] - first))

    def _attempt(self, first: int, capacity: int) -> StepOutput:
        """One SparseStep over queried rows ``[first, N)`` with ``capacity``-row buffers, writing the
        activations it would leave into the stage's rows ``[first, N)``: the last layer's residual and the
        salient counts ``[2, layers]`` (K/V rows, FFN rows) on the device. No host read, fixed shapes."""
        old, stage, model = self.cache, self.stage, self.model
        assert old is not None and stage is not None
        x = model.model.embed_tokens(self.local[None, first:])
        cos, sin = self.cos[:, first:], self.sin[:, first:]
        salient = self.first_salient(first)
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
            keys, values = stage.keys[li], stage.values[li]
            keys.copy_(old_k).index_copy_(2, rows, torch.where(slot, k, old_k.index_select(2, rows)))
            values.copy_(old_v).index_copy_(2, rows, torch.where(slot, v, old_v.index_select(2, rows)))
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
            old_f, ffn = old.ffn[li], stage.ffn[li]
            ffn[first:].copy_(old_f[first:])
            ffn.index_copy_(0, rows, torch.where(valid[:, None], out, old_f.index_select(0, rows)))
            x = x + ffn[first:][None]
            stage.contexts[li][first:].copy_(context)
            counts.append(torch.stack([n_kv, n_ffn]))
            salient = chosen
        return x, torch.stack(counts, dim=1)


def _fields(cache: DyLLMCache) -> tuple[list[torch.Tensor], ...]:
    return cache.keys, cache.values, cache.contexts, cache.ffn
