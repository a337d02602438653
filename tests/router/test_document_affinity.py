"""Prefill routing: a returning document goes back to the worker that holds its chunks, unless that worker is
down, excluded after a failed try, or busier than the least loaded one by more than the slack; new documents
go to the least loaded worker.

Planted: ``choose`` ignoring ``doc`` (least load only) -> the returning-document tests fail; the slack
ignored (the owner always wins) -> the overloaded-owner test fails."""

from __future__ import annotations

from pdllm.router.routing import LoadTracker, document_key

A, B, C = "10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"
DOC = document_key([5, 6, 7, 8])


HELD: list = []  # entered ``outstanding`` contexts (a collected one would release its load)


def _busy(tracker: LoadTracker, address: str, tokens: int) -> None:
    """Hold ``tokens`` outstanding on ``address`` for the rest of the test session."""
    hold = tracker.outstanding(address, tokens)
    hold.__enter__()
    HELD.append(hold)


def test_new_documents_go_to_the_least_loaded_worker_and_ties_break_by_address() -> None:
    t = LoadTracker()
    assert t.choose([B, A, C], DOC, tokens=100) == A
    _busy(t, A, 500)
    assert t.choose([A, B, C], DOC, tokens=100) == B


def test_a_returning_document_goes_to_its_owner_even_when_others_are_idle() -> None:
    t = LoadTracker()
    t.remember(DOC, C)
    _busy(t, C, 300)  # within the slack (4 x 100 tokens)
    assert t.choose([A, B, C], DOC, tokens=100) == C
    other = document_key([5, 6, 7, 9])  # one token changed: another document
    assert t.choose([A, B, C], other, tokens=100) == A


def test_an_owner_far_busier_than_the_least_loaded_worker_loses_the_request() -> None:
    t = LoadTracker()
    t.remember(DOC, C)
    _busy(t, C, 450)
    _busy(t, A, 40)
    assert t.choose([A, B, C], DOC, tokens=100) == B  # 450 - 0 > 4 x 100
    assert t.choose([A, B, C], DOC, tokens=200) == C  # a larger request is worth the wait


def test_an_unhealthy_or_excluded_owner_falls_back_to_load_and_the_table_is_bounded() -> None:
    t = LoadTracker(affinity_capacity=2)
    t.remember(DOC, C)
    assert t.choose([A, B], DOC, tokens=100) == A  # C is not healthy
    assert t.choose([A, B, C], DOC, exclude={C}, tokens=100) == A  # C failed this request's first try
    t.remember(document_key([1]), A)
    t.remember(document_key([2]), B)  # the oldest entry (DOC) is dropped
    _busy(t, A, 10)
    assert t.choose([A, B, C], DOC, tokens=100) == B
