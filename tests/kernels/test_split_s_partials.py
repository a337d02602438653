"""Split-S with 16-bit split partials (``SplitSConfig.partials_16bit``): the partials of bf16 / fp16 inputs are
stored in the input dtype, fp32 inputs keep fp32 ones; the merge still accumulates in fp32. Under the
interpreter the outputs stay within the 16-bit rounding of a float64 oracle (the same problems as the fp32
partials, error at most twice theirs plus one output rounding) and differ from the fp32-partial outputs
(the partials really are rounded). This file doubles as its interpreter case script (see the bottom).

Planted by hand (each made a test here fail, then was reverted): the flag ignored (fp32 partials always):
``test_kernel_under_interpreter`` fails on the outputs being equal; the partial dtype dropped from
``launch_key``: ``test_partial_dtype_and_launch_key`` fails."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # as a script: `tests` importable

from pdllm.kernels.split_s_attention import launch_key, partial_dtype  # noqa: E402
from pdllm.kernels.split_s_reference import SplitSConfig  # noqa: E402
from tests.interpreter import run_under_interpreter  # noqa: E402
from tests.kernels.helpers import float64_attention, make_problem  # noqa: E402

ON, OFF = SplitSConfig(partials_16bit=True), SplitSConfig()


def test_partial_dtype_and_launch_key() -> None:
    assert (
        partial_dtype(torch.bfloat16, ON) == torch.bfloat16
        and partial_dtype(torch.float16, ON) == torch.float16
    )
    assert partial_dtype(torch.float32, ON) == partial_dtype(torch.bfloat16, OFF) == torch.float32
    assert launch_key(torch.bfloat16, 64, 16, ON) != launch_key(torch.bfloat16, 64, 16, OFF)
    assert launch_key(torch.float32, 64, 16, ON) == launch_key(torch.float32, 64, 16, OFF)


def test_the_flag_round_trips_through_the_table_json_and_is_absent_when_off() -> None:
    from pdllm.kernels import split_s_tuning as st

    assert "partials_16bit" not in st.config_to_dict(OFF)  # older tables stay byte-identical
    assert st.config_to_dict(ON)["partials_16bit"] is True
    for cfg in (ON, OFF):
        assert st.config_from_dict(json.loads(json.dumps(st.config_to_dict(cfg)))) == cfg


def test_kernel_under_interpreter() -> None:
    run_under_interpreter(Path(__file__), "kernel", timeout_s=300)


def _case_kernel() -> None:
    from pdllm.kernels.split_s_attention import split_s_attention

    gen = torch.Generator().manual_seed(5)
    differs = 0
    for dtype in (torch.bfloat16, torch.float16):
        for p in (make_problem(gen, [5, 3, 4], [[40, 7], [33], [17, 9]], 2, 4, 16, 16, dtype=dtype),
                  make_problem(gen, [6, 2], [[64, 30], [16, 16, 1]], 1, 7, 32, 8, dtype=dtype)):  # fmt: skip
            want = float64_attention(p)[0]
            for fused in (False, True):
                base = SplitSConfig(block_m=16, block_n=16, num_splits=3, fused_merge=fused)
                out32 = split_s_attention(*p.args(), config=base)
                out16 = split_s_attention(
                    *p.args(), config=SplitSConfig(**{**base.__dict__, "partials_16bit": True})
                )
                err32 = (out32.double() - want).abs().max().item()
                err16 = (out16.double() - want).abs().max().item()
                ulp = torch.finfo(dtype).eps * want.abs().max().item()
                assert err16 <= 2 * err32 + ulp, (dtype, fused, err16, err32)
                differs += not torch.equal(out16, out32)
    assert differs > 0  # the partials are rounded to 16 bits somewhere
    print("partials ok")


if __name__ == "__main__":  # run_under_interpreter: TRITON_INTERPRET=1 python <this file> CASE
    {"kernel": _case_kernel}[sys.argv[1]]()
    print("ok")
