"""CUDA graphs around the attention of an eagerly run round: per layer and row bucket, the work before the
attention and the work after it replayed from captured graphs, the attention and a policy's per-layer
work eager between them (:class:`LayerGraphs`, which :class:`~.rounds.EagerRoundForward` runs its layers
through).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from pdllm.decode_service.graph_buckets import capture_graph, token_bucket
from pdllm.decode_service.round_attention import PagedBatchAttention
from pdllm.shared.model.transformer import DiffusionLM


class _LayerBucket:
    """One row bucket's buffers and, per layer, its captured segments (``rows`` rows, padding stale)."""

    def __init__(self, model: DiffusionLM, rows: int, like: torch.Tensor, rope_dim: int) -> None:
        c = model.config
        kw = {"dtype": like.dtype, "device": like.device}
        self.x = torch.zeros(1, rows, c.hidden_size, **kw)
        self.ffn = torch.zeros(1, rows, c.hidden_size, **kw)
        self.cos = torch.zeros(1, rows, rope_dim, **kw)
        self.sin = torch.zeros(1, rows, rope_dim, **kw)
        # [1, heads, rows, D] views of token-major memory, the layout the model's projections give
        self.q = torch.zeros(1, rows, c.num_heads, c.head_dim, **kw).transpose(1, 2)
        self.k = torch.zeros(1, rows, c.num_kv_heads, c.head_dim, **kw).transpose(1, 2)
        self.v = torch.zeros(1, rows, c.num_kv_heads, c.head_dim, **kw).transpose(1, 2)
        self.attn = torch.zeros(1, rows, c.num_heads, c.head_dim, **kw).transpose(1, 2)
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph | None] = {}
        self.uses = 0  # rounds that ran through this bucket


class LayerGraphs:
    """The layers of an eagerly run round (a policy decides inside its attention: Sparse-dLLM's stores,
    FOCUS's split, DyLLM's edits) with CUDA graphs around the attention: per layer and row bucket
    (:func:`token_bucket`), the work before attention (norm, QKV projection, RoPE) and after it (output
    projection, residual, norm, MLP; with an FFN edit, up to the FFN output) are one captured graph each,
    over a bucket's buffers; the attention, with the policy's per-layer work, runs eagerly between them on
    the real rows. Padded rows are stale and row-wise inert. A bucket is captured on its ``warm_uses``-th
    round (before that it runs the same work eagerly): row counts that come once (a policy's rows vary from
    round to round) never pay for captures. Rounds of more than ``max_rows`` rows (long vanilla prompts)
    keep every op eager: their kernels outlast the launches, and a bucket's buffers and graphs grow with its
    rows. ``capture`` False: the same buffers, eagerly."""

    def __init__(
        self,
        model: DiffusionLM,
        mempool: tuple | None,
        capture: bool,
        capacity: int = 16,
        warm_uses: int = 3,
        max_rows: int = 4096,
    ) -> None:
        self.model, self.mempool, self.capture, self.capacity = model, mempool, capture, capacity
        self.warm_uses, self.max_rows = warm_uses, max_rows
        self._buckets: OrderedDict[int, _LayerBucket] = OrderedDict()
        self.captures = 0

    def run(
        self,
        layers: Sequence[torch.nn.Module],
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: PagedBatchAttention,
        layer_inputs: Sequence[dict[int, torch.Tensor]] = (),
    ) -> torch.Tensor:
        """``layers`` over ``x`` ``[1, T, H]``; the output ``[1, T, H]`` (a view of the bucket's buffer).
        ``layer_inputs``: dicts that get a copy of each layer's input under its index."""
        t = x.shape[1]
        b = self._bucket(token_bucket(t), x, cos.shape[-1])
        b.uses += 1
        b.x[:, :t].copy_(x)
        b.cos[:, :t].copy_(cos)
        b.sin[:, :t].copy_(sin)
        edit = attention.edit_ffn
        for layer in layers:
            i = layer.self_attn.layer
            for inputs in layer_inputs:
                inputs[i] = b.x[:, :t].clone()  # the buffer changes in place layer after layer
            self._run(b, ("pre", i), lambda layer=layer: self._pre(layer, b))
            out = attention(i, b.q[:, :, :t], b.k[:, :, :t], b.v[:, :, :t])
            b.attn[:, :, :t].copy_(out)
            if edit is None:
                self._run(b, ("post", i), lambda layer=layer: b.x.copy_(layer.after_attention(b.x, b.attn)))
            else:
                self._run(b, ("ffn", i), lambda layer=layer: self._ffn(layer, b))
                b.x[:, :t] += edit(i, b.ffn[:, :t])
        return b.x[:, :t]

    @staticmethod
    def _pre(layer: torch.nn.Module, b: _LayerBucket) -> None:
        q, k, v = layer.attention_inputs(b.x, b.cos, b.sin)
        b.q.copy_(q)
        b.k.copy_(k)
        b.v.copy_(v)

    @staticmethod
    def _ffn(layer: torch.nn.Module, b: _LayerBucket) -> None:
        x, ffn = layer.ffn_of(b.x, b.attn)
        b.x.copy_(x)
        b.ffn.copy_(ffn)

    def _bucket(self, rows: int, like: torch.Tensor, rope_dim: int) -> _LayerBucket:
        b = self._buckets.get(rows)
        if b is None:
            b = self._buckets[rows] = _LayerBucket(self.model, rows, like, rope_dim)
            while len(self._buckets) > self.capacity:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(rows)
        return b

    def _run(self, b: _LayerBucket, key: tuple[str, int], fn: Callable[[], object]) -> None:
        graph = b.graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        if not self.capture or b.uses < self.warm_uses:
            fn()
            return
        # The warm-up computes this call's outputs (capturing runs nothing); later calls replay the graph.
        b.graphs[key], _ = capture_graph(fn, b.x.device, self.mempool)
        self.captures += 1
