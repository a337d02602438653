"""The server plumbing against real gRPC servers on loopback: health, reflection, auth, limits, bad input,
errors, cancellation, deadlines, metrics, logging, TLS."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2
from prometheus_client.parser import text_string_to_metric_families

from pdllm.protos.pdllm.v1 import generation_pb2_grpc as pb_grpc
from pdllm.shared.rpc.client import ClientTls, PdllmClient
from pdllm.shared.rpc.errors import InvalidRequestError, PdllmError
from pdllm.shared.rpc.logs import configure_json_logging
from pdllm.shared.rpc.server import RpcServer, ServerConfig, TlsFiles, build_server, service_spec
from tests.rpc.cases import BAD_INPUTS, valid_request
from tests.rpc.conftest import StartServer
from tests.rpc.fake_generation import MODEL
from tests.rpc.log_records import finished_codes

GENERATE = "/pdllm.v1.Generation/Generate"
STREAM = "/pdllm.v1.Generation/GenerateStream"


def _count(server: RpcServer, method: str, code: str) -> float:
    value = server.registry.get_sample_value(
        "pdllm_rpc_requests_total", {"role": "test", "method": method, "code": code}
    )
    return value or 0.0


def _wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_answers_and_reports_health_per_service(start_server: StartServer) -> None:
    server, _ = start_server()
    with PdllmClient(server.address) as client:
        reply = client.generate("some context", "hi?", model=MODEL, gen_length=4, steps=2, chunk_size=16)
        assert list(reply.token_ids) == [ord("h"), ord("i"), ord("?")]
        assert client.health() == "SERVING"
        assert client.health("pdllm.v1.Generation") == "SERVING"
        with pytest.raises(PdllmError) as info:
            client.health("pdllm.v1.NoSuchService")
        assert info.value.code == grpc.StatusCode.NOT_FOUND
    server.set_serving("pdllm.v1.Generation", False)
    with PdllmClient(server.address) as client:
        assert client.health("pdllm.v1.Generation") == "NOT_SERVING"


@pytest.mark.parametrize("version", ["v1alpha", "v1"])
def test_reflection_lists_and_describes_services(start_server: StartServer, version: str) -> None:
    server, _ = start_server()
    with grpc.insecure_channel(server.address) as channel:
        # v1 and v1alpha are the same messages in two packages (identical on the wire): one client for both.
        info = channel.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="pdllm.v1.Generation"),
        ]
        listed, described = list(info(iter(requests), timeout=5))
    names = {s.name for s in listed.list_services_response.service}
    assert {
        "pdllm.v1.Generation",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    } <= names
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in described.file_descriptor_response.file_descriptor_proto
    ]
    generation = next(f for f in files if f.name == "pdllm/v1/generation.proto")
    assert [m.name for m in generation.service[0].method] == ["Generate", "GenerateStream"]


def test_bearer_token_is_enforced_except_for_health(start_server: StartServer) -> None:
    server, _ = start_server(auth_token="s3cret")
    for token, reason in ((None, "missing bearer token"), ("wrong", "invalid bearer token")):
        with PdllmClient(server.address, token=token) as client:
            with pytest.raises(PdllmError) as info:
                client.generate("ctx", "q?", model=MODEL)
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert reason in info.value.message
            with pytest.raises(PdllmError) as info:
                list(client.generate_stream("ctx", "q?", model=MODEL))
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert client.health() == "SERVING"
    with PdllmClient(server.address, token="s3cret") as client:
        assert client.generate("ctx", "q?", model=MODEL).text == "q?"
    with grpc.insecure_channel(server.address) as channel:  # the scheme name is case-insensitive
        call = channel.unary_unary(GENERATE)
        assert call(
            valid_request().SerializeToString(), metadata=(("authorization", "bearer s3cret"),), timeout=5
        )
    assert _count(server, GENERATE, "UNAUTHENTICATED") == 2


def test_oversized_message_is_resource_exhausted_and_server_keeps_serving(start_server: StartServer) -> None:
    server, _ = start_server(max_receive_message_bytes=32 * 1024)
    with PdllmClient(server.address) as client:
        with pytest.raises(PdllmError) as info:
            client.generate("x" * 40_000, "q?", model=MODEL)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.generate("x" * 30_000, "q?", model=MODEL).text == "q?"


def test_every_bad_input_kind_is_invalid_argument_over_the_wire(start_server: StartServer) -> None:
    server, _ = start_server()
    with PdllmClient(server.address) as client:
        for kind, edit, phrase in BAD_INPUTS:
            req = valid_request()
            edit(req)
            with pytest.raises(InvalidRequestError) as info:
                client.generate_request(req, timeout_s=5)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT, kind
            assert phrase in info.value.message, (kind, info.value.message)
        # Streams reject the same way, before any message is sent.
        req = valid_request()
        req.method.kv_mode = "nope"
        with pytest.raises(InvalidRequestError):
            list(client.stream_request(req, timeout_s=5))
        assert client.generate_request(valid_request(), timeout_s=5).text == valid_request().question[:32]
    assert _count(server, GENERATE, "INVALID_ARGUMENT") == len(BAD_INPUTS)
    assert _count(server, GENERATE, "OK") == 1


def test_invalid_utf8_on_the_wire_is_invalid_argument(start_server: StartServer) -> None:
    server, _ = start_server()
    # Field 4 (question), wire type 2, 2 bytes that are not UTF-8; a later occurrence overrides the valid one.
    raw = valid_request().SerializeToString() + bytes([4 << 3 | 2, 2, 0xFF, 0xFE])
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(GENERATE)  # no serializers: bytes go out as they are
        with pytest.raises(grpc.RpcError) as info:
            call(raw, timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed request message" in info.value.details()
        assert call(valid_request().SerializeToString(), timeout=5)  # still serving
    assert _count(server, GENERATE, "INVALID_ARGUMENT") == 1


def test_unexpected_exception_is_internal_without_leaking_details(start_server: StartServer) -> None:
    server, _ = start_server()
    with PdllmClient(server.address) as client:
        with pytest.raises(PdllmError) as info:
            client.generate("ctx", "boom", model=MODEL, request_id="req-boom")
        assert info.value.code == grpc.StatusCode.INTERNAL
        assert "secret" not in info.value.message and "req-boom" in info.value.message
        assert info.value.request_id == "req-boom"
        with pytest.raises(PdllmError) as info:
            list(client.generate_stream("ctx", "boom", model=MODEL))
        assert info.value.code == grpc.StatusCode.INTERNAL and "secret" not in info.value.message
        # The server assigned a request id of its own to the call that had none.
        assert "request id None" not in info.value.message
        assert client.generate("ctx", "fine", model=MODEL).text == "fine"


def test_stream_yields_increasing_partials_then_final(start_server: StartServer) -> None:
    server, _ = start_server(step_delay_s=0.0)
    with PdllmClient(server.address) as client:
        messages = list(client.generate_stream("ctx", "abcdef", model=MODEL, gen_length=6, steps=3))
    kinds = [m.WhichOneof("event") for m in messages]
    assert kinds == ["partial"] * 3 + ["final"]
    assert [m.partial.unmasked for m in messages[:3]] == [2, 4, 6]
    assert list(messages[0].partial.token_ids) == [ord("a"), ord("b"), -1, -1, -1, -1]
    assert messages[-1].final.text == "abcdef"
    assert (
        server.registry.get_sample_value(
            "pdllm_rpc_first_message_seconds_count", {"role": "test", "method": STREAM}
        )
        == 1.0
    )


def test_client_cancellation_is_observed_server_side(start_server: StartServer) -> None:
    server, servicer = start_server(step_delay_s=0.05)
    with PdllmClient(server.address) as client:
        stream = client.generate_stream("ctx", "slow", model=MODEL, gen_length=64, steps=64)
        assert next(stream).partial.step == 1
        stream.close()  # the client gives up after the first partial
        assert servicer.cancelled.wait(5), "the servicer never saw the cancellation"
    assert _wait_for(lambda: _count(server, STREAM, "CANCELLED") == 1)
    assert servicer.completed_streams == 0
    assert _wait_for(lambda: server.admission.in_flight == 0)


def test_deadline_exceeded(start_server: StartServer) -> None:
    server, servicer = start_server(step_delay_s=0.05)
    with PdllmClient(server.address) as client:
        started = time.monotonic()
        with pytest.raises(PdllmError) as info:
            client.generate("ctx", "slow", model=MODEL, gen_length=64, steps=64, timeout_s=0.3)
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 2.0
    assert servicer.cancelled.wait(5)
    assert _wait_for(lambda: _count(server, GENERATE, "DEADLINE_EXCEEDED") == 1)


def test_stream_deadline_is_recorded_as_deadline_exceeded(start_server: StartServer) -> None:
    """A handler that fails (here with CANCELLED, as a router whose worker call ended) after the client's
    deadline ended the call: the metric and the log line say DEADLINE_EXCEEDED, what the client got."""
    server, _ = start_server(step_delay_s=0.05)
    with finished_codes(STREAM) as codes:
        with PdllmClient(server.address) as client, pytest.raises(PdllmError) as info:
            list(
                client.generate_stream(
                    "ctx", "slow-abort", model=MODEL, gen_length=64, steps=64, timeout_s=0.3
                )
            )
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert _wait_for(lambda: codes != [])  # logged after the metric is counted
    assert codes == ["DEADLINE_EXCEEDED"]
    assert _count(server, STREAM, "DEADLINE_EXCEEDED") == 1 and _count(server, STREAM, "CANCELLED") == 0


def test_concurrency_limit_is_resource_exhausted_but_health_still_answers(start_server: StartServer) -> None:
    server, servicer = start_server(step_delay_s=0.05, max_workers=1)
    with PdllmClient(server.address) as client:
        stream = client.generate_stream("ctx", "slow", model=MODEL, gen_length=32, steps=32)
        next(stream)
        with pytest.raises(PdllmError) as info:
            client.generate("ctx", "q?", model=MODEL)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limit of 1 concurrent calls" in info.value.message
        assert client.health() == "SERVING"  # probes are not starved by the busy slot
        stream.close()
        assert _wait_for(lambda: server.admission.in_flight == 0)
        assert client.generate("ctx", "q?", model=MODEL).text == "q?"
    assert _count(server, GENERATE, "RESOURCE_EXHAUSTED") == 1


def test_metrics_endpoint_exposes_counters_histograms_and_gauges(start_server: StartServer) -> None:
    server, _ = start_server()
    with PdllmClient(server.address) as client:
        client.generate("ctx", "q?", model=MODEL)
        client.generate("ctx", "q?", model=MODEL)
        with pytest.raises(PdllmError):
            client.generate("", "q?", model=MODEL)
    body = (
        urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    )
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }
    labels = (("code", "OK"), ("method", GENERATE), ("role", "test"))
    assert samples[("pdllm_rpc_requests_total", labels)] == 2
    err = (("code", "INVALID_ARGUMENT"), ("method", GENERATE), ("role", "test"))
    assert samples[("pdllm_rpc_errors_total", err)] == 1
    assert samples[("pdllm_rpc_latency_seconds_count", (("method", GENERATE), ("role", "test")))] == 3
    assert samples[("pdllm_queue_depth", (("role", "test"),))] == 0
    assert samples[("pdllm_rpc_in_flight", (("role", "test"),))] == 0


def test_json_logs_carry_the_request_id(start_server: StartServer) -> None:
    server, _ = start_server()
    stream = io.StringIO()
    handler = configure_json_logging(logging.INFO, stream)
    try:
        with PdllmClient(server.address) as client:
            client.generate("ctx", "q?", model=MODEL, request_id="req-log-7")
    finally:
        logging.getLogger("pdllm").removeHandler(handler)
    entries = [json.loads(line) for line in stream.getvalue().splitlines()]
    finished = [e for e in entries if e["msg"] == "rpc finished" and e.get("method") == GENERATE]
    assert finished and finished[0]["request_id"] == "req-log-7" and finished[0]["code"] == "OK"
    assert finished[0]["level"] == "INFO" and finished[0]["seconds"] >= 0


def _self_signed(tmp_path: Path) -> TlsFiles:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return TlsFiles(cert_path=cert, key_path=key)


def test_tls_with_token(start_server: StartServer, tmp_path: Path) -> None:
    tls = _self_signed(tmp_path)
    server, _ = start_server(tls=tls, auth_token="tok")
    target = f"localhost:{server.port}"
    with PdllmClient(target, token="tok", tls=ClientTls(root_cert_path=tls.cert_path)) as client:
        assert client.generate("ctx", "secure?", model=MODEL).text == "secure?"
    with PdllmClient(target, token="tok") as plaintext:
        with pytest.raises(PdllmError) as info:
            plaintext.generate("ctx", "q?", model=MODEL, timeout_s=3)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE


class _EagerFailure(pb_grpc.GenerationServicer):
    """Handlers that fail before returning anything: a plain function rather than a generator."""

    def Generate(self, request, context):
        raise PdllmError("no capacity for this model", code=grpc.StatusCode.FAILED_PRECONDITION)

    def GenerateStream(self, request, context):
        raise RuntimeError("secret stack detail")


def test_handlers_failing_before_streaming_are_mapped() -> None:
    spec = service_spec(_EagerFailure(), pb_grpc.add_GenerationServicer_to_server, "pdllm.v1.Generation")
    with (
        build_server(ServerConfig(role="test"), [spec]).start() as server,
        PdllmClient(server.address) as client,
    ):
        with pytest.raises(PdllmError) as info:
            client.generate("ctx", "q")
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert info.value.message == "no capacity for this model"
        with pytest.raises(PdllmError) as info:
            list(client.generate_stream("ctx", "q"))
        assert info.value.code == grpc.StatusCode.INTERNAL and "secret" not in info.value.message
        assert server.admission.in_flight == 0


def test_unreadable_tls_files_are_a_clear_error(tmp_path: Path) -> None:
    tls = TlsFiles(cert_path=tmp_path / "missing.pem", key_path=tmp_path / "missing-key.pem")
    with pytest.raises(ValueError, match="cannot read TLS key/certificate .*missing-key.pem"):
        build_server(ServerConfig(tls=tls), [])


def test_fifty_concurrent_streams_all_complete(start_server: StartServer) -> None:
    server, _ = start_server(step_delay_s=0.01)
    results: list[object] = [None] * 50

    def run(i: int) -> None:
        with PdllmClient(server.address) as client:
            try:
                messages = list(
                    client.generate_stream("ctx", f"slow {i:02d}", model=MODEL, gen_length=8, steps=8)
                )
                results[i] = messages[-1].final.text
            except PdllmError as err:
                results[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [f"slow {i:02d}" for i in range(50)]
    assert _count(server, STREAM, "OK") == 50
    assert _wait_for(lambda: server.admission.in_flight == 0)
