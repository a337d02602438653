"""The router's trace assembly (router/trace.py) from a prefill response and a decode result."""

from __future__ import annotations

from types import SimpleNamespace

from pdllm.protos.pdllm.v1 import generation_pb2 as pb
from pdllm.protos.pdllm.v1 import workers_pb2 as wpb
from pdllm.router.trace import request_trace
from pdllm.shared.rpc.validation import resolve_generate_request

IDS = SimpleNamespace(instruction=[], context=list(range(40)), query=[1, 2])


def _chunk_only() -> tuple:  # type: ignore[type-arg]
    request = pb.GenerateRequest(context="c", question="q?")
    request.method.kv_mode = "chunk-only"
    prefill = wpb.PrefillResponse(cache_hits=3, cache_misses=2)
    for i in range(5):
        prefill.chunk_scores.add(chunk_id=i, selected=i in (1, 3), kept_tokens=8 if i in (1, 3) else 0)
    prefill.selected.add(chunk_id=3)
    prefill.selected.add(chunk_id=1)
    # The chunk-only decode worker looked the two selected chunks up again: the same chunks, not new ones.
    result = wpb.DecodeResult(cache_hits=2, cache_misses=0, steps=4, kv_source="built")
    return resolve_generate_request(request), prefill, result


def test_each_chunk_counts_once_and_selected_kept_tokens_follow_the_selection() -> None:
    resolved, prefill, result = _chunk_only()
    trace = request_trace(resolved, IDS, prefill, result)
    assert (trace.cache_hits, trace.cache_misses) == (3, 2)  # not 5 hits for 5 chunks
    assert not trace.prefill_skipped
    assert list(trace.selected_chunk_ids) == [3, 1] and list(trace.selected_kept_tokens) == [8, 8]
    assert trace.kept_tokens == 16 and trace.num_chunks == 5


def test_workers_are_named_by_the_addresses_the_router_gives() -> None:
    resolved, prefill, result = _chunk_only()
    named = request_trace(resolved, IDS, prefill, result, ("10.0.0.1:50061", "10.0.0.2:50062"))
    assert (named.prefill_worker, named.decode_worker) == ("10.0.0.1:50061", "10.0.0.2:50062")
    unnamed = request_trace(resolved, IDS, prefill, result)  # all-in-one: generation.proto says empty
    assert (unnamed.prefill_worker, unnamed.decode_worker) == ("", "")
