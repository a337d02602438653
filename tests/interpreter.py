"""Running a case script under Triton's interpreter in a fresh process (TRITON_INTERPRET must be set before
``@triton.jit`` runs, so it cannot be switched on inside the test process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_under_interpreter(script: Path, *args: str, timeout_s: float = 600) -> None:
    """Run ``script`` with ``TRITON_INTERPRET=1``; it must exit 0 with its last line ending in "ok"."""
    pytest.importorskip("triton", reason="triton not installed; the GPU checks cover the kernels")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("ok")
