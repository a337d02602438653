"""Run each Triton kernel under TRITON_INTERPRET=1 in a fresh process and compare with its reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("interpreter_cases.py")


@pytest.mark.parametrize("case", ["split_s", "retention", "elementwise"])
def test_kernel_under_interpreter(case: str) -> None:
    pytest.importorskip("triton", reason="triton not installed; the GPU check covers the kernels")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(CASES), case], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("ok")
