"""The Triton split-S decode backend gives the same tokens as the torch segments backend (interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_triton_decode_matches_segments_under_interpreter() -> None:
    pytest.importorskip("triton", reason="triton not installed")
    case = Path(__file__).with_name("triton_case.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(case)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("ok")
