"""The decode worker's scheduler: batched denoising rounds over every active request.

One scheduler thread owns the model. Each iteration (:meth:`DecodeScheduler.run_once`) it drops cancelled
requests (their KV pages go back to the pool at once), admits waiting requests while ``max_active`` and the
KV pool allow (reserving their pages), builds the new sessions' decode KV, then runs **one** batched
forward that advances every pdllm session by one denoising step (:func:`~.rounds.decode_round`) and
publishes partial outputs; finished requests leave before the next round. Sessions that cannot share a
round (vanilla: full attention over the whole prompt) are stepped alone in the same iteration. The gRPC
handler threads only wait on their job's event queue.

Admission: at most ``max_waiting`` requests wait; beyond that, and for a request larger than the whole KV
pool, ``submit`` answers RESOURCE_EXHAUSTED (the router retries another worker).
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

from pdllm.decode_service.decode import StaticKV
from pdllm.decode_service.kv_pool import DecodeKVPool
from pdllm.decode_service.rounds import BatchSession, RoundForward, decode_round
from pdllm.shared.generation.sampler import DenoiseSession, GenerationConfig, GenerationResult
from pdllm.shared.model.transformer import DiffusionLM
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
    peak_bytes: int  # this request's own: its KV pages plus its build's transient memory


@dataclass
class StaticDecode:
    """A pdllm session to join the batched rounds: its query suffix, built static KV and settings."""

    query: list[int]
    static: StaticKV
    gen: GenerationConfig
    cache_stats: tuple[int, int] = (0, 0)  # KV tier hits / misses of its chunks (chunk-only)


Session = BatchSession | DenoiseSession


@dataclass
class DecodeJob:
    request_id: str
    # Builds the session's decode KV (StaticDecode) or a session stepped alone (DenoiseSession); runs on
    # the scheduler thread, which owns the device.
    start: Callable[[], StaticDecode | DenoiseSession]
    cancelled: threading.Event
    stream_partials: bool = True
    # Static KV tokens the session will hold in the pool (an upper bound; 0: it holds none).
    kv_tokens: int = 0
    events: queue.Queue = field(default_factory=queue.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    session: Session | None = None
    pages: list[int] = field(default_factory=list)
    queue_s: float = 0.0
    build_s: float = 0.0
    build_bytes: int = 0
    cache_stats: tuple[int, int] = (0, 0)

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


@dataclass(frozen=True)
class SchedulerConfig:
    max_active: int = 64
    max_waiting: int = 256

    def __post_init__(self) -> None:
        if self.max_active <= 0 or self.max_waiting < 0:
            raise ValueError("max_active must be positive and max_waiting non-negative")


class DecodeScheduler:
    """``forward``: how a round's packed tokens become logits (:class:`~.rounds.EagerRoundForward`, or
    :class:`~.round_graphs.GraphedRoundForward`), over ``pool``. ``start_thread=False`` leaves the loop to
    the caller (:meth:`run_once`; tests drive it that way)."""

    def __init__(
        self,
        model: DiffusionLM,
        pool: DecodeKVPool,
        forward: RoundForward,
        config: SchedulerConfig | None = None,
        registry: CollectorRegistry | None = None,
        start_thread: bool = True,
    ) -> None:
        self.model = model
        self.pool = pool
        self.forward = forward
        self.config = config or SchedulerConfig()
        self.rounds = 0
        self.step_seconds = Histogram(
            "pdllm_decode_step_seconds",
            "Wall time of one denoising round (one step of every active request)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=registry,
        )
        self.build_seconds = Histogram(
            "pdllm_decode_build_seconds", "Decode KV build per request", registry=registry
        )
        Gauge("pdllm_decode_active", "Requests being decoded or waiting", registry=registry).set_function(
            lambda: self.depth
        )
        Gauge(
            "pdllm_decode_kv_pool_free_bytes", "Free bytes in the decode KV pool", registry=registry
        ).set_function(lambda: self.pool.num_free * self.pool.page_bytes)
        self._waiting: deque[DecodeJob] = deque()
        self._active: list[DecodeJob] = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        if start_thread:
            self._thread = threading.Thread(target=self._loop, name="decode-scheduler", daemon=True)
            self._thread.start()

    @property
    def depth(self) -> int:
        """Requests waiting or being decoded (the autoscaling signal)."""
        with self._cv:
            return len(self._waiting) + len(self._active)

    @property
    def active(self) -> list[DecodeJob]:
        with self._cv:
            return list(self._active)

    def submit(self, job: DecodeJob) -> DecodeJob:
        if job.kv_tokens and self.pool.pages_for(job.kv_tokens) > self.pool.num_pages:
            raise PdllmError(
                f"the request needs {self.pool.pages_for(job.kv_tokens) * self.pool.page_bytes} bytes of "
                f"decode KV ({job.kv_tokens} tokens); this worker's KV pool holds "
                f"{self.pool.num_pages * self.pool.page_bytes} bytes",
                code=grpc.StatusCode.RESOURCE_EXHAUSTED,
                request_id=job.request_id,
            )
        with self._cv:
            if len(self._waiting) >= self.config.max_waiting:
                raise PdllmError(
                    f"decode queue is full ({self.config.max_waiting} waiting); retry on another worker",
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
        if self._thread is not None:
            self._thread.join(timeout=5)

    # ------------------------------------------------------------------ scheduler thread
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._waiting and not self._active:
                    self._cv.wait()
                if self._stop:
                    return
            try:
                self.run_once()
            except Exception:  # never let the loop die: fail what was running, keep serving
                _log.exception("decode scheduler iteration failed")

    def run_once(self) -> None:
        """Drop cancelled requests, admit and build new ones, run one round, publish, retire."""
        with torch.inference_mode():
            self._retire([j for j in self.active if j.cancelled.is_set()])
            for job in self._take_admissible():
                self._build(job)
            self._round()

    def _take_admissible(self) -> list[DecodeJob]:
        admitted: list[DecodeJob] = []
        with self._cv:
            self._waiting = deque(j for j in self._waiting if not j.cancelled.is_set())
            while self._waiting and len(self._active) + len(admitted) < self.config.max_active:
                job = self._waiting[0]
                if job.kv_tokens:
                    pages = self.pool.reserve(job.kv_tokens)
                    if pages is None:  # wait for pages; first come, first served
                        break
                    job.pages = pages
                admitted.append(self._waiting.popleft())
        return admitted

    def _build(self, job: DecodeJob) -> None:
        start = time.perf_counter()
        job.queue_s = start - job.submitted
        device = self.pool.kv.device
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        try:
            built = job.start()
            if isinstance(built, StaticDecode):
                static, job.cache_stats = built.static, built.cache_stats
                self.pool.write(job.pages, static.tensor())
                job.session = BatchSession.start(
                    self.model, built.query, static.query_start, static.num_tokens, job.pages, built.gen
                )
            else:
                job.session = built
        except Exception as exc:  # a bad request must not take the worker down
            self.pool.release(job.pages)
            job.pages = []
            job.events.put(exc)
            return
        if cuda:
            job.build_bytes = max(0, torch.cuda.max_memory_allocated(device) - before)
        job.build_s = time.perf_counter() - start
        self.build_seconds.observe(job.build_s)
        with self._cv:
            self._active.append(job)

    def _round(self) -> None:
        active = [j for j in self.active if not j.cancelled.is_set()]
        batched = [j for j in active if isinstance(j.session, BatchSession)]
        alone = [j for j in active if not isinstance(j.session, BatchSession)]
        failed: list[DecodeJob] = []
        if batched:
            start = time.perf_counter()
            try:
                decode_round(self.forward, [j.session for j in batched])  # type: ignore[misc]
            except Exception as exc:
                _log.exception("batched decode round failed")
                for job in batched:
                    job.events.put(exc)
                failed += batched
                batched = []
            else:
                self.step_seconds.observe(time.perf_counter() - start)
                self.rounds += 1
        for job in alone:
            try:
                start = time.perf_counter()
                job.session.step()  # type: ignore[union-attr]
                self.step_seconds.observe(time.perf_counter() - start)
            except Exception as exc:
                _log.exception("decode step failed", extra={"request_id": job.request_id})
                job.events.put(exc)
                failed.append(job)
        finished = failed
        for job in batched + [j for j in alone if j not in failed]:
            session = job.session
            assert session is not None
            if job.stream_partials:
                state = session.state
                job.events.put(Partial(state.steps_taken, state.block, session.partial()))
            if session.done:
                peak = len(job.pages) * self.pool.page_bytes + job.build_bytes
                job.events.put(Final(session.result(), job.build_s, job.queue_s, peak))
                finished.append(job)
        self._retire(finished)

    def _retire(self, jobs: list[DecodeJob]) -> None:
        if not jobs:
            return
        with self._cv:
            self._active = [j for j in self._active if j not in jobs]
        for job in jobs:
            self.pool.release(job.pages)
            job.pages = []
