"""The decode worker's scheduler and rounds driven from the caller's thread: step 7 of the in-process engine.

``generate``, ``eval`` and ``demo`` decode a request through the same :class:`~.scheduler.DecodeScheduler`,
KV pool and round forward (eager, or CUDA-graph buckets) as the decode server, one scheduler iteration per
denoising step, so an answer in process equals the worker's token for token and costs the same per step.
The pool is sized for the largest request seen so far (grown, and its graphs dropped, when one does not fit).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from tqdm import tqdm

from pdllm.decode_service.kv_pool import DecodeKVPool
from pdllm.decode_service.request import DecodeRequest, Final, Partial, Started
from pdllm.decode_service.round_graphs import GraphedRoundForward
from pdllm.decode_service.rounds import EagerRoundForward, RoundForward
from pdllm.decode_service.scheduler import DecodeScheduler
from pdllm.shared.generation.sampler import GenerationConfig, GenerationResult
from pdllm.shared.model.transformer import DiffusionLM


class LocalDecoder:
    """``kernel``: the rounds' attention ("triton" or "torch"); ``cuda_graph``: rounds through the graph
    buckets (captured and replayed on CUDA)."""

    def __init__(self, model: DiffusionLM, kernel: str, cuda_graph: bool, page_size: int = 64) -> None:
        self.model, self.kernel, self.cuda_graph, self.page_size = model, kernel, cuda_graph, page_size
        self.pool: DecodeKVPool | None = None
        self.forward: RoundForward | None = None
        self.scheduler: DecodeScheduler | None = None

    def _scheduler(self, tokens: int) -> DecodeScheduler:
        """A scheduler whose pool holds ``tokens`` slots (the last one, when it does)."""
        pool = self.pool
        if pool is not None and self.scheduler is not None and pool.pages_for(tokens) <= pool.num_pages:
            return self.scheduler
        pages = 1 << max(0, -(-tokens // self.page_size) - 1).bit_length()  # powers of two: few regrowths
        self.scheduler = self.forward = self.pool = None  # the old pool's memory goes before the new one's
        self.pool = DecodeKVPool.with_pages(self.model, pages, self.page_size)
        if self.cuda_graph:  # off CUDA: the graphs' padded buffers, run eagerly
            capture = self.pool.kv.device.type == "cuda"
            self.forward = GraphedRoundForward(self.model, self.pool, self.kernel, capture=capture)
        else:
            self.forward = EagerRoundForward(self.model, self.pool, self.kernel)
        self.scheduler = DecodeScheduler(self.model, self.pool, self.forward, start_thread=False)
        return self.scheduler

    def run(
        self,
        start: Callable[[], Started],
        kv_tokens: int,
        cache_tokens: int,
        gen: GenerationConfig,
        progress: bool = False,
        cancelled: threading.Event | None = None,
    ) -> GenerationResult:
        """Step 7 of one request through the scheduler: ``start`` makes its session (``sessions.py``) on the
        first iteration; ``kv_tokens`` / ``cache_tokens``: the pool slots it reserves."""
        scheduler = self._scheduler(kv_tokens + cache_tokens)
        event = cancelled or threading.Event()
        req = DecodeRequest("local", start, event, progress, kv_tokens, cache_tokens=cache_tokens)
        scheduler.submit(req)
        begin = time.perf_counter()
        total = gen.gen_length if gen.threshold is not None else gen.steps
        with tqdm(
            total=total, disable=not progress, delay=1.0, desc="denoise", unit="step", leave=False
        ) as bar:
            while True:
                scheduler.run_once()
                while not req.events.empty():
                    out = req.events.get_nowait()
                    if isinstance(out, BaseException):
                        raise out
                    if isinstance(out, Partial):
                        bar.update(out.step - bar.n)
                    elif isinstance(out, Final):
                        # Wall time to the result, which the device sessions' last read waited for (a
                        # round's own time is the host's, up to its launch).
                        out.result.decode_seconds = time.perf_counter() - begin
                        return out.result
                if not scheduler.depth:  # pragma: no cover - a req always ends in a Final or an error
                    raise RuntimeError("the local decode ended without a result")
