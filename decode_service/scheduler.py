"""Continuous batching for the decode worker: requests join and leave at denoising-step boundaries.

One scheduler thread owns the model. Each round it admits waiting jobs (building their decode KV),
then advances every active session by one step and publishes a partial output; finished, failed and
cancelled jobs leave before the next round. A long request therefore never blocks a short one behind
it for more than one step per active request. The gRPC handler threads only wait on their job's
event queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import torch
from prometheus_client import CollectorRegistry, Gauge, Histogram

from pdllm.shared.generation.sampler import DenoiseSession, GenerationResult
from pdllm.shared.rpc.errors import PdllmError

_log = logging.getLogger("pdllm.decode.scheduler")


@dataclass
class Partial:
    step: int
    block: int
    tokens: list[int]  # -1 = still masked


@dataclass
class Final:
    result: GenerationResult
    build_s: float
    queue_s: float


@dataclass
class DecodeJob:
    request_id: str
    # Builds the session (decode KV included); runs on the scheduler thread, which owns the device.
    start: Callable[[], DenoiseSession]
    cancelled: threading.Event
    stream_partials: bool = True
    events: queue.Queue = field(default_factory=queue.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    session: DenoiseSession | None = None
    build_s: float = 0.0

    def stream(self, poll_s: float = 0.5) -> Iterator[Partial | Final]:
        """Events until the final result; re-raises a failure; stops early if the call was cancelled."""
        while True:
            try:
                event = self.events.get(timeout=poll_s)
            except queue.Empty:
                if self.cancelled.is_set():
                    return
                continue
            if isinstance(event, BaseException):
                raise event
            yield event
            if isinstance(event, Final):
                return


class DecodeScheduler:
    def __init__(
        self, max_active: int = 16, max_waiting: int = 256, registry: CollectorRegistry | None = None
    ) -> None:
        self.max_active = max_active
        self.max_waiting = max_waiting
        self.step_seconds = Histogram(
            "pdllm_decode_step_seconds",
            "Wall time of one denoising step of one request",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=registry,
        )
        self.build_seconds = Histogram(
            "pdllm_decode_build_seconds", "Decode KV build per request", registry=registry
        )
        Gauge("pdllm_decode_active", "Requests being decoded or waiting", registry=registry).set_function(
            lambda: self.depth
        )
        self._waiting: deque[DecodeJob] = deque()
        self._active: list[DecodeJob] = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="decode-scheduler", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Requests waiting or being decoded (the autoscaling signal)."""
        with self._cv:
            return len(self._waiting) + len(self._active)

    def submit(self, job: DecodeJob) -> DecodeJob:
        with self._cv:
            if len(self._waiting) >= self.max_waiting:
                raise PdllmError(
                    f"decode queue is full ({self.max_waiting} waiting); retry on another worker",
                    code=grpc.StatusCode.RESOURCE_EXHAUSTED,
                    request_id=job.request_id,
                )
            self._waiting.append(job)
            self._cv.notify()
        return job

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=5)

    # ------------------------------------------------------------------ scheduler thread
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._waiting and not self._active:
                    self._cv.wait()
                if self._stop:
                    return
                admitted = []
                while self._waiting and len(self._active) + len(admitted) < self.max_active:
                    admitted.append(self._waiting.popleft())
            with torch.inference_mode():
                for job in admitted:
                    self._admit(job)
                self._round()

    def _admit(self, job: DecodeJob) -> None:
        if job.cancelled.is_set():
            return
        start = time.perf_counter()
        try:
            job.session = job.start()
        except Exception as exc:  # a bad request must not take the worker down
            job.events.put(exc)
            return
        job.build_s = time.perf_counter() - start
        self.build_seconds.observe(job.build_s)
        with self._cv:
            self._active.append(job)

    def _round(self) -> None:
        with self._cv:
            active = list(self._active)
        finished: list[DecodeJob] = []
        for job in active:
            session = job.session
            assert session is not None
            if job.cancelled.is_set():
                finished.append(job)
                continue
            try:
                before = session.seconds
                session.step()
                self.step_seconds.observe(session.seconds - before)
            except Exception as exc:
                _log.exception("decode step failed", extra={"request_id": job.request_id})
                job.events.put(exc)
                finished.append(job)
                continue
            if job.stream_partials:
                state = session.state
                job.events.put(Partial(state.steps_taken, state.block, session.partial()))
            if session.done:
                queue_s = max(0.0, time.perf_counter() - job.submitted - job.build_s - session.seconds)
                job.events.put(Final(session.result(), job.build_s, queue_s))
                finished.append(job)
        if finished:
            with self._cv:
                self._active = [j for j in self._active if j not in finished]
