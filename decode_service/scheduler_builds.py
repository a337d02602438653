"""The decode scheduler's request stages before and after the rounds: a request's KV pull, its decode-KV
build (whole on the build stream, or in pieces between rounds), its session start (BUILDING -> RUNNING),
and its exit (FAILED, or retired as FINISHED / CANCELLED) with its pool pages given back.

:class:`BuildStages` holds these steps for :class:`~.scheduler.DecodeScheduler`, which owns the state they
work on (declared below) and calls them once per iteration, between the rounds.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch
from prometheus_client import Histogram

from pdllm.decode_service.kv_pool import DecodeKVPool
from pdllm.decode_service.policy_rounds import batch_session
from pdllm.decode_service.request import Build, DecodeRequest, StaticDecode, Status
from pdllm.shared.model.transformer import DiffusionLM
from pdllm.shared.stepwise import Steps

if TYPE_CHECKING:
    from collections import deque

    from pdllm.decode_service.scheduler import SchedulerConfig

# The scheduler's logger: these steps are its own.
_log = logging.getLogger("pdllm.decode.scheduler")


class BuildStages:
    """WAITING -> PULLING -> BUILDING -> RUNNING, and out (FAILED, FINISHED, CANCELLED), on the scheduler
    thread; the attributes are :class:`~.scheduler.DecodeScheduler`'s."""

    model: DiffusionLM
    pool: DecodeKVPool
    config: SchedulerConfig
    build_seconds: Histogram
    round_stream: torch.cuda.Stream | None
    build_stream: torch.cuda.Stream | None
    _cv: threading.Condition
    _building: list[DecodeRequest]
    _active: list[DecodeRequest]
    _foreign: deque[tuple[Steps, Future]]

    def _on(self, stream: torch.cuda.Stream | None):  # type: ignore[no-untyped-def]
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def _launch_build(self, req: DecodeRequest) -> None:
        """WAITING -> PULLING for a request with a KV handoff (its pages are reserved; it builds once the pull
        has finished), else -> BUILDING: its build in pieces (``build_pieces``), or whole on the build stream
        (CUDA: queued behind nothing the rounds wait for)."""
        if not req.build_started:
            req.build_started = time.perf_counter()
            req.queue_s = req.build_started - req.submitted
        if req.fetch is not None:
            req.transfer, req.fetch = req.fetch(), None
            req.status = Status.PULLING
            with self._cv:
                self._building.append(req)
            return
        req.status = Status.BUILDING
        if self.config.build_pieces and req.start_steps is not None:
            req.build = Build(steps=req.start_steps(self.config.build_pieces))
            with self._cv:
                self._building.append(req)
            return
        device = self.pool.kv.device
        build = Build()
        try:
            with self._on(self.build_stream):
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                    before = torch.cuda.memory_allocated(device)
                build.made = req.start()
                if build.made.static is not None:
                    self.pool.place(req.pages, build.made.static)
                if self.build_stream is not None:
                    build.done = torch.cuda.Event()
                    build.done.record(self.build_stream)
                    req.build_bytes = max(0, torch.cuda.max_memory_allocated(device) - before)
        except Exception as exc:  # a bad request must not take the worker down
            self._fail(req, exc)
            return
        req.build = build
        with self._cv:
            self._building.append(req)

    def _fail(self, req: DecodeRequest, exc: BaseException) -> None:
        """-> FAILED: its pages back, the error to its caller (a request being built: not in the lists)."""
        self.pool.release(req.pages)
        req.pages = []
        req.build = None
        req.status = Status.FAILED
        req.events.put(exc)

    def _advance_transfers(self) -> None:
        """PULLING -> BUILDING once the pull finished (done or failed; cancelled: retired); with nothing else
        to do, wait a little for one instead of spinning."""
        with self._cv:
            pulling = [r for r in self._building if r.status is Status.PULLING]
            idle = len(pulling) == len(self._building) and not self._active and not self._foreign
        if pulling and idle and not any(r.transfer.finished for r in pulling):  # type: ignore[union-attr]
            pulling[0].transfer.wait(0.05)  # type: ignore[union-attr]
        for req in [r for r in pulling if r.pull_over()]:
            with self._cv:
                self._building.remove(req)
            req.received, req.transfer = req.transfer, None
            if req.cancelled.is_set():
                self._retire([req], Status.CANCELLED)
            else:
                self._launch_build(req)

    def _advance_build_pieces(self) -> None:
        """Pieces mode: one piece of the oldest unfinished build while sessions decode, all of them when
        none do. Pieces run on the round stream, so a round never overlaps a piece."""
        while True:
            with self._cv:
                pending = [r for r in self._building if r.build is not None and r.build.steps is not None]
                decoding = bool(self._active)
            if not pending:
                return
            req = pending[0]
            build = req.build
            assert build is not None and build.steps is not None
            try:
                with self._on(self.round_stream):
                    next(build.steps)
            except StopIteration as stop:
                made: StaticDecode = stop.value
                if made.static is not None:
                    with self._on(self.round_stream):
                        self.pool.place(req.pages, made.static)
                build.made, build.steps = made, None
            except Exception as exc:  # a bad request must not take the worker down
                with self._cv:
                    self._building.remove(req)
                self._fail(req, exc)
            if decoding:
                return

    def _join_built(self) -> None:
        """BUILDING -> RUNNING for builds whose device work has finished (with nothing to decode, wait for
        one); a request cancelled meanwhile is retired instead."""
        with self._cv:
            building = [
                r for r in self._building if r.status is Status.BUILDING and r.build and r.build.steps is None
            ]
            idle = not self._active and not self._foreign
        if not building:
            return
        ready = [r for r in building if r.build.done is None or r.build.done.query()]  # type: ignore[union-attr]
        if not ready and idle:
            building[0].build.done.synchronize()  # type: ignore[union-attr]
            ready = [building[0]]
        joined, dropped = [], []
        for req in ready:
            made = req.build.made  # type: ignore[union-attr]
            assert made is not None
            req.cache_stats, req.kv_source = made.cache_stats, made.kv_source
            try:  # e.g. out of memory for a policy's cache: the request fails, not the loop
                req.session = batch_session(self.model, made, req.pages, self.pool.page_size)
            except Exception as exc:
                _log.exception("decode session failed to start", extra={"request_id": req.request_id})
                self._fail(req, exc)
                continue
            req.build = None
            req.build_s = time.perf_counter() - req.build_started
            self.build_seconds.observe(req.build_s)
            if req.cancelled.is_set():
                dropped.append(req)
            else:
                req.status = Status.RUNNING
                joined.append(req)
        with self._cv:
            self._building = [r for r in self._building if r not in ready]
            self._active += joined
        self._retire(dropped, Status.CANCELLED)

    def _retire(self, reqs: list[DecodeRequest], status: Status) -> None:
        """RUNNING (or PULLING / BUILDING) -> ``status``: out of the lists, pages back to the pool."""
        if not reqs:
            return
        with self._cv:
            self._active = [r for r in self._active if r not in reqs]
        for req in reqs:
            self.pool.release(req.pages)
            req.pages = []
            req.status = status
