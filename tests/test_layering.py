"""The code's layering follows the request path; checked by parsing every module's imports (no importing).

- ``pdllm.shared`` outside ``pdllm.shared.app`` is the core: it imports neither service, nor the router,
  nor the composition (``shared.app``) that wires them together.
- ``prefill_service`` and ``decode_service`` import only the core and the kernels: never each other, the
  router or the composition.
- ``router`` imports neither service nor the composition.
- ``kernels`` and ``protos`` sit below everything: they import no service, router or composition either.
- No runtime module imports ``tests`` (its reference loops and oracles are the tests' own).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The fixed top-level folders and the package each one is installed as (pyproject's package-dir).
FOLDERS = {
    "protos": "pdllm.protos",
    "router": "pdllm.router",
    "prefill_service": "pdllm.prefill_service",
    "decode_service": "pdllm.decode_service",
    "kernels": "pdllm.kernels",
    "shared": "pdllm.shared",
}
PREFILL, DECODE, ROUTER, APP, TESTS = (
    "pdllm.prefill_service",
    "pdllm.decode_service",
    "pdllm.router",
    "pdllm.shared.app",
    "tests",
)
# Layer -> packages its modules must not import.
FORBIDDEN = {
    "core": (PREFILL, DECODE, ROUTER, APP, TESTS),
    "prefill": (DECODE, ROUTER, APP, TESTS),
    "decode": (PREFILL, ROUTER, APP, TESTS),
    "router": (PREFILL, DECODE, APP, TESTS),
    "below": (PREFILL, DECODE, ROUTER, APP, TESTS),  # kernels, protos
    "app": (TESTS,),
}


def layer(module: str) -> str:
    if _within(module, APP):
        return "app"
    if _within(module, "pdllm.shared"):
        return "core"
    if _within(module, PREFILL):
        return "prefill"
    if _within(module, DECODE):
        return "decode"
    if _within(module, ROUTER):
        return "router"
    return "below"


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def modules() -> dict[str, Path]:
    """Every Python module of the project by dotted name (generated protobuf stubs left out)."""
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def imported(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, dotted target) of every import in ``source``, anywhere in the file, relative ones resolved.
    ``from a.b import c`` yields both ``a.b`` and ``a.b.c`` (``c`` may be a module)."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
    return out


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    banned = FORBIDDEN[layer(module)]
    return sorted(
        {
            f"{module}:{line} imports {target}"
            for line, target in imported(source, module, is_package)
            if any(_within(target, b) for b in banned)
        }
    )


def test_every_module_imports_only_its_own_layer_and_below() -> None:
    found = modules()
    assert len(found) > 80 and {layer(m) for m in found} == set(FORBIDDEN)  # the walk saw every layer
    bad = []
    for module, path in found.items():
        bad += violations(path.read_text(encoding="utf-8"), module, path.name == "__init__.py")
    assert not bad, "layering violations:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("pdllm.shared.chunk_prefill", "from pdllm.prefill_service.scoring import score_chunks"),
        ("pdllm.shared.rpc.convert", "def f():\n    from pdllm.shared.app.engine import PrefillingEngine"),
        ("pdllm.shared.eval.tasks", "from ..app import serve"),
        ("pdllm.shared.layout", "import pdllm.router.server"),
        ("pdllm.prefill_service.server", "from pdllm.decode_service.worker import DecodeWorker"),
        ("pdllm.prefill_service.worker", "from pdllm import decode_service"),
        ("pdllm.decode_service.build", "from ..prefill_service.attention import BankPrefixAttention"),
        ("pdllm.decode_service.server", "from pdllm.shared import app"),
        ("pdllm.router.server", "from pdllm.prefill_service.worker import Selection"),
        ("pdllm.kernels.rope", "from pdllm.decode_service import rounds"),
        ("pdllm.decode_service.sessions", "from tests.reference.vanilla import generate_vanilla"),
        ("pdllm.shared.app.engine", "def f():\n    import tests.reference"),
    ],
)
def test_the_check_sees_a_planted_violation(module: str, source: str) -> None:
    assert violations(source, module)


def test_the_check_allows_what_each_layer_may_import() -> None:
    allowed = "from pdllm.shared.config import EngineConfig\nfrom pdllm.kernels import HAS_TRITON\n"
    for module in ("pdllm.shared.layout", "pdllm.prefill_service.worker", "pdllm.decode_service.worker"):
        assert violations(allowed + "from . import x\n", module) == []
    app = "from pdllm.prefill_service.worker import PrefillWorker\nfrom pdllm.router.server import Pools\n"
    assert violations(app, "pdllm.shared.app.serve") == []
    assert violations("from .engine import PrefillingEngine", "pdllm.shared.app", is_package=True) == []
