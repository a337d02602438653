"""The Triton split-S decode backend gives the same tokens as the torch segments backend (interpreter)."""

from __future__ import annotations

from pathlib import Path

from tests.interpreter import run_under_interpreter


def test_triton_decode_matches_segments_under_interpreter() -> None:
    run_under_interpreter(Path(__file__).with_name("triton_case.py"), timeout_s=300)
