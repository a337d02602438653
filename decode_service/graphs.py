"""CUDA-graph replay of the single-request decode step (``decode.py``), and a cache of captured steps
across requests (GPU). The decode server's batched rounds have their own graphs (``round_graphs.py``).

A decode step forwards the same number of tokens at the same positions over the same static KV every
step; only the response token ids change. With a step-invariant attention backend the whole forward
(embedding, all layers, LM head over every response row) is captured once and replayed, which removes the
per-kernel launch cost that otherwise dominates a ~5 ms memory-bound step. Logits are computed for all
response rows inside the graph and the masked rows picked afterwards (row-wise identical math).

Greedy requests then never leave the device (:meth:`GraphedStep.denoise`): a second, small graph per block
length replays :class:`~pdllm.shared.generation.device_sampler.DeviceUnmasker` (prediction, top-k or
threshold, token update, block / EOS bookkeeping) on the forward's logits and writes the next step's
input tokens in place. A step is two graph launches and no host sync; the host reads one flag only where
the schedule cannot tell whether the request is done (threshold mode: every step; EOS stop: at the end of
each non-final block), and the tokens once at the end.

:class:`GraphCache` keeps captured steps by shape (static KV tokens, query start, local tokens): a later
request with the same shape copies its static KV and query into the captured buffers and replays, so it
pays neither the capture nor its warm-up forwards. On CPU the same objects run eagerly (no capture), which
keeps the reload logic testable.
"""

from __future__ import annotations

import gc
import time
from collections import OrderedDict

import torch
from tqdm import tqdm

from pdllm.decode_service.attention import BufferedAttention, PagedSplitSAttention
from pdllm.shared.generation.device_sampler import DeviceUnmasker
from pdllm.shared.generation.sampler import GenerationConfig, GenerationResult, trim_response
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
        # unmasking graphs by (block length, mask id, EOS id), captured on first use
        self._unmaskers: dict[tuple[int, int, int | None], tuple[DeviceUnmasker, torch.cuda.CUDAGraph | None]]
        self._unmaskers = {}
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

    def _unmasker(
        self, block: int, mask_id: int, eos_id: int | None
    ) -> tuple[DeviceUnmasker, torch.cuda.CUDAGraph | None]:
        key = (block, mask_id, eos_id)
        if key in self._unmaskers:
            return self._unmaskers[key]
        response = self.local[self.query_len :]
        unmasker = DeviceUnmasker(response.shape[0], block, mask_id, eos_id, self.local.device)
        graph = None
        if self.graph is not None:
            device = self.local.device
            saved = response.clone()
            stream = torch.cuda.Stream(device=device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                unmasker.step(self.logits, response)  # warm-up outside the capture; undone below
            torch.cuda.current_stream(device).wait_stream(stream)
            response.copy_(saved)
            graph = torch.cuda.CUDAGraph()
            gc.collect()
            gc.disable()
            try:
                # reads the forward graph's logits and writes its input tokens: one pool, replayed in turn
                with torch.cuda.graph(graph, pool=self.graph.pool()):
                    unmasker.step(self.logits, response)
            finally:
                gc.enable()
        self._unmaskers[key] = (unmasker, graph)
        return unmasker, graph

    def denoise(
        self, gen: GenerationConfig, mask_id: int, eos_id: int | None, progress: bool = False
    ) -> GenerationResult:
        """Decode a greedy request whose response in the local buffer is all [MASK]: every step the
        forward and :class:`DeviceUnmasker` run on the device (replayed graphs on CUDA, eagerly
        elsewhere); token for token what :func:`~pdllm.shared.generation.sampler.denoise` gives with this
        step as its logits function."""
        unmasker, graph = self._unmasker(gen.block, mask_id, eos_id)
        unmasker.reset(gen)
        response = self.local[self.query_len :]
        most, checks = unmasker.checks_after(gen)
        start = time.perf_counter()
        with tqdm(
            total=most, disable=not progress, delay=1.0, desc="denoise", unit="step", leave=False
        ) as bar:
            for step in range(most):
                if self.graph is None:
                    unmasker.step(self._step(), response)
                else:
                    self.graph.replay()
                    graph.replay()  # type: ignore[union-attr]
                bar.update(1)
                if step in checks and bool(unmasker.finished):
                    break
            tokens = response.tolist()
            steps = int(unmasker.steps_taken)
        return GenerationResult(
            token_ids=trim_response(tokens, eos_id, mask_id),
            raw_tokens=tokens,
            steps=steps,
            decode_seconds=time.perf_counter() - start,
        )


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
