"""``pdllm eval``'s flags: model, grid, generation, pdllm method, decode policy (from the settings schema)
and output options.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from pdllm.shared import settings as schema
from pdllm.shared import settings_flags
from pdllm.shared.app.eval_settings import EVAL_TASKS
from pdllm.shared.cli_args import Parser
from pdllm.shared.eval.report import METHODS


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="pdllm eval",
        usage="%(prog)s [--methods M,...] [--tasks T,...] [--length-multiples X,...] [--samples N] [FLAG ...]",
        description="pdllm eval: long-context accuracy, vanilla vs pdllm, over context length x depth of the "
        "gold fact; writes JSON, Markdown and heatmaps.",
    )
    m = p.add_argument_group("model")
    m.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    m.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu, cuda or cuda:N (default: cuda where there is one, else cpu)",
    )
    m.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights' dtype"
    )
    g = p.add_argument_group("grid")
    g.add_argument("--methods", default="vanilla,pdllm", help=f"comma-separated: {', '.join(METHODS)}")
    g.add_argument("--tasks", default="needle,multidoc", help=f"comma-separated: {', '.join(EVAL_TASKS)}")
    g.add_argument(
        "--train-length",
        type=int,
        default=None,
        help="the model's training length (default: the checkpoint's pdllm.json, else its max positions)",
    )
    g.add_argument(
        "--length-multiples", default="0.5,1,2,4,8,16", help="comma-separated context lengths / train length"
    )
    g.add_argument(
        "--depths",
        default="0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0",
        help="comma-separated depths of the gold fact in the context (0: start, 1: end)",
    )
    g.add_argument("--samples", type=int, default=20, help="seeded samples per (length, depth) cell")
    g.add_argument(
        "--eval-batch",
        type=int,
        default=16,
        metavar="N",
        help="decode a cell's samples N at a time in the same denoising rounds, one forward per step for "
        "all N (the rows do not change; 1: one sample at a time)",
    )
    n = p.add_argument_group("generation")
    n.add_argument(
        "--gen-length",
        type=int,
        default=8,
        help="answer tokens of the short-answer tasks (long-answer, infilling: per sample)",
    )
    n.add_argument(
        "--block-length", type=int, default=None, help="block length (default: one block of --gen-length)"
    )
    n.add_argument(
        "--threshold",
        default=None,
        metavar="T[,T...]",
        help="confidence threshold in (0, 1]: each step unmasks every masked position of the block whose "
        "confidence is above T (at least one); a comma list runs the grid once per value, `none` in it "
        "one token per step (default: one token per step)",
    )
    e = p.add_argument_group("pdllm method")
    e.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="context tokens per chunk (default: the checkpoint's pdllm.json, else train length / 4)",
    )
    e.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="chunks kept (default: the checkpoint's pdllm.json, else as many as fit the train length)",
    )
    e.add_argument(
        "--score-mode",
        default=None,
        choices=["pseudo-label", "self-info", "query-only"],
        help="how chunks are scored (default: the checkpoint's, else pseudo-label)",
    )
    e.add_argument(
        "--kv-mode",
        default=None,
        choices=["full-mask", "chunk-query", "chunk-only"],
        help="what decoding attends to (default: the checkpoint's, else full-mask)",
    )
    e.add_argument(
        "--chunk-boundary",
        default=None,
        choices=["fixed", "sentence"],
        help="where chunks end (default: the checkpoint's, else fixed)",
    )
    # --decode-policy and its knobs: flag, choices, help and PDLLM_<FLAG> from the settings schema.
    d = p.add_argument_group("decode policy (both methods)")
    settings_flags.add_arguments(d, schema.DecodePolicySettings)
    d.add_argument(
        "--agreement",
        action="store_true",
        help="also decode with --decode-policy none; report the share of answer tokens both decodings share",
    )
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="directory of the reports")
    o.add_argument("--name", default="longctx_eval", help="file name stem of the reports")
    o.add_argument(
        "--traces",
        type=Path,
        default=None,
        help="also write one JSON line per decoded sample to this file: its cell, the expected answer and "
        "the response with its trace (the fields of `generate --json`)",
    )
    o.add_argument(
        "--record-schedule",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write every decoded sample's unmask schedule (tokens unmasked per step, per block) to "
        "this JSON file, for replay (benchmarks/decode_engine.py --schedule)",
    )
    return p
