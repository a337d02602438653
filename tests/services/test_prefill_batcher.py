"""The prefill worker's cross-request batcher: real threads, a recording stand-in for the device."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError, ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from pdllm.prefill_service.batching import BatchingConfig, PrefillBatcher


@dataclass(frozen=True)
class Job:
    name: str
    num_context_tokens: int = 100
    cancelled: threading.Event | None = None  # the batcher hands each job its caller's cancellation


class Device:
    """Records each batch; the first batch blocks until released so later arrivals pile up."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.release = threading.Event()
        self.started = threading.Event()

    def __call__(self, jobs):
        self.started.set()
        self.release.wait(5)
        self.batches.append([j.name for j in jobs])
        return [ValueError(f"bad {j.name}") if j.name.startswith("bad") else f"sel-{j.name}" for j in jobs]


def submit_all(batcher, device, jobs, events=None):
    """The first job alone (it holds the device), then the rest queue up behind it in order."""
    events = events or [threading.Event() for _ in jobs]
    pool = ThreadPoolExecutor(len(jobs))
    futures = [pool.submit(batcher.submit, jobs[0], events[0])]
    assert device.started.wait(5)
    for n, (job, ev) in enumerate(zip(jobs[1:], events[1:]), start=1):
        futures.append(pool.submit(batcher.submit, job, ev))
        deadline = time.monotonic() + 5
        while batcher._queue.qsize() < n and time.monotonic() < deadline:  # queued before the next one
            time.sleep(0.001)
    return pool, futures


def test_waiting_requests_share_one_batch_in_arrival_order() -> None:
    device = Device()
    batcher = PrefillBatcher(device, BatchingConfig(max_requests=3, wait_s=0.0))
    pool, futures = submit_all(batcher, device, [Job(f"r{i}") for i in range(6)])
    time.sleep(0.1)
    device.release.set()
    results = [f.result(5) for f in futures]
    assert [r[0] for r in results] == [f"sel-r{i}" for i in range(6)]
    assert device.batches == [["r0"], ["r1", "r2", "r3"], ["r4", "r5"]]
    assert all(queue_s >= 0 for _, queue_s in results)
    batcher.close()
    pool.shutdown()


def test_token_budget_splits_batches_without_reordering() -> None:
    device = Device()
    batcher = PrefillBatcher(device, BatchingConfig(max_requests=8, max_tokens=250, wait_s=0.0))
    jobs = [Job("a"), Job("b", 100), Job("c", 100), Job("d", 100)]
    pool, futures = submit_all(batcher, device, jobs)
    time.sleep(0.1)
    device.release.set()
    [f.result(5) for f in futures]
    assert device.batches == [["a"], ["b", "c"], ["d"]]
    batcher.close()
    pool.shutdown()


def test_cancelled_while_queued_never_runs_and_bad_input_fails_alone() -> None:
    device = Device()
    batcher = PrefillBatcher(device, BatchingConfig(max_requests=4, wait_s=0.0))
    events = [threading.Event() for _ in range(4)]
    pool, futures = submit_all(batcher, device, [Job("r0"), Job("gone"), Job("bad1"), Job("r3")], events)
    events[1].set()  # the client went away while r0 held the device
    time.sleep(0.1)
    device.release.set()
    assert futures[0].result(5)[0] == "sel-r0"
    with pytest.raises(CancelledError):
        futures[1].result(5)
    with pytest.raises(ValueError, match="bad bad1"):
        futures[2].result(5)
    assert futures[3].result(5)[0] == "sel-r3"
    assert device.batches == [["r0"], ["bad1", "r3"]]
    batcher.close()
    pool.shutdown()


def test_device_failure_fails_the_batch_and_the_worker_keeps_serving() -> None:
    calls = []

    def flaky(jobs):
        calls.append(len(jobs))
        if len(calls) == 1:
            raise RuntimeError("CUDA error: out of memory")
        return [f"sel-{j.name}" for j in jobs]

    batcher = PrefillBatcher(flaky, BatchingConfig(wait_s=0.0))
    with pytest.raises(RuntimeError, match="out of memory"):
        batcher.submit(Job("x"), threading.Event())
    assert batcher.submit(Job("y"), threading.Event())[0] == "sel-y"
    batcher.close()


def test_bad_config_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="max_requests >= 1"):
        BatchingConfig(max_requests=0)


def test_each_job_reaches_the_device_with_its_callers_cancellation() -> None:
    seen: list[threading.Event | None] = []

    def device(jobs):  # type: ignore[no-untyped-def]
        seen.extend(j.cancelled for j in jobs)
        return [f"sel-{j.name}" for j in jobs]

    batcher = PrefillBatcher(device, BatchingConfig(max_requests=1, wait_s=0.0))
    event = threading.Event()
    assert batcher.submit(Job("r0"), event)[0] == "sel-r0"
    assert seen == [event]  # the worker can stop work whose caller left mid-batch
    batcher.close()
