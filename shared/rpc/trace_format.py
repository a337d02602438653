"""One trace format for every command that prints one (``generate``, ``ask``, ``eval --traces``).

JSON: the ``pdllm.v1`` messages with their proto field names, every field present (chunk 0's ``chunk_id``
and other zero values included), 64-bit integers as JSON numbers (proto3's JSON mapping writes them as
strings). Text: :func:`summary`, which also says which way the chunk scores point.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from pdllm.protos.pdllm.v1 import generation_pb2 as pb

SCORE_DIRECTION = "by lowest total score (lower = more relevant)"

_INT64 = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}


def message_json(message: Message) -> dict[str, Any]:
    """``message`` as a JSON-ready dict: proto field names in declaration order, every field, integers as
    numbers."""
    out = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _ordered(out, message.DESCRIPTOR)


def _ordered(obj: dict[str, Any], descriptor: Descriptor) -> dict[str, Any]:
    """``obj``'s fields in declaration order, the 64-bit integers proto3 JSON wrote as strings as ints."""
    out: dict[str, Any] = {}
    for field in descriptor.fields:
        kind = field.message_type
        if field.name not in obj:
            if kind is None or field.is_repeated or field.containing_oneof is not None:
                continue
            # An unset message field (proto3 JSON leaves it out): its fields' defaults, like any other.
            obj[field.name] = message_json(message_factory.GetMessageClass(kind)())
        value = obj[field.name]
        if kind is not None and kind.GetOptions().map_entry:
            entry = kind.fields_by_name["value"]
            if entry.type in _INT64:
                value = {k: int(v) for k, v in value.items()}
            elif entry.message_type is not None:
                value = {k: _ordered(v, entry.message_type) for k, v in value.items()}
        elif kind is not None:
            value = [_ordered(v, kind) for v in value] if field.is_repeated else _ordered(value, kind)
        elif field.type in _INT64:
            value = [int(v) for v in value] if field.is_repeated else int(value)
        out[field.name] = value
    return out


def summary(trace: pb.Trace, extra_timings: dict[str, float] | None = None) -> str:
    """The trace in a few lines of text (what ``ask`` and ``generate`` print to stderr)."""
    lines = [
        f"trace: method {trace.method or '?'}; prompt tokens {trace.prompt_tokens}; steps {trace.steps}; "
        f"decode policy {trace.decode_policy.policy or 'none'}"
    ]
    if trace.num_chunks:
        lines.append(
            f"  chunks {trace.num_chunks}, selected {list(trace.selected_chunk_ids)} {SCORE_DIRECTION}; "
            f"kept context tokens {trace.kept_tokens}"
        )
        ranked = sorted(trace.chunk_scores, key=lambda s: s.total)
        shown = [f"chunk {s.chunk_id} {s.total:.3f}" for s in ranked[: len(trace.selected_chunk_ids)]]
        rest = ranked[len(trace.selected_chunk_ids) :]
        best_unselected = f"; next: chunk {rest[0].chunk_id} {rest[0].total:.3f}" if rest else ""
        lines.append(f"  lowest totals: {', '.join(shown)}{best_unselected}")
        lines.append(f"  cache hits {trace.cache_hits}, misses {trace.cache_misses}")
    timings = {**(extra_timings or {}), **message_json(trace.timings)}
    lines.append("  timings " + ", ".join(f"{k} {v:.3f}" for k, v in timings.items() if v))
    return "\n".join(lines)
