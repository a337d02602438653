"""Regenerate the checked-in Python stubs from the .proto files: `python -m pdllm.protos.generate`.

The .proto files live under `protos/pdllm/v1/` and are compiled with `protos/` as the include root, so
they register as `pdllm/v1/<name>.proto` (the path grpcurl and other languages see). protoc then writes
`from pdllm.v1 import x_pb2` for cross-file imports, which would not resolve inside our `pdllm.protos`
namespace; we rewrite those lines to package-relative imports (`from . import x_pb2`), which keeps the
stubs importable as `pdllm.protos.pdllm.v1.*` wherever the package is installed.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import tempfile
from importlib import resources
from importlib.metadata import version
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_PACKAGE_DIR = Path("pdllm") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")

_ABSOLUTE_IMPORT = re.compile(r"^from pdllm\.v1 import (\w+_pb2) as (\w+)$", re.MULTILINE)
_GRPC_STAMP = re.compile(r"^GRPC_GENERATED_VERSION = '([^']+)'$", re.MULTILINE)


class GenerationError(RuntimeError):
    """protoc failed; the message carries protoc's diagnostics."""


def proto_files(root: Path = PROTO_ROOT) -> list[Path]:
    return sorted((root / PROTO_PACKAGE_DIR).glob("*.proto"))


def _relativize_imports(text: str) -> str:
    return _ABSOLUTE_IMPORT.sub(r"from . import \1 as \2", text)


def generate(out_root: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Compile every proto under `proto_root` into `out_root` (same relative layout); returns written files."""
    from grpc_tools import protoc

    protos = proto_files(proto_root)
    if not protos:
        raise GenerationError(f"no .proto files under {proto_root / PROTO_PACKAGE_DIR}")
    well_known = str(resources.files("grpc_tools") / "_proto")
    with tempfile.TemporaryDirectory() as scratch:
        args = [
            "grpc_tools.protoc",
            f"-I{proto_root}",
            f"-I{well_known}",
            f"--python_out={scratch}",
            f"--pyi_out={scratch}",
            f"--grpc_python_out={scratch}",
            *(str(p.relative_to(proto_root)) for p in protos),
        ]
        status = protoc.main(args)
        if status != 0:
            raise GenerationError(f"protoc exited with status {status} for {', '.join(map(str, protos))}")
        written = []
        for src in sorted((Path(scratch) / PROTO_PACKAGE_DIR).iterdir()):
            if not src.name.endswith(GENERATED_SUFFIXES):
                continue
            dst = out_root / PROTO_PACKAGE_DIR / src.name
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(_relativize_imports(src.read_text(encoding="utf-8")), encoding="utf-8")
            written.append(dst)
    return written


def _embedded_descriptor(stub_text: str) -> bytes | None:
    """The serialized FileDescriptorProto a generated `_pb2.py` registers (None if there is none)."""
    for node in ast.walk(ast.parse(stub_text)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "AddSerializedFile"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, bytes)
        ):
            return node.args[0].value
    return None


def _stamped_grpc_version(stub_dir: Path) -> str | None:
    for path in sorted(stub_dir.glob("*_pb2_grpc.py")):
        match = _GRPC_STAMP.search(path.read_text(encoding="utf-8"))
        if match:
            return match.group(1)
    return None


def stale_files(proto_root: Path = PROTO_ROOT) -> list[str]:
    """Names of checked-in stubs that do not match the .proto files (missing or extra ones included).

    Each `_pb2.py` must embed exactly the descriptor protoc now produces; that is what "stale" means and it
    does not depend on the grpcio-tools version. When the installed grpcio-tools is the one that generated
    the stubs, every file must also match byte for byte (catching hand edits); with another version the
    surrounding code legitimately differs, so only the descriptors are compared.
    """
    current_dir = proto_root / PROTO_PACKAGE_DIR
    current = {
        p.name: p.read_text(encoding="utf-8")
        for p in current_dir.iterdir()
        if p.name.endswith(GENERATED_SUFFIXES)
    }
    with tempfile.TemporaryDirectory() as fresh_dir:
        fresh = {p.name: p.read_text(encoding="utf-8") for p in generate(Path(fresh_dir), proto_root)}
    same_tools = _stamped_grpc_version(current_dir) == version("grpcio-tools")
    stale = []
    for name in sorted(fresh.keys() | current.keys()):
        ours, theirs = current.get(name), fresh.get(name)
        if (
            ours is None
            or theirs is None
            or name.endswith("_pb2.py")
            and _embedded_descriptor(ours) != _embedded_descriptor(theirs)
            or same_tools
            and ours != theirs
        ):
            stale.append(name)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale stubs; exit 1 if any")
    parser.add_argument("--out", type=Path, default=PROTO_ROOT, help="output root (default: protos/)")
    args = parser.parse_args(argv)
    try:
        if args.check:
            stale = stale_files()
            for name in stale:
                print(f"stale: {PROTO_PACKAGE_DIR / name}", file=sys.stderr)
            return 1 if stale else 0
        if args.out.resolve() == PROTO_ROOT:
            # Drop stubs of protos that no longer exist before writing the fresh ones.
            for old in (PROTO_ROOT / PROTO_PACKAGE_DIR).iterdir():
                if old.name.endswith(GENERATED_SUFFIXES):
                    old.unlink()
        for path in generate(args.out):
            print(path)
    except GenerationError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
