"""The shipped `protos/grpc/health/v1/health.proto` describes the health service our servers run
(grpcio-health-checking's), so clients in other languages can use it as is."""

from __future__ import annotations

from pathlib import Path

from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2
from grpc_tools import protoc

from pdllm.protos import generate


def _strip(fd: descriptor_pb2.FileDescriptorProto) -> descriptor_pb2.FileDescriptorProto:
    fd.ClearField("name")  # grpcio-health-checking registers it as grpc_health/v1/health.proto
    for message in fd.message_type:
        for nested in [message, *message.nested_type]:
            for field in nested.field:
                field.ClearField("json_name")  # protoc adds these; runtime descriptors leave them out
    return fd


def test_shipped_health_proto_matches_the_served_service(tmp_path: Path) -> None:
    out = tmp_path / "health.pb"
    args = [
        "protoc",
        f"-I{generate.PROTO_ROOT}",
        f"--descriptor_set_out={out}",
        "grpc/health/v1/health.proto",
    ]
    assert protoc.main(args) == 0
    shipped = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    assert shipped.name == "grpc/health/v1/health.proto"
    served = descriptor_pb2.FileDescriptorProto()
    health_pb2.DESCRIPTOR.CopyToProto(served)
    assert _strip(shipped) == _strip(served)
