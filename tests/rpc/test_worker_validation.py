"""Internal Prefill/Decode request validation: good requests resolve, each bad one gets its kind/code."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from pdllm.protos.pdllm.v1 import generation_pb2 as pb
from pdllm.protos.pdllm.v1 import workers_pb2 as wpb
from pdllm.shared.rpc.errors import InvalidRequestError, PdllmError
from pdllm.shared.rpc.worker_validation import WorkerLimits, resolve_decode_request, resolve_prefill_request

LIMITS = WorkerLimits(vocab_size=100, max_prompt_tokens=64)
SPEC = wpb.KvSpec(
    model_id="m@1", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=8, position_scheme="c"
)


def _prefill() -> wpb.PrefillRequest:
    return wpb.PrefillRequest(
        request_id="r1",
        context_ids=list(range(1, 21)),
        question_ids=[5, 6, 7],
        method=pb.MethodParams(chunk_size=16, top_k=1),
        generation=pb.GenerationParams(gen_length=8, steps=8),
    )


def _decode() -> wpb.DecodeRequest:
    handle = wpb.ChunkHandle(
        key="k", chunk_id=0, token_ids=[1, 2, 3, 4], positions=[0, 1, 2, 3], kept_indices=[0, 2]
    )
    return wpb.DecodeRequest(
        request_id="r1",
        kv_spec=SPEC,
        chunks=[handle],
        question_ids=[5, 6],
        generation=pb.GenerationParams(gen_length=8, steps=4, block_length=4),
        stream_partials=True,
    )


def test_good_requests_resolve() -> None:
    pre = resolve_prefill_request(_prefill(), LIMITS)
    assert pre.context_ids == list(range(1, 21)) and pre.method.chunk_size == 16 and pre.generation.steps == 8
    dec = resolve_decode_request(_decode(), LIMITS, SPEC)
    assert dec.generation.block_length == 4 and dec.stream_partials and dec.chunks[0].key == "k"


def _edit(path: str, value: object) -> Callable[[object], None]:
    def edit(req: object) -> None:
        *parents, leaf = path.split(".")
        for name in parents:
            req = getattr(req, name)
        field = getattr(req, leaf)
        if isinstance(value, list):
            del field[:]
            field.extend(value)
        else:
            setattr(req, leaf, value)

    return edit


PREFILL_CASES = [
    ("empty_context_ids", _edit("context_ids", [])),
    ("empty_question_ids", _edit("question_ids", [])),
    ("token_id_range", _edit("context_ids", [1, 100])),
    ("token_id_range", _edit("instruction_ids", [-1])),
    ("prompt_too_long", _edit("context_ids", [1] * 62)),
    ("request_id_chars", _edit("request_id", "a b")),
    ("chunk_size_range", _edit("method.chunk_size", 1)),
    ("block_not_divisor", _edit("generation.block_length", 3)),
]


@pytest.mark.parametrize(("kind", "edit"), PREFILL_CASES)
def test_bad_prefill_requests(kind: str, edit) -> None:
    req = _prefill()
    edit(req)
    with pytest.raises(InvalidRequestError) as info:
        resolve_prefill_request(req, LIMITS)
    assert info.value.kind == kind


DECODE_CASES = [
    ("empty_chunks", lambda r: r.ClearField("chunks")),
    ("empty_chunk", lambda r: r.chunks[0].ClearField("token_ids")),
    ("handle_positions", _edit("chunks", [wpb.ChunkHandle(token_ids=[1, 2], positions=[0])])),
    ("handle_positions", _edit("chunks", [wpb.ChunkHandle(token_ids=[1, 2], positions=[0, -1])])),
    (
        "handle_kept_indices",
        _edit("chunks", [wpb.ChunkHandle(token_ids=[1, 2], positions=[0, 1], kept_indices=[1, 1])]),
    ),
    (
        "handle_kept_indices",
        _edit("chunks", [wpb.ChunkHandle(token_ids=[1, 2], positions=[0, 1], kept_indices=[2])]),
    ),
    ("token_id_range", _edit("question_ids", [100])),
    ("empty_question_ids", _edit("question_ids", [])),
    ("unknown_kv_mode", _edit("method.kv_mode", "x")),
]


@pytest.mark.parametrize(("kind", "edit"), DECODE_CASES)
def test_bad_decode_requests(kind: str, edit) -> None:
    req = _decode()
    edit(req)
    with pytest.raises(InvalidRequestError) as info:
        resolve_decode_request(req, LIMITS, SPEC)
    assert info.value.kind == kind


def test_vanilla_decode_takes_context_ids_instead_of_chunks() -> None:
    req = _decode()
    req.ClearField("chunks")
    req.method.method = "vanilla"
    with pytest.raises(InvalidRequestError) as info:
        resolve_decode_request(req, LIMITS, SPEC)
    assert info.value.kind == "empty_context_ids"
    req.context_ids.extend([9, 8, 7])
    resolved = resolve_decode_request(req, LIMITS, SPEC)
    assert resolved.chunks == [] and resolved.context_ids == [9, 8, 7]


def test_handles_from_another_model_are_failed_precondition() -> None:
    req = _decode()
    req.kv_spec.dtype = "float32"
    with pytest.raises(PdllmError) as info:
        resolve_decode_request(req, LIMITS, SPEC)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "dtype='float32'" in info.value.message and "dtype='bfloat16'" in info.value.message
