"""The decode server refuses bad token ids with INVALID_ARGUMENT naming the field, before any work (they
used to fail in the embedding lookup on the scheduler thread and reach the caller as INTERNAL)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from pdllm.decode_service.request_checks import check_token_ids
from pdllm.decode_service.server import DecodeServicer
from pdllm.decode_service.worker import DecodeWorker
from pdllm.protos.pdllm.v1 import workers_pb2 as wpb
from pdllm.shared.rpc.errors import PdllmError
from tests.engine.helpers import model

VOCAB = 97  # tests/model/helpers.py tiny_config


def _pdllm() -> wpb.DecodeRequest:
    request = wpb.DecodeRequest(request_id="r", question_ids=[5, 6], instruction_ids=[7])
    request.chunks.add(key="k", chunk_id=0, token_ids=[1, 8, 9])
    request.generation.gen_length = 4
    request.generation.steps = 4
    return request


def _vanilla() -> wpb.DecodeRequest:
    request = _pdllm()
    del request.chunks[:]
    request.context_ids.extend([8, 9, 10])
    request.method.method = "vanilla"
    return request


def _set(field: str, ids: list[int]) -> Callable[[wpb.DecodeRequest], None]:
    def edit(request: wpb.DecodeRequest) -> None:
        target = request.chunks[0].token_ids if field == "chunks[0].token_ids" else getattr(request, field)
        del target[:]
        target.extend(ids)

    return edit


CASES = [
    ("vanilla", "context_ids", _set("context_ids", [8, VOCAB]), f"token id {VOCAB} outside"),
    ("vanilla", "context_ids", _set("context_ids", [8, -3]), "token id -3 outside"),
    ("vanilla", "question_ids", _set("question_ids", [1 << 30]), "outside the vocabulary [0, 97)"),
    ("pdllm", "question_ids", _set("question_ids", [5, VOCAB + 1]), "token id 98"),
    ("pdllm", "instruction_ids", _set("instruction_ids", [-1]), "token id -1"),
    ("pdllm", "chunks[0].token_ids", _set("chunks[0].token_ids", [1, 2**31 - 1]), "chunks[0].token_ids"),
    ("pdllm", "chunks[0]", _set("chunks[0].token_ids", []), "chunks[0] has no token ids"),
]


@pytest.mark.parametrize(("method", "field", "edit", "message"), CASES)
def test_bad_token_ids_are_invalid_argument_before_any_work(
    method: str, field: str, edit: Callable[[wpb.DecodeRequest], None], message: str
) -> None:
    request = _vanilla() if method == "vanilla" else _pdllm()
    edit(request)
    # No scheduler: a request that got past the checks would fail on it with an AttributeError.
    servicer = DecodeServicer(DecodeWorker(model("dream")), scheduler=None)  # type: ignore[arg-type]
    with pytest.raises(PdllmError) as err:
        next(servicer.Decode(request, context=None))  # type: ignore[arg-type]
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.message and message in err.value.message


def test_good_ids_pass() -> None:
    check_token_ids(_pdllm(), VOCAB)
    check_token_ids(_vanilla(), VOCAB)
    edge = _vanilla()
    _set("context_ids", [0, VOCAB - 1])(edge)
    check_token_ids(edge, VOCAB)
