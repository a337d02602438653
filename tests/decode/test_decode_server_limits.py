"""The decode server refuses a vanilla prompt longer than its limit, with a message naming the flag."""

from __future__ import annotations

import grpc
import pytest

from pdllm.decode_service.server import DecodeServicer
from pdllm.decode_service.worker import DecodeWorker
from pdllm.protos.pdllm.v1 import workers_pb2 as wpb
from pdllm.shared.rpc.errors import PdllmError
from tests.engine.helpers import model


def _vanilla(n: int) -> wpb.DecodeRequest:
    request = wpb.DecodeRequest(request_id="r", context_ids=list(range(3, 3 + n)), question_ids=[5, 6])
    request.method.method = "vanilla"
    request.generation.gen_length = 4
    request.generation.steps = 4
    return request


def test_a_vanilla_prompt_over_the_limit_is_refused_before_any_work() -> None:
    servicer = DecodeServicer(DecodeWorker(model("dream")), scheduler=None, max_vanilla_tokens=40)  # type: ignore[arg-type]
    with pytest.raises(PdllmError) as err:
        next(servicer.Decode(_vanilla(39), context=None))  # type: ignore[arg-type]
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-vanilla-tokens" in err.value.message and "got 41" in err.value.message
