"""The experimental Hopper split-S variant on CPU.

- Under the Triton interpreter (``hopper_cases.py``): the TMA tile path itself (the interpreter emulates
  host tensor descriptors), the TMA-only and plain modes, against the torch reference and the float64
  gather, with ``lse_out``, over a pool whose unused slots hold NaN. A page off by one in the descriptor
  coordinate (``(page + 1) * HKV`` in ``_tma_tile``) fails ``hopper``. ``hopper_all_tma``: the all-TMA
  kernel on holed pages and tails inside a page; loading a partial tile unshifted (box at slot 0, the
  slots past its ``r`` tokens masked only in the scores) leaks the pool's NaN through V and fails it. Warp specialization is a compiler
  transform the interpreter does not run: only that asking for it keeps the numerics is checked here.
- A mode that fails to compile drops to the next one, once per shape.
- ``auto`` caps its pipeline stages to the device's shared memory before launching (a fake device property
  and the byte counts of offline sm_90 compiles stand in for the GPU); not even 1 stage fitting drops it.
  Taking the requested count without checking it (``or stages == requested`` in ``fit_stages``) fails both.
- ``$PDLLM_SPLIT_S`` picks the rounds' launcher; unset, today's kernel.
- The device A/B harness in ``--smoke`` mode (interpreter) and with every kernel failing (recorded, not
  fatal), so it cannot rot before its GPU run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.interpreter import run_under_interpreter

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).with_name("hopper_cases.py")

pytest.importorskip("triton", reason="triton not installed; the GPU run covers the variant")


@pytest.mark.parametrize("case", ["hopper", "hopper_drop", "hopper_all_tma"])
def test_hopper_variant_under_interpreter(case: str) -> None:
    run_under_interpreter(CASES, case, timeout_s=300)


def test_env_picks_the_rounds_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdllm.kernels import split_s_hopper as sh
    from pdllm.kernels.split_s_attention import split_s_attention

    monkeypatch.delenv(sh.ENV, raising=False)
    assert sh.paged_kernel() is split_s_attention
    monkeypatch.setenv(sh.ENV, "default")
    assert sh.paged_kernel() is split_s_attention
    monkeypatch.setenv(sh.ENV, "Hopper")
    assert sh.paged_kernel() is sh.split_s_attention_hopper
    monkeypatch.setenv(sh.ENV, "hoper")
    with pytest.raises(ValueError, match="hopper"):
        sh.paged_kernel()


def test_no_tma_off_hopper_or_for_crossing_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from pdllm.kernels import split_s_hopper as sh

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pages = torch.zeros(4, 2, 16, 32)
    assert "CUDA" in sh.tma_unsupported(torch.device("cpu"), pages, 16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert sh.tma_unsupported(torch.device("cpu"), pages, 16) is None
    assert "cross pages" in sh.tma_unsupported(torch.device("cpu"), pages, 32)
    assert "dense" in sh.tma_unsupported(torch.device("cpu"), pages.transpose(0, 1), 16)


# Triton 3.6 metadata.shared of the all-TMA kernel for sm_90 (64x64 tiles, 4 warps, D 128, bf16, local K/V).
WS_SHARED = {1: 147_696, 2: 213_232, 3: 278_976}


def test_fit_stages_takes_the_most_that_fit() -> None:
    from pdllm.kernels.resources import H100_SMEM
    from pdllm.kernels.split_s_hopper_ws import fit_stages

    asked: list[int] = []

    def shared_of(stages: int) -> int:
        asked.append(stages)
        return WS_SHARED[stages]

    assert fit_stages(3, shared_of, H100_SMEM) == 2 and asked == [3, 2]
    asked.clear()
    assert fit_stages(2, shared_of, H100_SMEM) == 2 and asked == [2]  # no compile beyond the ask
    assert fit_stages(3, shared_of, 150_000) == 1
    assert fit_stages(3, shared_of, 101_376) is None  # an sm_86-sized opt-in limit


def test_auto_stages_from_a_fake_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import torch

    from pdllm.kernels import resources
    from pdllm.kernels import split_s_hopper as sh

    optin = {"bytes": 232_448}
    fake = lambda index: types.SimpleNamespace(shared_memory_per_block_optin=optin["bytes"])  # noqa: E731
    monkeypatch.setattr(torch.cuda, "get_device_properties", fake)
    resources.reset()
    sh.reset()
    compiles: list[int] = []

    def shared_of(stages: int) -> int:
        compiles.append(stages)
        return WS_SHARED[stages]

    dev = torch.device("cuda", 0)
    try:
        assert sh.ws_stages(("lq96", 3), 3, dev, shared_of) == 2
        assert sh.ws_stages(("lq96", 3), 3, dev, shared_of) == 2 and compiles == [3, 2]  # cached per key
        assert sh.ws_stages(("lq32", 2), 2, dev, shared_of) == 2
        optin["bytes"] = 101_376
        resources.reset()
        with pytest.raises(RuntimeError, match="shared memory"):
            sh.ws_stages(("small", 3), 3, dev, shared_of)
    finally:
        resources.reset()
        sh.reset()


def test_ab_harness_smoke(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("PDLLM_SPLIT_S_TABLE", None)
    cmd = [sys.executable, str(ROOT / "benchmarks/split_s_hopper_ab.py"), "--smoke", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "split_s_hopper_ab.json").read_text())
    assert {"device", "date", "command", "triton", "torch"} <= set(report["meta"])
    assert len(report["cells"]) == 2 and not report["skipped"]
    for cell in report["cells"]:
        k = cell["kernels"]
        assert set(k) == {"today", "hopper_auto", "hopper_tma"}, cell
        assert all("error" not in e and e["max_abs_err"] < 2e-3 for e in k.values()), cell
        assert k["hopper_auto"]["tma"] and k["hopper_auto"]["ws"] and k["hopper_auto"]["ok"]
        assert k["hopper_tma"]["tma"] and not k["hopper_tma"]["ws"] and k["hopper_tma"]["ok"]
    md = (tmp_path / "split_s_hopper_ab.md").read_text()
    assert "| cell | today µs | auto µs |" in md and "ragged 3 req" in md


def test_ab_harness_records_failures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks import split_s_hopper_ab as ab

    def broken(name: str, *_: object) -> object:
        def launch() -> None:
            raise RuntimeError(f"{name} refused")

        return launch

    monkeypatch.setattr(ab, "launcher", broken)
    assert ab.main(["--smoke", "--out", str(tmp_path), "--budget-s", "0"]) == 0
    report = json.loads((tmp_path / "split_s_hopper_ab.json").read_text())
    (cell,) = report["cells"]  # the budget (0 s) skips the second cell; the first always runs
    assert report["skipped"] == [ab.SMOKE_GRID[1].name]
    for name, entry in cell["kernels"].items():
        assert entry["error"] == f"RuntimeError: {name} refused" and "us" not in entry
    md = (tmp_path / "split_s_hopper_ab.md").read_text()
    assert "hopper_tma: RuntimeError: hopper_tma refused" in md and "Skipped (time budget)" in md
