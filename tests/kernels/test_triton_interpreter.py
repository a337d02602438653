"""Run each Triton kernel under TRITON_INTERPRET=1 in a fresh process and compare with its reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreter import run_under_interpreter

CASES = Path(__file__).with_name("interpreter_cases.py")


@pytest.mark.parametrize(
    "case",
    [
        "split_s",
        "split_s_merge",
        "split_s_configs",
        "split_s_tuner",
        "retention",
        "elementwise",
        "skinny_gemm",
        "fitted_configs",
    ],
)
def test_kernel_under_interpreter(case: str) -> None:
    run_under_interpreter(CASES, case, timeout_s=300)
