"""One attention cell run under a profiler: warm-up calls, then ``--calls`` calls inside
``cudaProfilerStart``/``Stop`` (run ``ncu --profile-from-start off`` around it to see only those).

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section ComputeWorkloadAnalysis \\
        python benchmarks/attention_profile.py --cell ragged0

Cells (bf16, 28/4 heads, d = 128, page 64, each entry's own rows as local keys, as decode rows attend):
``ragged0``-``ragged3`` are ``benchmarks/attention_ragged.RAGGED_CELLS``; ``b1`` is batch 1, Lq 32 over
4,096 KV slots (S 4, C 1024); ``b16lq96`` is 16 entries of Lq 96 over 32,768 slots each. The call is
``kernels.ragged_attention.ragged_attention`` with the Triton kernel (``$PDLLM_SPLIT_S`` and
``$PDLLM_SPLIT_S_TABLE`` apply as in serving). Without CUDA it runs the torch kernel once (a smoke check).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.attention_ragged import PAGE, RAGGED_CELLS, RaggedCase, RaggedCell  # noqa: E402

CELLS = {
    **{f"ragged{i}": c for i, c in enumerate(RAGGED_CELLS)},
    "b1": RaggedCell("batch 1, Lq 32, KV 4096", (32,), (4096,)),
    "b16lq96": RaggedCell("16 x Lq 96, KV 32768", (96,) * 16, (32768,) * 16),
}
SMOKE = RaggedCell("smoke", (3, 5), (70, 130))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", choices=sorted(CELLS), default="b1")
    ap.add_argument("--warm", type=int, default=3, help="calls before the profiled range (compiles, caches)")
    ap.add_argument("--calls", type=int, default=2, help="calls inside the profiled range")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        case = RaggedCase(CELLS[a.cell], 28, 4, 128, torch.bfloat16, "cuda", PAGE)
    else:
        case = RaggedCase(SMOKE, 4, 2, 32, torch.float32, "cpu", PAGE)
    kernel = "triton" if cuda else "torch"
    for _ in range(a.warm if cuda else 0):
        case.ragged(kernel)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
    for _ in range(a.calls if cuda else 1):
        out = case.ragged(kernel)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    err = float((out.float() - case.sdpa(torch.float32)).abs().max())
    print(
        f"{case.cell.name}: {len(case.cell.rows)} entries, {sum(case.cell.rows)} rows, max abs err {err:.2e}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
