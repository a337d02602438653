"""The decode worker's scheduler: batched denoising rounds over every active request.

One scheduler thread owns the model. Each iteration (:meth:`DecodeScheduler.run_once`) it drops cancelled
requests (their KV pages go back to the pool at once), admits waiting requests while ``max_active`` and the
KV pool allow (reserving their pages), starts their KV pulls (a handoff) or launches their decode-KV builds,
lets finished builds join, then runs **one** batched forward that advances every session in the rounds
(pdllm and vanilla, plain or under any decode policy, and SDAR block diffusion, plain or under FOCUS) by
one denoising step (:func:`~.rounds.decode_round`; ``rounds`` counts them) and publishes partial outputs;
finished requests leave before the next round. On CUDA builds run on their own stream and rounds on a
high-priority one, so a build (~0.1 s at Dream-7B scale) overlaps the rounds instead of stalling them; on
CPU a build finishes before the round. gRPC handler threads only wait on their request's event queue; the in-process engine drives :meth:`DecodeScheduler.run_once` itself (``local.py``).

In an all-in-one process this thread is the only one that uses the device: the prefill worker hands its
batches over (:meth:`DecodeScheduler.run_between_rounds`) and they run in chunk-sized pieces, one piece
per iteration while requests are decoding. A chunk-prefill piece the batch hands over as work
(``ChunkForward``; ``serve --fused-prefill``) rides in the next round's forward (``prefill_rows.py``): one
forward for both; other pieces (scoring) run between rounds. With ``overlap_pieces`` (CUDA) those run on a low-priority stream
whose work overlaps the following rounds, the next piece launched once the previous one finished.

Admission: at most ``max_waiting`` requests wait; beyond that, and for a request larger than the whole KV
pool, ``submit`` answers RESOURCE_EXHAUSTED (the router retries another worker).

This module holds admission, the loop, the rounds and the foreign pieces; a request's pull, build, session
start and exit are ``scheduler_builds.py``'s :class:`~.scheduler_builds.BuildStages`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

import grpc
import torch
from prometheus_client import CollectorRegistry, Gauge, Histogram

from pdllm.decode_service.kv_pool import DecodeKVPool, PoolTooSmallError
from pdllm.decode_service.request import DecodeRequest, Final, Partial, Status
from pdllm.decode_service.rounds import RoundForward, decode_round
from pdllm.decode_service.scheduler_builds import BuildStages
from pdllm.shared.chunk_prefill import ChunkForward
from pdllm.shared.model.transformer import DiffusionLM
from pdllm.shared.rpc.errors import PdllmError
from pdllm.shared.stepwise import Steps, join_device_thread

T = TypeVar("T")

_log = logging.getLogger("pdllm.decode.scheduler")


@dataclass(frozen=True)
class SchedulerConfig:
    max_active: int = 64
    max_waiting: int = 256
    # CUDA: foreign pieces (run_between_rounds) overlap the next rounds on a low-priority stream; off by
    # default: no gain beyond noise at 16 x 16K on an H100 (benchmarks/results/serving_notes.md).
    overlap_pieces: bool = False
    # > 0: builds run between rounds in pieces of this many layers; 0: whole, on their own stream (CUDA).
    build_pieces: int = 0

    def __post_init__(self) -> None:
        if self.max_active <= 0 or self.max_waiting < 0 or self.build_pieces < 0:
            raise ValueError("max_active must be positive, max_waiting and build_pieces non-negative")


class DecodeScheduler(BuildStages):
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
        self._waiting: deque[DecodeRequest] = deque()
        self._building: list[DecodeRequest] = []
        self._foreign: deque[tuple[Steps, Future]] = deque()  # see run_between_rounds
        self._carried: ChunkForward | None = (
            None  # handed over by the first foreign steps, for the next round
        )
        self._active: list[DecodeRequest] = []
        # Rounds on a high-priority stream, builds on a normal one: the GPU schedules a round's blocks
        # ahead of a build's (or the prefill worker's) pending blocks, so no round waits for a whole build.
        cuda = pool.kv.device.type == "cuda"
        self.round_stream = torch.cuda.Stream(pool.kv.device, priority=-1) if cuda else None
        self.build_stream = torch.cuda.Stream(pool.kv.device, priority=0) if cuda else None
        overlap = cuda and self.config.overlap_pieces
        self.piece_stream = torch.cuda.Stream(pool.kv.device, priority=0) if overlap else None
        self._piece_done: torch.cuda.Event | None = None  # the last piece's device work (overlap only)
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
            return len(self._waiting) + len(self._building) + len(self._active)

    @property
    def active(self) -> list[DecodeRequest]:
        with self._cv:
            return list(self._active)

    def submit(self, req: DecodeRequest) -> DecodeRequest:
        try:
            self.pool.check_fits(req.pool_tokens)
        except PoolTooSmallError as exc:
            raise PdllmError(
                str(exc), code=grpc.StatusCode.RESOURCE_EXHAUSTED, request_id=req.request_id
            ) from exc
        with self._cv:
            if len(self._waiting) >= self.config.max_waiting:
                raise PdllmError(
                    f"decode queue is full ({self.config.max_waiting} waiting); retry on another worker",
                    code=grpc.StatusCode.RESOURCE_EXHAUSTED,
                    request_id=req.request_id,
                )
            self._waiting.append(req)
            self._cv.notify()
        return req

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:  # the step in progress ends first (it cannot be cut short)
            join_device_thread(self._thread, "decode scheduler")
        with self._cv:  # nobody waits forever on work this thread will not run
            for _, future in self._foreign:
                future.set_exception(RuntimeError("the decode scheduler stopped"))
            self._foreign.clear()

    # ------------------------------------------------------------------ scheduler thread
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stop or self._waiting or self._building or self._active or self._foreign):
                    self._cv.wait()
                if self._stop:
                    return
            try:
                self.run_once()
            except Exception:  # never let the loop die: fail what was running, keep serving
                _log.exception("decode scheduler iteration failed")

    def run_once(self) -> None:
        """Drop cancelled requests, admit new ones and launch their builds, let finished builds join, run
        one round, publish, retire."""
        with torch.inference_mode():
            self._retire([r for r in self.active if r.cancelled.is_set()], Status.CANCELLED)
            for req in self._take_admissible():
                self._launch_build(req)
            self._advance_transfers()
            self._advance_build_pieces()
            self._join_built()
            with self._on(self.round_stream):
                self._round()
            self._advance_foreign()

    def run_between_rounds(self, steps: Steps[T]) -> T:
        """Run another role's device work on this thread (``serve --role all``: the prefill worker's
        batches, in chunk-sized pieces), at most one piece per iteration while requests are decoding (on
        CUDA: launched once the previous piece has finished on the device) and all of it while none are;
        blocks the calling thread until it is done and returns its result."""
        future: Future = Future()
        with self._cv:
            self._foreign.append((steps, future))
            self._cv.notify()
        return future.result()

    def _advance_foreign(self) -> None:
        while True:
            with self._cv:
                if not self._foreign or self._stop:  # close() fails what is left
                    return
                steps, future = self._foreign[0]
                decoding = bool(self._waiting or self._building or self._active)
            if decoding and self._piece_done is not None and not self._piece_done.query():
                return  # the last piece is still on the device: the rounds go on without waiting for it
            carried, self._carried = self._carried, None
            try:
                if carried is not None and carried.error is not None:  # the round that carried it failed
                    steps.throw(carried.error)
                with self._on(self.piece_stream):
                    work = next(steps)
                    if isinstance(work, ChunkForward) and decoding:
                        self._carried = work  # the next round's forward runs it
                        return
                    if work is not None:
                        work.run()
                    if self.piece_stream is not None:
                        self._piece_done = torch.cuda.Event()
                        self._piece_done.record(self.piece_stream)
                finished = False
            except StopIteration as stop:
                future.set_result(stop.value)
                finished = True
            except Exception as exc:  # the caller gets it; the decode rounds go on
                future.set_exception(exc)
                finished = True
            with self._cv:
                if finished:
                    self._foreign.popleft()
                if self._waiting or self._building or self._active:
                    return  # decoding requests get the next round before the next piece

    def _take_admissible(self) -> list[DecodeRequest]:
        admitted: list[DecodeRequest] = []
        with self._cv:
            for req in [r for r in self._waiting if r.cancelled.is_set()]:
                req.status = Status.CANCELLED
            self._waiting = deque(r for r in self._waiting if not r.cancelled.is_set())
            busy = len(self._active) + len(self._building)
            while self._waiting and busy + len(admitted) < self.config.max_active:
                req = self._waiting[0]
                if req.pool_tokens:
                    pages = self.pool.reserve(req.pool_tokens, run=req.fetch is not None)
                    if pages is None:  # wait for pages; first come, first served
                        break
                    req.pages = pages
                    held = len(pages) * self.pool.page_bytes
                    req.pool_peak_bytes = max(req.pool_peak_bytes, held)
                admitted.append(self._waiting.popleft())
        return admitted

    def _round(self) -> None:
        """One step of every RUNNING request in one batched forward; then partial outputs, and finished
        requests leave."""
        batched = [r for r in self.active if not r.cancelled.is_set()]
        piece = self._carried
        if not batched:
            if piece is not None:  # its round has nobody left: alone (a failure reaches its caller)
                self._run_alone(piece)
            return
        start = time.perf_counter()
        try:
            decode_round(self.forward, [r.session for r in batched], piece)  # type: ignore[misc]
        except Exception as exc:
            _log.exception("batched decode round failed")
            if piece is not None:
                piece.error = exc
            for req in batched:
                req.events.put(exc)
            self._retire(batched, Status.FAILED)
            return
        self.step_seconds.observe(time.perf_counter() - start)
        self.rounds += 1
        finished = []
        for req in batched:
            session = req.session
            assert session is not None
            if req.stream_partials:
                state = session.state
                # After its last step a state points past its last block; the partial names the block it
                # denoised (generation.proto: "block being denoised").
                block = min(state.block, state.num_blocks - 1)
                req.events.put(Partial(state.steps_taken, block, session.partial()))
            if session.done:
                held = len(req.pages) * self.pool.page_bytes
                peak = held + req.build_bytes
                final = Final(session.result(), req.build_s, req.queue_s, peak, held, req.pool_peak_bytes)
                req.events.put(final)
                finished.append(req)
        self._retire(finished, Status.FINISHED)

    def _run_alone(self, piece: ChunkForward) -> None:
        try:
            piece.run()
        except Exception as exc:
            piece.error = exc
