"""Device work in pieces: generator functions that yield between forwards, so a caller can interleave them.

A ``Steps[T]`` generator does a bounded piece of device work per ``next()`` and returns its result ``T``
when exhausted. :func:`drain` runs one to the end (what a process with one role does); the all-in-one
decode scheduler instead advances the prefill worker's steps one piece per decode round.

A generator may also yield a piece of device work it leaves to its driver (:class:`DeviceWork`: a chunk
prefill forward, ``shared/chunk_prefill.py``), which the driver runs before the next ``next()``: alone
(:func:`drain`), or inside a forward of its own (the all-in-one decode scheduler carries it in a round).
A driver whose own forward failed throws the error into the generator instead.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Generator
from typing import Protocol, TypeVar

T = TypeVar("T")

_log = logging.getLogger("pdllm.stepwise")


class DeviceWork(Protocol):
    """Device work a generator hands to its driver."""

    def run(self) -> None: ...


Steps = Generator[DeviceWork | None, None, T]


def drain(steps: Steps[T]) -> T:
    """Run ``steps`` to the end, running the work it hands over; its return value."""
    while True:
        try:
            work = next(steps)
        except StopIteration as stop:
            return stop.value
        if work is not None:
            work.run()


def join_device_thread(thread: threading.Thread, what: str, report_every_s: float = 10.0) -> None:
    """Wait, however long it takes, for ``thread`` (which runs device work) to end; the caller has already
    told it to stop after its current piece.

    A piece cannot be interrupted (one vanilla step over a 32K prompt runs for minutes on a CPU), and the
    thread must not be left running: an interpreter that exits while a daemon thread is inside a torch op
    aborts the process ("terminate called without an active exception", exit -6: torch's intra-op thread
    pool is torn down under it) instead of exiting 0 after a drain. A thread that never ends is left to the
    supervisor's kill (Kubernetes: terminationGracePeriodSeconds); the log says what it waits for.
    """
    if thread is threading.current_thread():
        return
    waited = 0.0
    while True:
        thread.join(report_every_s)
        if not thread.is_alive():
            return
        waited += report_every_s
        _log.warning(
            f"waiting for the {what} to finish its current piece of device work", extra={"waited_s": waited}
        )
