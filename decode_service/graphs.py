"""CUDA-graph replay of the single-request decode step (``decode.py``), and a cache of captured steps
across requests (GPU). The decode server's batched rounds have their own graphs (``round_graphs.py``).

A decode step forwards the same number of tokens at the same positions over the same static KV every
step; only the response token ids change. With a step-invariant attention backend the whole forward
(embedding, all layers, LM head over every response row) is captured once and replayed, which removes the
per-kernel launch cost that otherwise dominates a ~5 ms memory-bound step. Logits are computed for all
response rows inside the graph and the masked rows picked afterwards (row-wise identical math).

:class:`GraphCache` keeps captured steps by shape (static KV tokens, query start, local tokens): a later
request with the same shape copies its static KV and query into the captured buffers and replays, so it
pays neither the capture nor its warm-up forwards. On CPU the same objects run eagerly (no capture), which
keeps the reload logic testable.
"""

from __future__ import annotations

import gc
from collections import OrderedDict

import torch

from pdllm.decode_service.attention import BufferedAttention, PagedSplitSAttention
from pdllm.shared.model.attention import AttentionBackend
from pdllm.shared.model.transformer import DiffusionLM


class GraphedStep:
    def __init__(
        self,
        model: DiffusionLM,
        backend: AttentionBackend,
        local: torch.Tensor,
        positions: torch.Tensor,
        query_len: int,
        warmup: int = 2,
    ) -> None:
        # No closure over self: a reference cycle would leave this object (and its CUDA graph) to the
        # cyclic GC, which can run in the middle of another step's capture, where destroying a graph is an
        # illegal CUDA call that invalidates that capture.
        self.model = model
        self.local = local
        self.positions = positions
        self.query_len = query_len
        self.backend = backend
        self.rows = torch.arange(query_len, local.shape[0], device=local.device)[None]
        self.graph: torch.cuda.CUDAGraph | None = None
        if local.device.type != "cuda":
            return
        stream = torch.cuda.Stream(device=local.device)
        stream.wait_stream(torch.cuda.current_stream(local.device))
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                self._step()
        torch.cuda.current_stream(local.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        gc.collect()  # free unreachable graphs now, then keep the collector out of the capture
        gc.disable()
        try:
            with torch.cuda.graph(self.graph):
                self.logits = self._step()
        finally:
            gc.enable()

    def load(self, static: torch.Tensor, local: torch.Tensor) -> None:
        """Put another request's static KV and local tokens (same shapes) into the captured buffers."""
        self.backend.load(static)  # type: ignore[attr-defined]
        self.local.copy_(local)

    def _step(self) -> torch.Tensor:
        hidden = self.model.hidden_states(self.local[None], self.positions, self.backend)
        return self.model.logits_from_hidden(hidden, self.rows)[0]

    def __call__(self, response: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        self.local[self.query_len :] = response
        if self.graph is None:
            return self._step()[at]
        self.graph.replay()
        return self.logits[at]


def _reloadable(mode: str, static: torch.Tensor, local_len: int) -> BufferedAttention | PagedSplitSAttention:
    if mode == "buffer":
        return BufferedAttention(static, local_len)
    if mode == "triton":
        return PagedSplitSAttention(static)
    raise ValueError(f"decode attention {mode!r} cannot be reloaded in place (use 'buffer' or 'triton')")


class GraphCache:
    """Captured decode steps by shape, least recently used evicted beyond ``capacity``."""

    def __init__(self, capacity: int = 4) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[tuple, GraphedStep] = OrderedDict()
        self.hits = 0
        self.captures = 0

    def step(
        self,
        model: DiffusionLM,
        mode: str,
        static: torch.Tensor,
        local: torch.Tensor,
        positions: torch.Tensor,
        query_len: int,
    ) -> GraphedStep:
        """A step over ``static`` (``[layers, 2, Hkv, S, D]``) whose local buffer starts as ``local``."""
        key = (mode, static.shape[3], int(positions[0, 0]), local.shape[0], query_len)
        graphed = self._entries.get(key)
        if graphed is not None:
            graphed.load(static, local)
            self._entries.move_to_end(key)
            self.hits += 1
            return graphed
        backend = _reloadable(mode, static, local.shape[0])
        graphed = GraphedStep(model, backend, local.clone(), positions.clone(), query_len)
        self._entries[key] = graphed
        self.captures += 1
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return graphed
