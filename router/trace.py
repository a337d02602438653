"""The trace a client gets with its answer: the decode worker's result and the prefill worker's response
(chunk scores, selection, cache hits, timings, peak memory), merged by the router."""

from __future__ import annotations

from typing import Any

from pdllm.protos.pdllm.v1 import generation_pb2 as pb
from pdllm.protos.pdllm.v1 import workers_pb2 as wpb
from pdllm.shared.rpc.validation import ResolvedRequest


def request_trace(
    resolved: ResolvedRequest,
    ids: Any,
    prefill: wpb.PrefillResponse | None,
    result: wpb.DecodeResult,
    workers: tuple[str, str] = ("", ""),
) -> pb.Trace:
    """Everything but ``ttft_s`` / ``total_s``, which the router times itself. ``workers``: the prefill and
    decode worker addresses the router reached (empty: not named)."""
    trace = pb.Trace(
        method=resolved.method,
        kv_mode=resolved.kv_mode if prefill is not None else "",
        score_mode=resolved.score_mode if prefill is not None else "",
        prompt_tokens=len(ids.instruction) + len(ids.context) + len(ids.query),
        context_tokens=len(ids.context),
        steps=result.steps,
        prefill_worker=workers[0],
        decode_worker=workers[1],
        peak_memory_bytes=result.peak_memory_bytes,
        memory_kind=result.memory_kind,
        cache_hits=result.cache_hits,
        cache_misses=result.cache_misses,
        kv_source=result.kv_source,
        decode_policy=result.decode_policy,  # what the decode worker ran, named by it
    )
    timings = trace.timings
    timings.CopyFrom(result.timings)
    timings.handoff_s = result.handoff_s
    if prefill is not None:
        trace.num_chunks = len(prefill.chunk_scores)
        trace.selected_chunk_ids.extend(c.chunk_id for c in prefill.selected)
        trace.chunk_scores.extend(prefill.chunk_scores)
        trace.kept_tokens = sum(s.kept_tokens for s in prefill.chunk_scores)
        kept = {s.chunk_id: s.kept_tokens for s in prefill.chunk_scores}
        trace.selected_kept_tokens.extend(kept.get(c.chunk_id, 0) for c in prefill.selected)
        if prefill.peak_memory_bytes > trace.peak_memory_bytes:  # the phase that peaked names the kind
            trace.peak_memory_bytes, trace.memory_kind = prefill.peak_memory_bytes, prefill.memory_kind
        # One count per chunk: the prefill looked every chunk up; a chunk-only decode worker's second
        # lookup of the selected ones is not another chunk.
        trace.cache_hits, trace.cache_misses = prefill.cache_hits, prefill.cache_misses
        trace.prefill_skipped = prefill.cache_hits > 0 and prefill.cache_misses == 0
        for name in ("queue_s", "prefill_s", "score_s", "select_s"):
            setattr(timings, name, getattr(prefill.timings, name))
        timings.build_s += prefill.timings.build_s
    return trace
