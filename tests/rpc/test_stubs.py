"""The checked-in stubs match a fresh protoc run, and the staleness check really detects drift."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from pdllm.protos import generate
from pdllm.protos.pdllm.v1 import generation_pb2, workers_pb2, workers_pb2_grpc


def test_checked_in_stubs_are_fresh() -> None:
    stale = generate.stale_files()
    assert stale == [], f"stale stubs {stale}: run `python -m pdllm.protos.generate` and commit the result"


def test_staleness_check_detects_an_edited_proto(tmp_path: Path) -> None:
    root = tmp_path / "protos"
    shutil.copytree(generate.PROTO_ROOT / "pdllm", root / "pdllm")
    proto = root / "pdllm" / "v1" / "generation.proto"
    text = proto.read_text()
    proto.write_text(text.replace("  Trace trace = 6;\n", "  Trace trace = 6;\n  string note = 7;\n", 1))
    assert generate.stale_files(root) == ["generation_pb2.py", "generation_pb2.pyi"]


def test_staleness_check_detects_a_missing_stub(tmp_path: Path) -> None:
    root = tmp_path / "protos"
    shutil.copytree(generate.PROTO_ROOT / "pdllm", root / "pdllm")
    (root / "pdllm" / "v1" / "workers_pb2_grpc.py").unlink()
    assert generate.stale_files(root) == ["workers_pb2_grpc.py"]


def test_hand_edits_are_stale_when_the_toolchain_matches(tmp_path: Path) -> None:
    root = tmp_path / "protos"
    shutil.copytree(generate.PROTO_ROOT / "pdllm", root / "pdllm")
    stub = root / "pdllm" / "v1" / "generation_pb2_grpc.py"
    stub.write_text(stub.read_text() + "\n# local tweak\n")
    assert generate.stale_files(root) == ["generation_pb2_grpc.py"]


def test_other_toolchain_versions_compare_descriptors_only(tmp_path: Path) -> None:
    root = tmp_path / "protos"
    shutil.copytree(generate.PROTO_ROOT / "pdllm", root / "pdllm")
    stubs = root / "pdllm" / "v1"
    # Stubs stamped by another grpcio-tools, with that version's different boilerplate: not stale ...
    for path in stubs.glob("*_pb2_grpc.py"):
        text = re.sub(
            r"GRPC_GENERATED_VERSION = '[^']+'", "GRPC_GENERATED_VERSION = '0.0.1'", path.read_text()
        )
        path.write_text(text + "\n# boilerplate of another version\n")
    assert generate.stale_files(root) == []
    # ... but a .proto change still is, because the embedded descriptor no longer matches.
    proto = stubs / "workers.proto"
    proto.write_text(proto.read_text().replace("  reserved 5, 6;", "  reserved 5, 6;\n  int32 extra = 7;"))
    assert generate.stale_files(root) == ["workers_pb2.py"]


def test_generated_imports_resolve_inside_the_pdllm_namespace() -> None:
    for path in (generate.PROTO_ROOT / "pdllm" / "v1").glob("*_pb2*.py*"):
        assert "from pdllm.v1 import" not in path.read_text(), path.name
    # workers.proto imports generation.proto: the message types must be the very same classes.
    assert workers_pb2.PrefillRequest.DESCRIPTOR.fields_by_name["method"].message_type is (
        generation_pb2.MethodParams.DESCRIPTOR
    )
    assert generation_pb2.DESCRIPTOR.name == "pdllm/v1/generation.proto"
    assert workers_pb2_grpc.DecodeStub is not None
    assert workers_pb2.DESCRIPTOR.services_by_name["Decode"].methods_by_name["Decode"].server_streaming


def test_check_mode_exit_code() -> None:
    assert generate.main(["--check"]) == 0
