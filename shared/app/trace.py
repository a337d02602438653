"""The response an in-process run gives, as the ``pdllm.v1.GenerateResponse`` a server would send for it.

``generate`` and ``eval --traces`` print it through ``shared/rpc/trace_format.py``, so their traces have
the field names, types and meaning of the gRPC trace (``router/trace.py`` builds that one): per-chunk
scores, the selection, kept tokens, cache hits, phase timings, the decode policy's counters.
"""

from __future__ import annotations

from typing import Any

from pdllm.decode_service.server import policy_trace
from pdllm.prefill_service.worker import Selection
from pdllm.protos.pdllm.v1 import generation_pb2 as pb
from pdllm.shared.generation.sampler import GenerationResult

_PHASES = set(pb.PhaseTimings.DESCRIPTOR.fields_by_name)


def phase_timings(seconds: dict[str, float], decode_s: float, total_s: float) -> pb.PhaseTimings:
    """The engine's phase timings (``prefill``, ``score``, ...) under the proto's names (``prefill_s``);
    phases the proto does not name are left out."""
    timings = pb.PhaseTimings(decode_s=decode_s, total_s=total_s)
    for name, value in seconds.items():
        if f"{name}_s" in _PHASES and name != "decode":
            setattr(timings, f"{name}_s", value)
    return timings


def response(
    method: str,
    model: str,
    text: str,
    result: GenerationResult,
    prompt_tokens: int,
    context_tokens: int,
    eos_token_id: int | None,
    total_s: float,
    sel: Selection | None = None,
) -> pb.GenerateResponse:
    """``sel``: the prefill phase's selection of a pdllm run (None: vanilla)."""
    eos = eos_token_id is not None and eos_token_id in result.raw_tokens
    trace = pb.Trace(
        method=method,
        prompt_tokens=prompt_tokens,
        context_tokens=context_tokens,
        steps=result.steps,
        kv_source="built",
        decode_policy=policy_trace(result.cache),
        timings=phase_timings(result.timings, result.decode_seconds, total_s),
    )
    if sel is not None:
        _selection(trace, sel)
    return pb.GenerateResponse(
        model=model,
        text=text,
        token_ids=result.token_ids,
        finish_reason="eos" if eos else "length",
        trace=trace,
    )


def _selection(trace: pb.Trace, sel: Selection) -> None:
    """The prefill's chunk scores and selection, and the decode KV's kept tokens, as the router reports
    them (``router/trace.py``)."""
    t, cfg, chunks = sel.trace, sel.config, sel.request.chunks
    trace.kv_mode, trace.score_mode = cfg.kv_mode, cfg.score_mode
    trace.num_chunks = len(sel.scores)
    trace.selected_chunk_ids.extend(sel.selected)
    built: list[Any] = list(t.kept_tokens) if isinstance(t.kept_tokens, list) else []
    if len(built) == len(sel.selected):  # what the decode KV build kept of each selected chunk
        kept = dict(zip(sel.selected, built))
    else:
        kept = {i: min(cfg.top_b, len(chunks[i])) if cfg.top_b else len(chunks[i]) for i in sel.selected}
    for s in sel.scores:
        trace.chunk_scores.add(
            chunk_id=s.chunk,
            self_information=s.s_i,
            pseudo_label=s.s_p or 0.0,
            total=s.total,
            selected=s.chunk in kept,
            num_tokens=len(chunks[s.chunk]),
            kept_tokens=int(kept.get(s.chunk, 0)),
        )
    trace.selected_kept_tokens.extend(int(kept[i]) for i in sel.selected)
    trace.kept_tokens = sum(trace.selected_kept_tokens)
    trace.peak_memory_bytes, trace.memory_kind = int(t.peak_memory_bytes), t.memory_kind
    trace.cache_hits, trace.cache_misses = t.cache_hits, t.cache_misses
    trace.prefill_skipped = t.cache_hits > 0 and t.cache_misses == 0


def generate_traced(
    engine: Any,
    ids: Any,
    gen: Any,
    decode_policy: Any = None,
    progress: bool = False,
) -> tuple[GenerationResult, Selection]:
    """``PrefillingEngine.generate`` for the encoded prompt ``ids``, returning the prefill's
    :class:`Selection` (chunk sizes and settings the trace reports) instead of its trace alone."""
    from pdllm.decode_service import sdar_decode

    if engine.block_diffusion:  # refused before the prefill, not after it
        sdar_decode.check_decode_options(decode_policy, None)
    sel = engine.prefill(ids.context, ids.query, gen, ids.instruction or None)
    return engine.decode(sel, gen, progress=progress, decode_policy=decode_policy), sel
