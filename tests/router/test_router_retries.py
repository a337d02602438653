"""The router's retries and decode request against fake in-process workers (real gRPC on loopback): a busy
worker (RESOURCE_EXHAUSTED) is tried around without being reported failed, a dead one (UNAVAILABLE) is
reported, and unary Generate asks the decode worker for no partial outputs."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest

from pdllm.protos.pdllm.v1 import generation_pb2 as pb
from pdllm.protos.pdllm.v1 import generation_pb2_grpc, workers_pb2_grpc
from pdllm.protos.pdllm.v1 import workers_pb2 as wpb
from pdllm.router.server import Pools, RouterConfig, RouterServicer, _cancel_when_client_leaves
from pdllm.shared.rpc.client import PdllmClient
from pdllm.shared.rpc.errors import PdllmError
from pdllm.shared.rpc.server import RpcServer, ServerConfig, build_server, service_spec, termination_event
from tests.rpc.log_records import finished_codes

ANSWER = list(b"4821")
BUSY = grpc.StatusCode.RESOURCE_EXHAUSTED
CONTEXT = "The access code of Mira Halden is 4821. " * 4
QUESTION = "What is the access code of Mira Halden?"
VANILLA = {"method": "vanilla", "gen_length": 4, "steps": 2, "block_length": 4}
PDLLM = {"method": "pdllm", "gen_length": 4, "steps": 2, "block_length": 4, "chunk_size": 16, "top_k": 1}


class ByteTokenizer:
    eos_token_id = 0

    def encode(
        self, text: str, add_special_tokens: bool = False, split_special_tokens: bool = False
    ) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


@dataclass
class FakeDecode(workers_pb2_grpc.DecodeServicer):
    """Answers ANSWER over two partials (when asked) and a final; `mode` "busy" refuses like a full
    scheduler queue, "busy-mid-stream" sends one partial then RESOURCE_EXHAUSTED, "down" is UNAVAILABLE, "slow" sends a
    partial and then waits for the call to end."""

    mode: str = "ok"
    address: str = ""
    requests: list[wpb.DecodeRequest] = field(default_factory=list)

    def Decode(
        self, request: wpb.DecodeRequest, context: grpc.ServicerContext
    ) -> Iterator[wpb.DecodeResponse]:
        self.requests.append(request)
        if self.mode == "busy":
            raise PdllmError("decode queue is full (0 waiting); retry on another worker", code=BUSY)
        if self.mode == "down":
            raise PdllmError("worker is draining", code=grpc.StatusCode.UNAVAILABLE)
        if self.mode == "slow":  # one partial, then nothing until the call ends (its deadline)
            yield wpb.DecodeResponse(partial=pb.PartialOutput(step=1, total_steps=2, unmasked=0))
            termination_event(context).wait(30)  # no polling: it ends as soon as the call does
            return
        if request.stream_partials or self.mode in ("busy-mid-stream", "down-mid-stream"):
            for step in (1, 2):
                tokens = ANSWER[: 2 * step] + [-1] * (len(ANSWER) - 2 * step)
                yield wpb.DecodeResponse(
                    partial=pb.PartialOutput(step=step, total_steps=2, token_ids=tokens, unmasked=2 * step)
                )
                if self.mode == "busy-mid-stream":
                    raise PdllmError("response too large", code=BUSY)
                if self.mode == "down-mid-stream":
                    raise PdllmError("worker is draining", code=grpc.StatusCode.UNAVAILABLE)
        yield wpb.DecodeResponse(final=wpb.DecodeResult(token_ids=ANSWER, finish_reason="length", steps=2))


@dataclass
class FakePrefill(workers_pb2_grpc.PrefillServicer):
    mode: str = "ok"
    address: str = ""
    requests: list[wpb.PrefillRequest] = field(default_factory=list)

    def Prefill(self, request: wpb.PrefillRequest, context: grpc.ServicerContext) -> wpb.PrefillResponse:
        self.requests.append(request)
        if self.mode == "slow":
            time.sleep(1.5)
        if self.mode == "busy":
            raise PdllmError("too many calls in flight", code=BUSY)
        ids = list(request.context_ids)
        return wpb.PrefillResponse(
            kv_spec=wpb.KvSpec(model_id="fake"),
            selected=[wpb.ChunkHandle(key="k0", chunk_id=0, token_ids=ids)],
            chunk_scores=[pb.ChunkScore(chunk_id=0, total=1.0, selected=True, kept_tokens=len(ids))],
        )


@dataclass
class Cluster:
    router: RpcServer
    decodes: list[FakeDecode]
    prefills: list[FakePrefill]
    reported: list[tuple[str, str]]
    workers: list[RpcServer] = field(default_factory=list)  # the fakes' servers (their RPC metrics)

    def client(self) -> PdllmClient:
        return PdllmClient(self.router.address, timeout_s=10)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    """Two decode and two prefill fakes behind a router; workers are listed in the order the router tries
    them (ties in load break by address), so ``decodes[0]`` is always tried first."""
    servers: list[RpcServer] = []
    channels: dict[str, grpc.Channel] = {}
    lock = threading.Lock()

    def serve(servicer, add, name: str) -> str:
        server = build_server(ServerConfig(role="fake"), [service_spec(servicer, add, name)]).start()
        servers.append(server)
        servicer.address = server.address
        return server.address

    decodes = [FakeDecode() for _ in range(2)]
    prefills = [FakePrefill() for _ in range(2)]
    for d in decodes:
        serve(d, workers_pb2_grpc.add_DecodeServicer_to_server, "pdllm.v1.Decode")
    for p in prefills:
        serve(p, workers_pb2_grpc.add_PrefillServicer_to_server, "pdllm.v1.Prefill")
    decodes.sort(key=lambda w: w.address)
    prefills.sort(key=lambda w: w.address)
    healthy = {"decode": tuple(d.address for d in decodes), "prefill": tuple(p.address for p in prefills)}

    def channel(address: str) -> grpc.Channel:
        with lock:
            if address not in channels:
                channels[address] = grpc.insecure_channel(address)
            return channels[address]

    reported: list[tuple[str, str]] = []
    pools = Pools(healthy=lambda role: healthy[role], channel=channel)
    pools.on_failure(lambda role, address: reported.append((role, address)))
    router = RouterServicer(ByteTokenizer(), pools, RouterConfig(attempts=3))
    spec = service_spec(router, generation_pb2_grpc.add_GenerationServicer_to_server, "pdllm.v1.Generation")
    servers.append(build_server(ServerConfig(role="router"), [spec]).start())
    try:
        yield Cluster(servers[-1], decodes, prefills, reported, servers[:-1])
    finally:
        for ch in channels.values():
            ch.close()
        for server in servers:
            server.stop()


def test_busy_decode_worker_is_retried_elsewhere_and_stays_healthy(cluster: Cluster) -> None:
    first, second = cluster.decodes
    first.mode = "busy"
    with cluster.client() as client:
        reply = client.generate(CONTEXT, QUESTION, **VANILLA)
    assert list(reply.token_ids) == ANSWER
    assert reply.trace.decode_worker == second.address
    assert len(first.requests) == 1 and len(second.requests) == 1
    assert first.requests[0].request_id == second.requests[0].request_id  # same request id on the retry
    assert cluster.reported == []  # busy, not dead: never reported to the pool


def test_every_decode_worker_busy_gives_resource_exhausted(cluster: Cluster) -> None:
    for d in cluster.decodes:
        d.mode = "busy"
    with cluster.client() as client, pytest.raises(PdllmError) as err:
        client.generate(CONTEXT, QUESTION, **VANILLA)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "busy" in err.value.message and "retry later" in err.value.message
    assert [len(d.requests) for d in cluster.decodes] == [1, 1]  # each worker once, none twice
    assert cluster.reported == []
    with cluster.client() as client, pytest.raises(PdllmError) as err:
        list(client.generate_stream(CONTEXT, QUESTION, **VANILLA))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_busy_after_partials_is_not_retried(cluster: Cluster) -> None:
    first, second = cluster.decodes
    first.mode = "busy-mid-stream"
    with cluster.client() as client, pytest.raises(PdllmError) as err:
        list(client.generate_stream(CONTEXT, QUESTION, **VANILLA))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert second.requests == [] and cluster.reported == []


def test_unavailable_decode_worker_is_reported_and_retried(cluster: Cluster) -> None:
    first, second = cluster.decodes
    first.mode = "down"
    with cluster.client() as client:
        assert list(client.generate(CONTEXT, QUESTION, **VANILLA).token_ids) == ANSWER
    assert cluster.reported == [("decode", first.address)]
    assert len(second.requests) == 1


def test_busy_prefill_worker_is_retried_elsewhere_and_stays_healthy(cluster: Cluster) -> None:
    first, second = cluster.prefills
    first.mode = "busy"
    with cluster.client() as client:
        reply = client.generate(CONTEXT, QUESTION, **PDLLM)
    assert list(reply.token_ids) == ANSWER and reply.trace.prefill_worker == second.address
    assert cluster.reported == []
    second.mode = "busy"
    with cluster.client() as client, pytest.raises(PdllmError) as err:
        client.generate(CONTEXT, QUESTION, **PDLLM)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "prefill" in err.value.message


def test_unary_generate_asks_for_no_partials(cluster: Cluster) -> None:
    with cluster.client() as client:
        reply = client.generate(CONTEXT, QUESTION, **VANILLA)
        events = list(client.generate_stream(CONTEXT, QUESTION, **VANILLA))
    sent = [r.stream_partials for d in cluster.decodes for r in d.requests]
    assert sorted(sent) == [False, True]
    timings = reply.trace.timings
    assert 0 < timings.ttft_s == timings.total_s  # no partial: ttft is the time to the final result
    assert [e.HasField("partial") for e in events] == [True, True, False]
    assert events[0].partial.text == "48"
    streamed = events[-1].final.trace.timings
    assert 0 < streamed.ttft_s <= streamed.total_s


def test_a_request_without_an_id_has_one_id_everywhere(cluster: Cluster) -> None:
    """The id the router's logs carry (bound by the server interceptor), the one the workers get and the
    one in the response are the same when the client sends none."""
    import logging

    from pdllm.shared.rpc.logs import current_request_id

    seen: list[str | None] = []

    class Record(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(current_request_id())

    handler = Record()
    loggers = [logging.getLogger(name) for name in ("pdllm.router", "pdllm.rpc")]  # router + its interceptor
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    cluster.decodes[0].mode = "busy"  # the router logs a warning while it handles the request
    try:
        with cluster.client() as client:
            reply = client.generate(CONTEXT, QUESTION, **PDLLM)
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)
    rid = reply.request_id
    assert rid and seen and set(seen) == {rid}
    assert cluster.prefills[0].requests[0].request_id == rid
    assert {r.request_id for d in cluster.decodes for r in d.requests} == {rid}


def test_a_client_leaving_during_prefill_is_no_internal_error(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    for p in cluster.prefills:
        p.mode = "slow"
    with cluster.client() as client, pytest.raises(PdllmError) as err:
        client.generate(CONTEXT, QUESTION, timeout_s=0.3, **PDLLM)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(1.6)  # the router's handler finishes after the slow prefill call is cancelled
    unhandled = [r for r in caplog.records if "unhandled error" in r.getMessage()]
    assert not unhandled, "a client leaving is not an internal error"
    assert _rpc_codes(cluster.router, "/Generate") == {"DEADLINE_EXCEEDED": 1}  # not CANCELLED
    prefill_codes = [_rpc_codes(w, "/Prefill") for w in cluster.workers if _rpc_codes(w, "/Prefill")]
    assert prefill_codes == [{"DEADLINE_EXCEEDED": 1}]


def test_decode_calls_that_delivered_their_answer_end_ok_at_the_worker(cluster: Cluster) -> None:
    """The router reads a decode stream to its end after the final message: cancelling it right away
    made workers count some successful decodes as CANCELLED."""
    with cluster.client() as client:
        for _ in range(20):
            assert list(client.generate(CONTEXT, QUESTION, **VANILLA).token_ids) == ANSWER
    time.sleep(0.2)
    codes: dict[str, float] = {}
    for server in cluster.workers:
        for metric in server.registry.collect():
            for sample in metric.samples:
                if sample.name == "pdllm_rpc_requests_total" and sample.labels["method"].endswith("Decode"):
                    codes[sample.labels["code"]] = codes.get(sample.labels["code"], 0) + sample.value
    assert codes == {"OK": 20}


def test_a_stream_retried_mid_way_stays_monotone(cluster: Cluster) -> None:
    """The first worker sends one partial and goes away; the retry's stream starts over on the second.
    The client never sees unmasked slots go back to masked: the replayed partials are not relayed."""
    cluster.decodes[0].mode = "down-mid-stream"
    with cluster.client() as client:
        events = list(client.generate_stream(CONTEXT, QUESTION, **VANILLA))
    unmasked = [e.partial.unmasked for e in events if e.HasField("partial")]
    assert unmasked == [2, 4]  # 2 from the first worker, then only the second's step past it
    assert list(events[-1].final.token_ids) == ANSWER
    assert len(cluster.decodes[1].requests) == 1


def _rpc_codes(server: RpcServer, method_suffix: str) -> dict[str, float]:
    """Finished calls of the method ending in ``method_suffix`` on ``server``, by status code."""
    codes: dict[str, float] = {}
    for metric in server.registry.collect():
        for sample in metric.samples:
            if sample.name == "pdllm_rpc_requests_total" and sample.labels["method"].endswith(method_suffix):
                codes[sample.labels["code"]] = codes.get(sample.labels["code"], 0) + sample.value
    return codes


def _wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_stream_past_its_deadline_is_recorded_as_deadline_exceeded(cluster: Cluster) -> None:
    """A client deadline in the middle of GenerateStream was once counted and logged as CANCELLED by
    the router (it cancelled its decode call when its own call ended, and recorded that call's status)."""
    for d in cluster.decodes:
        d.mode = "slow"
    with finished_codes("/GenerateStream") as logged:
        with cluster.client() as client, pytest.raises(PdllmError) as err:
            list(client.generate_stream(CONTEXT, QUESTION, timeout_s=0.5, **VANILLA))
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert _wait_for(lambda: logged != [])
    assert logged == ["DEADLINE_EXCEEDED"]
    assert _rpc_codes(cluster.router, "/GenerateStream") == {"DEADLINE_EXCEEDED": 1}
    decode_codes = lambda: [_rpc_codes(w, "/Decode") for w in cluster.workers if _rpc_codes(w, "/Decode")]  # noqa: E731
    assert _wait_for(decode_codes)
    assert decode_codes() == [{"DEADLINE_EXCEEDED": 1}]
    assert len(cluster.decodes[0].requests) + len(cluster.decodes[1].requests) == 1  # no retry


class _EndedCall:
    """A server context whose call has ended with ``left`` seconds to its deadline; runs its callbacks."""

    def __init__(self, left: float | None) -> None:
        self.left = left

    def time_remaining(self) -> float | None:
        return self.left

    def add_callback(self, callback) -> bool:
        callback()
        return True


@pytest.mark.parametrize(("left", "cancelled"), [(0.0, False), (2.5, True), (None, True)])
def test_worker_calls_are_cancelled_only_when_the_client_left_before_its_deadline(
    left: float | None, cancelled: bool
) -> None:
    """A client's deadline is not turned into a cancellation of the worker call (which ends on the same
    deadline by itself); a client that cancels, or a server that stops, cancels it."""
    calls: list[str] = []
    _cancel_when_client_leaves(_EndedCall(left), lambda: calls.append("cancel"))
    assert calls == (["cancel"] if cancelled else [])
