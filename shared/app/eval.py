"""``pdllm eval``: accuracy over context length x gold depth (retrieval, long answers), vanilla vs pdllm.

Reproduces the paper's lost-in-the-middle experiment (§6.4, Figure 6) on the shipped model: for each
task, length (multiples of the training length) and gold-fact depth, ``--samples`` seeded samples are
answered by each method and scored by exact match. Writes ``<out>/<name>.json`` (top-level
``train_length``; one row per method/task/length/depth), a Markdown table and one heatmap PNG per task
with the methods side by side. ``--decode-policy`` (and its knobs, from the settings schema) runs every
method's decode under that policy (``decode_service/policies``), named in the header and the rows.

``--tasks long-answer`` (``shared/eval/long_answer.py``) asks for a planted 128-256-token
paragraph verbatim: rows score the exact-passage rate (``accuracy``) and ``token_accuracy``; its generation
length is sized per sample (passage + EOS rounded up to whole blocks of ``--block-length``, else of 32), so
``--gen-length`` applies to the short-answer tasks only. ``--agreement`` decodes every sample a second time
with policy ``none`` and adds ``agreement``: the share of answer tokens the policy's decoding shares with
the no-cache one (by definition 1 under ``none``, where nothing is decoded twice). ``--tasks infilling``
(``shared/eval/infilling.py``) cuts a 64-256-token span out of a held-out prose document (the prose corpus
must be built: ``shared/training/PROSE.md``) and asks for it back: rows score the exact-span rate
(``accuracy``) and ``token_accuracy`` against the span's own tokens; its generation length is sized per
sample as long-answer's.

``--threshold T`` decodes with Fast-dLLM's confidence threshold (``GenerationConfig.threshold``): each step
unmasks every masked position of the current block whose confidence is above ``T``, at least one (its
most confident); ``steps`` is then no schedule (the sampler runs until each block is unmasked), so it is
set to the generation length as without one. Unset: one token per step. A comma list
(``none,0.7,0.8,0.9``; ``none``: one token per step) runs the grid once per value, into one report. Every
row carries its ``threshold`` (None: one token per step) and ``tpf``, tokens per forward: the cell's answer
tokens up to and including each sample's first EOS (slots after it excluded) over the denoising steps of
its decodes, one model forward per step (``shared/eval/tpf.py`` says what is and is not counted), with the
sums ``tokens`` and ``forwards`` it pools. ``--traces FILE``
writes one JSON line per decoded sample: its cell, the expected answer, and the response with its trace in
the fields ``generate --json`` and ``ask --json`` print (``shared/rpc/trace_format.py``).
``--record-schedule FILE`` writes every decoded sample's unmask schedule (tokens unmasked at each step,
per block) with its cell, TPF and decode policy's counters: what ``GenerationConfig.schedule`` and
``benchmarks/decode_engine.py --schedule`` replay (``shared/generation/schedule.py``).
``--eval-batch N`` denoises a cell's decodes N at a time in the same rounds (``eval_batch.py``); the rows
do not depend on it.

SDAR (block-diffusion) checkpoints: vanilla decodes by block diffusion, pdllm by block diffusion over the
selected chunks (``decode_service/sdar_decode.py``), either plain or under ``--decode-policy focus``;
``--block-length`` must be a multiple of the model's block size, and pdllm's chunk-only, top-B and decode
policies other than focus are refused before the first sample. FOCUS runs on SDAR only: on a Dream/LLaDA
checkpoint ``--decode-policy focus`` is refused before the first sample too.

This module checks the flags, loads the model and writes the reports; the flags are declared in
``eval_args.py``, the tasks, settings and samples in ``eval_settings.py``, and the grid that decodes and
scores each cell in ``eval_grid.py``.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from pdllm.decode_service import sdar_decode
from pdllm.decode_service.sessions import check_policy_family
from pdllm.shared import settings as schema
from pdllm.shared import settings_flags
from pdllm.shared.app.eval_args import build_parser
from pdllm.shared.app.eval_grid import run_grid
from pdllm.shared.app.eval_settings import EVAL_TASKS, LONG_ANSWER_ROUND, PER_SAMPLE_LENGTH, EvalSettings
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.eval.infilling import INFILLING
from pdllm.shared.eval.long_answer import LONG_ANSWER, PASSAGE_TOKENS
from pdllm.shared.eval.report import METHODS, write_heatmaps, write_tables
from pdllm.shared.eval.tpf import TPF_NOTE, parse_thresholds, threshold_header
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.generation.schedule import write_schedules
from pdllm.shared.model.loader import LoadedModel, load_model


def _check_sdar(
    loaded: LoadedModel, methods: list[str], settings: EvalSettings, train_length: int, gen: GenerationConfig
) -> None:
    """SDAR: vanilla is block diffusion over the whole prompt, pdllm over the selected chunks (both exact;
    ``decode_service/sdar_decode.py``). Refuse what they do not run: a block length off the model's
    blocks; for pdllm chunk-only, top-B and decode policies other than none and focus (vanilla's policies:
    ``DecodeWorker.vanilla``)."""
    sdar_decode.check_generation(gen, loaded.model)
    if "pdllm" in methods:
        sdar_decode.check_config(settings.engine_config(loaded, train_length, 16), None, loaded.model)
        sdar_decode.check_decode_options(settings.decode_policy, None)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _describe(policy: DecodePolicyConfig) -> str:
    """The policy and the knobs set, e.g. ``sparse-dllm retention=0.25``."""
    knobs = ("refresh_steps", "retention", "pool_kernel", "delay_steps")
    set_knobs = [f"{k}={v}" for k in knobs if (v := getattr(policy, k)) is not None]
    # The knob groups are keyed by setting name (polestar_clusters=2, dyllm_threshold=0.9, ...).
    groups = {**policy.polestar, **policy.dyllm, **policy.focus}
    return " ".join([policy.name, *set_knobs, *(f"{k}={v}" for k, v in groups.items())])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    tasks = [t for t in args.tasks.split(",") if t]
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r} (expected one of {', '.join(METHODS)})")
    for t in tasks:
        if t not in EVAL_TASKS:
            raise ValueError(f"unknown task {t!r} (expected one of {', '.join(EVAL_TASKS)})")
    if not tasks:
        raise ValueError(f"--tasks is empty (expected some of {', '.join(EVAL_TASKS)})")
    if args.samples <= 0:
        raise ValueError("--samples must be positive")
    if args.eval_batch <= 0:
        raise ValueError("--eval-batch must be positive")
    thresholds = parse_thresholds(args.threshold)
    # Checked before a long model load, named as the flags that set them. Long-answer and infilling size
    # their generation length themselves, in whole blocks: only the block length is checked for them.
    n = args.gen_length if set(tasks) - set(PER_SAMPLE_LENGTH) else args.block_length or LONG_ANSWER_ROUND
    gen = {"gen_length": n, "steps": n, "block_length": args.block_length}
    schema.generation_config(
        {k: v for k, v in gen.items() if v is not None}, label=settings_flags.flag_label()
    )
    given = settings_flags.from_args(args, schema.DecodePolicySettings)
    policy = schema.decode_policy_config(given, label=settings_flags.flag_label())
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    if loaded.tokenizer is None:
        raise ValueError(f"{loaded.path}: evaluation needs a tokenizer")
    train_length = args.train_length or loaded.serving.train_length or loaded.config.max_position_embeddings
    lengths = [int(round(m * train_length)) for m in _floats(args.length_multiples)]
    short = [n for n in lengths if n < PASSAGE_TOKENS[1]]
    if LONG_ANSWER in tasks and short:
        raise ValueError(
            f"{LONG_ANSWER} needs contexts of at least {PASSAGE_TOKENS[1]} tokens (one passage); --length-multiples"
            f" {args.length_multiples} x train length {train_length} gives {', '.join(map(str, short))}"
        )
    settings = EvalSettings(
        gen_length=args.gen_length,
        chunk_size=args.chunk_size,
        top_k=args.top_k,
        score_mode=args.score_mode,
        kv_mode=args.kv_mode,
        chunk_boundary=args.chunk_boundary,
        block_length=args.block_length,
        decode_policy=policy,
    )
    if sdar_decode.is_block_diffusion(loaded.model):  # refused before the first sample, not after it
        _check_sdar(loaded, methods, settings, train_length, GenerationConfig(**gen))
    else:
        check_policy_family(settings.decode_policy, loaded.model)
    start = time.perf_counter()
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    e = settings.engine_config(loaded, train_length, 16)
    header = {
        "title": f"Long-context retrieval: {', '.join(methods)} on {loaded.path.name}",
        "model": loaded.config.model_id,
        "train_length": train_length,
        "device": device,
        "date": dt.date.today().isoformat(),
        "command": "pdllm eval " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "pdllm": f"chunk_size={e.chunk_size} top_k~{e.top_k} score_mode={e.score_mode} kv_mode={e.kv_mode}"
        f" chunk_boundary={e.chunk_boundary}",
        "decode_policy": _describe(policy),
        "threshold": threshold_header(thresholds),
        "tpf": TPF_NOTE,
    }
    if LONG_ANSWER in tasks:
        block = args.block_length or LONG_ANSWER_ROUND
        header[LONG_ANSWER] = f"gen length per sample: passage + EOS rounded up to a multiple of {block}"
    if INFILLING in tasks:
        block = args.block_length or LONG_ANSWER_ROUND
        header[INFILLING] = (
            f"held-out prose, a 64-256-token span replaced by [BLANK]; gen length per sample: span + EOS "
            f"rounded up to a multiple of {block}; token accuracy against the span's tokens"
        )
    if args.agreement:
        header["agreement"] = "token agreement with the same method decoded under --decode-policy none"

    schedules: list[dict] = []

    def save(rows: list[dict]) -> Path:
        if args.record_schedule is not None:  # with the tables, so a cut run keeps its schedules too
            keys = ("title", "model", "train_length", "device", "date", "command", "decode_policy")
            write_schedules(args.record_schedule, {k: header[k] for k in keys}, schedules)
        return write_tables(
            rows, {**header, "seconds": round(time.perf_counter() - start, 1)}, args.out, args.name
        )

    traces = None
    if args.traces is not None:
        args.traces.parent.mkdir(parents=True, exist_ok=True)
        traces = args.traces.open("w", encoding="utf-8")
    rows: list[dict] = []
    try:
        for threshold in thresholds:  # one grid per value; the report holds them all
            before = list(rows)

            def on_cell(cell_rows: list[dict], before: list[dict] = before) -> None:
                save(before + cell_rows)

            rows = before + run_grid(
                loaded,
                methods,
                tasks,
                lengths,
                _floats(args.depths),
                args.samples,
                replace(settings, threshold=threshold),
                train_length,
                on_cell=on_cell,
                agreement=args.agreement,
                on_trace=None if traces is None else lambda record: print(json.dumps(record), file=traces),
                on_schedule=None if args.record_schedule is None else schedules.append,
                eval_batch=args.eval_batch,
            )
    finally:
        if traces is not None:
            traces.close()
    table = save(rows)
    for path in write_heatmaps(rows, args.out, args.name):
        print(f"wrote {path}", file=sys.stderr)
    print(table.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
