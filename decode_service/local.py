"""The decode worker's scheduler and rounds driven from the caller's thread: step 7 of the in-process engine.

``generate``, ``eval`` and ``demo`` decode requests through the same :class:`~.scheduler.DecodeScheduler`,
KV pool and round forward (eager, or CUDA-graph buckets) as the decode server, one scheduler iteration per
denoising step, so an answer in process equals the worker's token for token and costs the same per step.
:meth:`LocalDecoder.run_many` submits several requests at once, so each round is one forward for all of
them (``eval --eval-batch``); each request's own result still counts its own steps.
The pool is sized for the largest batch seen so far (grown, and its graphs dropped, when one does not fit).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tqdm import tqdm

from pdllm.decode_service.kv_pool import DecodeKVPool
from pdllm.decode_service.request import DecodeRequest, Final, Partial, Started
from pdllm.decode_service.round_graphs import GraphedRoundForward
from pdllm.decode_service.rounds import EagerRoundForward, RoundForward
from pdllm.decode_service.scheduler import DecodeScheduler
from pdllm.shared.generation.sampler import GenerationConfig, GenerationResult
from pdllm.shared.model.transformer import DiffusionLM


@dataclass(frozen=True)
class LocalJob:
    """One request's step 7 as the scheduler takes it: ``start`` makes its session (``sessions.py``) on the
    first iteration; ``kv_tokens`` / ``cache_tokens``: the pool slots it reserves."""

    start: Callable[[], Started]
    kv_tokens: int
    cache_tokens: int
    gen: GenerationConfig

    @property
    def steps_bound(self) -> int:
        """Its denoising steps at most (under a threshold: one per answer token)."""
        return self.gen.gen_length if self.gen.threshold is not None else self.gen.steps


class LocalDecodeError(RuntimeError):
    """Some requests of a :meth:`LocalDecoder.run_many` batch failed: ``errors`` maps each failed request's
    index to its error; ``results`` holds every request's result, None where it failed."""

    def __init__(self, errors: dict[int, BaseException], results: list[GenerationResult | None]) -> None:
        first = min(errors)
        super().__init__(
            f"request {first} of {len(results)} failed ({len(errors)} failed in all): {errors[first]!r}"
        )
        self.errors, self.results = errors, results


class LocalDecoder:
    """``kernel``: the rounds' attention ("triton" or "torch"); ``cuda_graph``: rounds through the graph
    buckets (captured and replayed on CUDA)."""

    def __init__(self, model: DiffusionLM, kernel: str, cuda_graph: bool, page_size: int = 64) -> None:
        self.model, self.kernel, self.cuda_graph, self.page_size = model, kernel, cuda_graph, page_size
        self.pool: DecodeKVPool | None = None
        self.forward: RoundForward | None = None
        self.scheduler: DecodeScheduler | None = None

    def _scheduler(self, tokens: Sequence[int]) -> DecodeScheduler:
        """A scheduler whose pool holds every request's ``tokens`` slots at once (the last one, when it
        does), so a batch's requests all join the first round instead of waiting for pages."""
        need = sum(max(1, -(-t // self.page_size)) for t in tokens)
        pool = self.pool
        if pool is not None and self.scheduler is not None and need <= pool.num_pages:
            return self.scheduler
        pages = 1 << max(0, need - 1).bit_length()  # powers of two: few regrowths
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
        self, job: LocalJob, progress: bool = False, cancelled: threading.Event | None = None
    ) -> GenerationResult:
        """Step 7 of one request through the scheduler; its error, if it fails, is raised as it is."""
        try:
            (result,) = self.run_many([job], progress, cancelled)
        except LocalDecodeError as exc:
            raise exc.errors[0] from None
        assert result is not None
        return result

    def run_many(
        self, jobs: Sequence[LocalJob], progress: bool = False, cancelled: threading.Event | None = None
    ) -> list[GenerationResult]:
        """Step 7 of ``jobs`` together: all submitted, then one scheduler iteration (one batched round)
        after another until each has its result; the results in the order of ``jobs``. Each result's
        ``decode_seconds``: wall time from the submission to it. Raises :class:`LocalDecodeError` once
        every request has ended if any failed (the others' results in it)."""
        scheduler = self._scheduler([j.kv_tokens + j.cache_tokens for j in jobs])
        event = cancelled or threading.Event()
        reqs = [
            DecodeRequest(f"local-{i}", j.start, event, progress, j.kv_tokens, cache_tokens=j.cache_tokens)
            for i, j in enumerate(jobs)
        ]
        for req in reqs:
            scheduler.submit(req)
        begin = time.perf_counter()
        results: list[GenerationResult | None] = [None] * len(jobs)
        errors: dict[int, BaseException] = {}
        steps = [0] * len(jobs)
        pending = set(range(len(jobs)))
        total = sum(j.steps_bound for j in jobs)
        with tqdm(
            total=total, disable=not progress, delay=1.0, desc="denoise", unit="step", leave=False
        ) as bar:
            while pending:
                scheduler.run_once()
                for i in sorted(pending):
                    out = self._drain(reqs[i], bar, steps, i)
                    if isinstance(out, BaseException):
                        errors[i] = out
                    elif out is not None:
                        # Wall time to the result, which the device sessions' last read waited for (a
                        # round's own time is the host's, up to its launch).
                        out.decode_seconds = time.perf_counter() - begin
                        results[i] = out
                    if out is not None:
                        pending.discard(i)
                if pending and not scheduler.depth:  # pragma: no cover - each ends in a Final or an error
                    raise RuntimeError("the local decode ended without a result")
        if errors:
            raise LocalDecodeError(errors, results)
        return [r for r in results if r is not None]

    @staticmethod
    def _drain(
        req: DecodeRequest, bar: tqdm, steps: list[int], i: int
    ) -> GenerationResult | BaseException | None:
        """The request's events so far: its result or error once it has one (None: still running)."""
        while not req.events.empty():
            out = req.events.get_nowait()
            if isinstance(out, BaseException):
                return out
            if isinstance(out, Partial):
                bar.update(out.step - steps[i])
                steps[i] = out.step
            elif isinstance(out, Final):
                return out.result
        return None
