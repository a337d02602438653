"""Cross-request batching for the prefill worker.

Concurrent Prefill calls meet in one queue; a single batching thread takes what is waiting (up to
``max_requests`` requests / ``max_tokens`` context tokens, waiting at most ``wait_s`` for company once
the first one arrived) and runs the batch: their chunks are prefilled in the same batched forwards, then
each request is scored and selected. The batching thread drives the device itself (the worker's
``prefill_many``), except in ``serve --role all``, where it hands the batch to the decode scheduler's
thread and waits. A request cancelled while queued never
reaches the device; one cancelled while its batch runs stops being scored, and a batch whose requests
are all cancelled stops before its next forward. One request's bad input fails only that request.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from pdllm.prefill_service.worker import PrefillJob, Selection
from pdllm.shared.stepwise import join_device_thread

PrefillMany = Callable[[list[PrefillJob]], list[Selection | Exception]]


@dataclass(frozen=True)
class BatchingConfig:
    max_requests: int = 8
    max_tokens: int = 131072
    wait_s: float = 0.002

    def __post_init__(self) -> None:
        if self.max_requests < 1 or self.max_tokens < 1 or self.wait_s < 0:
            raise ValueError("batching needs max_requests >= 1, max_tokens >= 1 and wait_s >= 0")


@dataclass
class _Pending:
    job: PrefillJob
    cancelled: threading.Event
    arrived: float = field(default_factory=time.perf_counter)
    future: Future = field(default_factory=Future)


class PrefillBatcher:
    """Owns the batching thread; ``submit`` blocks the caller's thread until its request is done.

    ``prefill_many`` runs one batch: the worker's own (this thread then drives the device), or in an
    all-in-one process a call that hands the batch's device work to the decode scheduler in pieces.
    """

    def __init__(
        self,
        prefill_many: PrefillMany,
        config: BatchingConfig | None = None,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        self.config = config or BatchingConfig()
        self._prefill_many = prefill_many
        self._on_batch = on_batch  # requests in every batch run, for metrics
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._carry: _Pending | None = None
        self._thread = threading.Thread(target=self._loop, name="prefill-batcher", daemon=True)
        self._thread.start()

    def submit(self, job: PrefillJob, cancelled: threading.Event) -> tuple[Selection, float]:
        """Run ``job`` in the next batch; returns its selection and the seconds it waited in the queue.

        Raises ValueError for the job's bad input, ``CancelledError`` when cancelled before it finished."""
        pending = _Pending(job, cancelled)
        self._queue.put(pending)
        return pending.future.result()

    def close(self) -> None:
        self._queue.put(None)
        join_device_thread(self._thread, "prefill batcher")  # its batch ends first (stepwise.py says why)

    def _take_batch(self) -> list[_Pending] | None:
        first = self._carry or self._queue.get()
        self._carry = None
        if first is None:
            return None
        batch, tokens = [first], first.job.num_context_tokens
        deadline = time.perf_counter() + self.config.wait_s
        while len(batch) < self.config.max_requests:
            try:
                nxt = self._queue.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                break
            if nxt is None:
                self._queue.put(None)  # close after this batch
                break
            if tokens + nxt.job.num_context_tokens > self.config.max_tokens:
                self._carry = nxt  # first of the next batch: arrival order is kept
                break
            batch.append(nxt)
            tokens += nxt.job.num_context_tokens
        return batch

    def _loop(self) -> None:
        while (batch := self._take_batch()) is not None:
            live = []
            for p in batch:
                if p.cancelled.is_set():
                    p.future.cancel()
                elif p.future.set_running_or_notify_cancel():
                    live.append(p)
            if not live:
                continue
            started = time.perf_counter()
            try:
                # Each job carries its caller's cancellation: the worker stops work nobody waits for.
                results = self._prefill_many([replace(p.job, cancelled=p.cancelled) for p in live])
            except Exception as exc:  # a device failure fails the whole batch, never hangs callers
                for p in live:
                    p.future.set_exception(exc)
                continue
            if self._on_batch is not None:
                self._on_batch(len(live))
            for p, res in zip(live, results):
                if isinstance(res, Exception):  # its bad input, or its caller cancelled it
                    p.future.set_exception(res)
                else:
                    p.future.set_result((res, started - p.arrived))
