"""Cross-request batching: ``PrefillWorker.prefill_many`` equals ``prefill`` on each request alone."""

from __future__ import annotations

import pytest

from pdllm.prefill_service.worker import PrefillWorker
from pdllm.shared.chunk_store import chunk_keys, default_chunk_store
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.sampler import GenerationConfig
from tests.engine.helpers import model, tokens

GEN = GenerationConfig(gen_length=6, steps=3)


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_batched_selection_equals_one_at_a_time(family: str) -> None:
    m = model(family)
    doc = tokens(50, 1)
    repeated = tokens(10, 9) * 4  # identical chunks inside one request: forwarded once, copied per row
    cases = [
        (doc, tokens(5, 2), EngineConfig(chunk_size=12, top_k=2)),
        (doc, tokens(4, 3), EngineConfig(chunk_size=12, top_k=3)),  # same document, another question
        (tokens(33, 4), tokens(6, 5), EngineConfig(chunk_size=8, top_k=2)),  # another chunk size
        (repeated, tokens(5, 6), EngineConfig(chunk_size=10, top_k=2, score_mode="self-info")),
    ]
    batched_worker = PrefillWorker(m, None, EngineConfig())
    jobs = [batched_worker.job(c, q, GEN, config=cfg) for c, q, cfg in cases]
    batched = batched_worker.prefill_many(jobs)
    for (c, q, cfg), got in zip(cases, batched):
        alone = PrefillWorker(m, None, cfg).prefill(c, q, GEN)
        assert not isinstance(got, ValueError)
        assert got.selected == alone.selected
        assert got.keys == alone.keys
        dtype = next(m.parameters()).dtype  # the keys are those of the request's own chunks, in order
        assert got.keys == chunk_keys(m.config.model_id, dtype, cfg.chunk_size, "causal", got.request.chunks)
        for a, b in zip(got.scores, alone.scores):
            assert a.chunk == b.chunk
            assert a.total == pytest.approx(b.total, abs=1e-5)
        assert got.trace.num_chunks == alone.trace.num_chunks


def test_batch_shares_the_store_and_counts_hits_per_request() -> None:
    m = model("dream")
    cfg = EngineConfig(chunk_size=12, top_k=2)
    worker = PrefillWorker(m, None, cfg, store=default_chunk_store(), kv_write_policy="all")
    doc = tokens(48, 1)
    first = worker.prefill_many([worker.job(doc, tokens(5, 2), GEN)])[0]
    assert (first.trace.cache_hits, first.trace.cache_misses) == (0, 4)
    warm, cold = worker.prefill_many(
        [worker.job(doc, tokens(5, 3), GEN), worker.job(tokens(24, 7), tokens(5, 3), GEN)]
    )
    assert (warm.trace.cache_hits, warm.trace.cache_misses, warm.trace.prefill_skipped) == (4, 0, True)
    assert (cold.trace.cache_hits, cold.trace.cache_misses) == (0, 2)


def test_bad_request_is_rejected_before_batching() -> None:
    worker = PrefillWorker(model("dream"), None, EngineConfig(chunk_size=12))
    with pytest.raises(ValueError, match="question is empty"):
        worker.job(tokens(20, 1), [], GEN)


def test_cancelled_jobs_stop_between_forwards_and_are_not_scored(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses
    import threading

    import pdllm.shared.chunk_prefill as chunk_prefill
    from pdllm.prefill_service.worker import PrefillCancelled
    from pdllm.shared.stepwise import drain

    forwards: list[int] = []
    real = chunk_prefill._forward_group
    monkeypatch.setattr(
        chunk_prefill, "_forward_group", lambda *a, **k: (forwards.append(len(a[2])), real(*a, **k))[1]
    )
    m = model("dream")
    worker = PrefillWorker(m, None, EngineConfig(chunk_size=8, top_k=2, prefill_batch=1))
    gone, staying = threading.Event(), threading.Event()

    def job(seed: int, event: threading.Event):  # type: ignore[no-untyped-def]
        return dataclasses.replace(worker.job(tokens(40, seed), tokens(5, seed), GEN), cancelled=event)

    # Both callers leave after the first forward: the group stops, nothing more runs.
    steps = worker.prefill_many_steps([job(1, gone), job(2, gone)])
    next(steps)
    gone.set()
    results = drain(steps)
    assert all(isinstance(r, PrefillCancelled) for r in results)
    assert len(forwards) == 1  # of 10 (two documents of five 8-token chunks, one chunk per forward)

    # One caller leaves: the shared forwards go on for the other, the leaver is not scored.
    forwards.clear()
    leaver = threading.Event()
    steps = worker.prefill_many_steps([job(3, leaver), job(4, staying)])
    next(steps)
    leaver.set()
    left, stayed = drain(steps)
    assert isinstance(left, PrefillCancelled) and not isinstance(stayed, Exception)
    assert (
        stayed.selected
        == PrefillWorker(m, None, worker.config).prefill(tokens(40, 4), tokens(5, 4), GEN).selected
    )


def test_a_job_cancelled_during_scoring_stops_before_its_next_scoring_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import dataclasses
    import threading

    import pdllm.prefill_service.scoring as scoring
    from pdllm.prefill_service.worker import PrefillCancelled

    groups: list[int] = []
    real = scoring._score_group
    monkeypatch.setattr(
        scoring, "_score_group", lambda *a, **k: (groups.append(a[4].stop - a[4].start), real(*a, **k))[1]
    )
    worker = PrefillWorker(model("dream"), None, EngineConfig(chunk_size=8, top_k=2, prefill_batch=1))
    gone = threading.Event()
    job = dataclasses.replace(worker.job(tokens(40, 1), tokens(5, 1), GEN), cancelled=gone)
    steps = worker.prefill_many_steps([job])
    while not groups:  # prefill (five forwards), then the first scoring group
        next(steps)
    gone.set()
    with pytest.raises(StopIteration) as done:
        next(steps)
    assert isinstance(done.value.value[0], PrefillCancelled)
    assert groups == [1]  # of five one-chunk groups


def test_long_chunks_are_scored_fewer_at_a_time_with_the_same_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    import pdllm.prefill_service.scoring as scoring

    m, cfg = model("dream"), EngineConfig(chunk_size=8, top_k=2, prefill_batch=4)
    whole = PrefillWorker(m, None, cfg).prefill(tokens(40, 1), tokens(5, 1), GEN)
    groups: list[int] = []
    real = scoring._score_group
    monkeypatch.setattr(
        scoring, "_score_group", lambda *a, **k: (groups.append(a[4].stop - a[4].start), real(*a, **k))[1]
    )
    monkeypatch.setattr(scoring, "SCORE_GROUP_TOKENS", 16)  # two 8-token chunks a group, not four
    split = PrefillWorker(m, None, cfg).prefill(tokens(40, 1), tokens(5, 1), GEN)
    assert groups == [2, 2, 1]
    assert split.selected == whole.selected
    for a, b in zip(split.scores, whole.scores):
        assert a.total == pytest.approx(b.total, abs=1e-5)
