"""Handoff through in-process prefill and decode servers (Gloo on loopback): the decode worker uses pulled
KV when it arrives, rebuilds it when the pull fails (same tokens, pages freed), and refuses KV made by
another model or dtype."""

from __future__ import annotations

import grpc
import pytest

from pdllm.decode_service import server as server_module
from pdllm.decode_service.kv_pool import DecodeKVPool
from pdllm.protos.pdllm.v1 import generation_pb2 as pb
from pdllm.protos.pdllm.v1 import workers_pb2 as wpb
from pdllm.protos.pdllm.v1 import workers_pb2_grpc
from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.app.serve import build_parser, start_decode, start_prefill
from pdllm.shared.config import EngineConfig
from pdllm.shared.rpc.server import ServerConfig
from tests.engine.helpers import model, tokens

ARGS = ["--kv-transfer-backend", "gloo", "--kv-transfer-timeout", "5", "--kv-pool-bytes", str(8 << 20)]


@pytest.fixture(scope="module")
def servers():
    m = model("dream")
    args = build_parser().parse_args(ARGS)
    engine = PrefillingEngine(m, None, EngineConfig(), reuse_chunks=False)
    prefill, close_prefill = start_prefill(
        args, ServerConfig(role="prefill"), engine.prefill_worker, decode_worker=engine.decode_worker
    )
    decode, scheduler, close_decode = start_decode(args, ServerConfig(role="decode"), engine.decode_worker)
    yield prefill, decode, scheduler
    close_decode()
    close_prefill()
    prefill.stop()
    decode.stop()


def _prefill_request(kv_mode: str, offer: bool, top_b: int = 0) -> wpb.PrefillRequest:
    req = wpb.PrefillRequest(
        request_id="r1",
        instruction_ids=tokens(3, 9),
        context_ids=tokens(60, 1),
        question_ids=tokens(5, 2),
        offer_handoff=offer,
    )
    req.method.chunk_size, req.method.top_k, req.method.kv_mode = 12, 2, kv_mode
    if top_b:
        req.method.top_b = top_b
    req.generation.gen_length, req.generation.steps = 6, 6
    return req


def _decode(
    decode, prefill_address: str, pre: wpb.PrefillResponse, req: wpb.PrefillRequest, policy: str = ""
) -> wpb.DecodeResult:
    dreq = wpb.DecodeRequest(
        request_id="r1",
        instruction_ids=req.instruction_ids,
        question_ids=req.question_ids,
        generation=req.generation,
        method=req.method,
        decode_policy=pb.DecodePolicyParams(decode_policy=policy),
    )
    dreq.kv_spec.CopyFrom(pre.kv_spec)
    dreq.chunks.extend(pre.selected)
    if pre.HasField("handoff"):
        dreq.handoff.CopyFrom(pre.handoff)
        dreq.handoff.sender = dreq.handoff.sender or prefill_address
    stub = workers_pb2_grpc.DecodeStub(grpc.insecure_channel(decode.address))
    (event,) = list(stub.Decode(dreq, timeout=60))
    return event.final


def _run(servers, kv_mode: str, offer: bool, top_b: int = 0, edit=None, policy: str = "") -> wpb.DecodeResult:  # type: ignore[no-untyped-def]
    prefill, decode, _ = servers
    req = _prefill_request(kv_mode, offer, top_b)
    pre = workers_pb2_grpc.PrefillStub(grpc.insecure_channel(prefill.address)).Prefill(req, timeout=60)
    assert pre.HasField("handoff") == offer
    if edit is not None:
        edit(pre)
    return _decode(decode, prefill.address, pre, req, policy)


@pytest.mark.parametrize(
    ("kv_mode", "top_b"), [("full-mask", 0), ("full-mask", 5), ("chunk-query", 0), ("chunk-only", 4)]
)
def test_pulled_kv_answers_like_the_decode_workers_own_build(servers, kv_mode: str, top_b: int) -> None:
    built = _run(servers, kv_mode, offer=False, top_b=top_b)
    pulled = _run(servers, kv_mode, offer=True, top_b=top_b)
    assert (built.kv_source, pulled.kv_source) == ("built", "handoff")
    assert list(pulled.token_ids) == list(built.token_ids)
    assert pulled.handoff_s > 0


def test_pulled_decode_kv_lands_in_its_pages_with_no_pool_write(servers, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    pulls, writes = [], []
    real_pull, real_write = server_module.start_pull, DecodeKVPool.write
    monkeypatch.setattr(server_module, "start_pull", lambda *a: pulls.append(real_pull(*a)) or pulls[-1])
    monkeypatch.setattr(DecodeKVPool, "write", lambda self, *a: writes.append(a) or real_write(self, *a))
    built = _run(servers, "full-mask", offer=False, top_b=5)
    assert len(writes) == 1  # the decode worker's own build is copied into its pages
    pulled = _run(servers, "full-mask", offer=True, top_b=5)
    assert len(writes) == 1 and pulled.kv_source == "handoff"  # the pulled one is already there
    (transfer,) = pulls
    assert transfer.landed and transfer.kv is None and transfer.staged_bytes == 0
    assert list(pulled.token_ids) == list(built.token_ids)


@pytest.mark.parametrize(("kv_mode", "top_b"), [("full-mask", 5), ("chunk-only", 4)])
def test_a_decode_policy_reads_pulled_kv_like_its_own_build(servers, kv_mode: str, top_b: int) -> None:
    """A dual-cache session in the rounds over a decode KV that landed in its pages
    (full-mask) or a pulled chunk KV (chunk-only) answers as over the decode worker's own build."""
    _, _, scheduler = servers
    built = _run(servers, kv_mode, offer=False, top_b=top_b, policy="dual-cache")
    pulled = _run(servers, kv_mode, offer=True, top_b=top_b, policy="dual-cache")
    assert (built.kv_source, pulled.kv_source) == ("built", "handoff")
    assert built.decode_policy.policy == pulled.decode_policy.policy == "dual-cache"
    assert list(pulled.token_ids) == list(built.token_ids)
    assert scheduler.pool.num_free == scheduler.pool.num_pages  # its pages went back


def test_failed_pull_rebuilds_with_the_same_tokens_and_frees_pages(servers) -> None:
    _, _, scheduler = servers
    built = _run(servers, "full-mask", offer=False)

    def dead_sender(pre: wpb.PrefillResponse) -> None:
        pre.handoff.sender = "127.0.0.1:1"  # nothing listens there

    def expired(pre: wpb.PrefillResponse) -> None:
        pre.handoff.transfer_id = "no-such-offer"

    for edit in (dead_sender, expired):
        result = _run(servers, "full-mask", offer=True, edit=edit)
        assert result.kv_source == "handoff-failed-rebuilt"
        assert list(result.token_ids) == list(built.token_ids)
    assert scheduler.pool.num_free == scheduler.pool.num_pages


@pytest.mark.parametrize(
    ("field", "value"),
    [("model_id", "another-model"), ("dtype", "float16"), ("chunk_size", 64), ("num_layers", 99)],
)
def test_kv_from_another_model_or_layout_is_refused(servers, field: str, value) -> None:  # type: ignore[no-untyped-def]
    def mismatch(pre: wpb.PrefillResponse) -> None:
        setattr(pre.handoff.kv_spec, field, value)

    with pytest.raises(grpc.RpcError) as err:
        _run(servers, "full-mask", offer=True, edit=mismatch)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert field in err.value.details()


def test_a_handoff_that_does_not_fit_the_kv_mode_is_refused(servers) -> None:
    def as_chunk_kv(pre: wpb.PrefillResponse) -> None:
        pre.handoff.payload = "chunk-kv"

    with pytest.raises(grpc.RpcError) as err:
        _run(servers, "full-mask", offer=True, edit=as_chunk_kv)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
