"""Trace timings: event-timed phases (the prefill worker's prefill and scoring on CUDA) are settled when
``timings`` is read, and a batch's shared prefill timing moves to each request's trace unsettled."""

from __future__ import annotations

import torch

from pdllm.prefill_service.trace import Trace


class FakeEvent:
    """Stands in for a CUDA event pair's end: ``elapsed_time`` in ms from a start it was paired with."""

    def __init__(self, ms: float) -> None:
        self.ms, self.waited = ms, False

    def synchronize(self) -> None:
        self.waited = True

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.ms - self.ms


def test_event_phases_settle_on_read_and_adopt_keeps_them_pending() -> None:
    batch = Trace()
    end = FakeEvent(250.0)
    batch._pending.append(("prefill", FakeEvent(0.0), end))
    request = Trace()
    request.adopt(batch, "prefill")
    assert not end.waited  # adopting does not wait for the prefill to finish
    request._pending.append(("score", FakeEvent(250.0), FakeEvent(310.0)))
    assert request.timings == {"prefill": 0.25, "score": 0.06}
    assert end.waited and not request._pending
    assert request.to_dict()["timings"] == {"prefill": 0.25, "score": 0.06}


def test_host_phases_accumulate_off_cuda() -> None:
    trace = Trace()
    for _ in range(2):
        with trace.phase("score", torch.device("cpu"), sync=False):  # no events off CUDA: host time
            pass
    assert set(trace.timings) == {"score"} and trace.timings["score"] >= 0.0
    other = Trace()
    other.adopt(trace, "score")
    assert other.timings == trace.timings
