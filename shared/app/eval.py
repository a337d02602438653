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
policies other than focus are refused before the first sample.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from pdllm.decode_service import sdar_decode
from pdllm.decode_service.worker import DecodeWorker
from pdllm.shared import settings as schema
from pdllm.shared.app.eval_batch import BatchDecoder, Decoded, Item
from pdllm.shared.cli_args import Parser
from pdllm.shared.config import EngineConfig
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.eval.infilling import INFILLING, InfillSample, infill_gen_length, score_infill
from pdllm.shared.eval.infilling import make_eval_sample as make_infill_sample
from pdllm.shared.eval.long_answer import (
    LONG_ANSWER,
    PASSAGE_TOKENS,
    LongAnswerSample,
    answer_gen_length,
    make_eval_sample,
    score_passage,
    token_agreement,
)
from pdllm.shared.eval.report import METHODS, write_heatmaps, write_tables
from pdllm.shared.eval.tasks import TASKS, Sample, make_sample
from pdllm.shared.eval.tpf import TPF_NOTE, answer_tokens, parse_thresholds, threshold_header, tpf
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.generation.schedule import sample_record, write_schedules
from pdllm.shared.model.loader import LoadedModel, load_model
from pdllm.shared.rpc.trace_format import message_json

EVAL_TASKS = (*TASKS, LONG_ANSWER, INFILLING)
# Tasks whose generation length is sized per sample (the rest use --gen-length).
PER_SAMPLE_LENGTH = (LONG_ANSWER, INFILLING)
# Long-answer and infilling generation lengths are whole multiples of this where no --block-length is given.
LONG_ANSWER_ROUND = 32
AnySample = Sample | LongAnswerSample | InfillSample


@dataclass(frozen=True)
class EvalSettings:
    """pdllm's settings; None = the checkpoint's pdllm.json, else the rules below / EngineConfig's."""

    gen_length: int = 8
    chunk_size: int | None = None  # else: train_length // 4
    top_k: int | None = None  # else: as many chunks as fit in the training length with the query
    score_mode: str | None = None
    kv_mode: str | None = None
    chunk_boundary: str | None = None
    block_length: int | None = None  # None: one block of gen_length
    threshold: float | None = None  # None: one token per step; else unmask every position above it
    decode_policy: DecodePolicyConfig = DecodePolicyConfig()  # both methods' decode (none: the plain loops)

    def engine_config(
        self, loaded: LoadedModel, train_length: int, query_tokens: int, gen_length: int | None = None
    ) -> EngineConfig:
        model = loaded.serving.engine
        c = self.chunk_size or model.get("chunk_size") or max(train_length // 4, 16)
        gen = gen_length or self.gen_length
        k = self.top_k or model.get("top_k") or max(1, (train_length - query_tokens - gen) // (c + 1))
        return EngineConfig.from_settings(
            model,
            chunk_size=c,
            top_k=k,
            score_mode=self.score_mode,
            kv_mode=self.kv_mode,
            chunk_boundary=self.chunk_boundary,
        )


# (sample, generation settings, decode policy) -> answer token ids, trimmed at EOS.
Decoder = Callable[[AnySample, GenerationConfig, DecodePolicyConfig], list[int]]


def generation(settings: EvalSettings, tokenizer: object, sample: AnySample) -> GenerationConfig:
    """The sample's generation settings: the flags', or for long-answer (infilling) its passage's (span's)
    length in blocks. One step per answer token, or under a threshold as many as its confidences take
    (``steps`` is then unused by the sampler)."""
    n = settings.gen_length
    if isinstance(sample, LongAnswerSample):
        n = answer_gen_length(tokenizer, sample, settings.block_length or LONG_ANSWER_ROUND)
    elif isinstance(sample, InfillSample):
        n = infill_gen_length(sample, settings.block_length or LONG_ANSWER_ROUND)
    gen = GenerationConfig(
        gen_length=n, steps=n, block_length=settings.block_length, threshold=settings.threshold
    )
    gen.validate()
    return gen


def make_decoder(loaded: LoadedModel, method: str, settings: EvalSettings, train_length: int) -> Decoder:
    """A function (sample, generation, policy) -> answer token ids for ``method`` on ``loaded``, one
    decode at a time (``eval_batch.py`` decodes several together)."""
    batch = BatchDecoder(loaded, method, settings, train_length)

    def decode(sample: AnySample, gen: GenerationConfig, policy: DecodePolicyConfig) -> list[int]:
        (out,) = batch.decode([Item(sample, gen, policy)])
        return out.result.token_ids

    return decode


def exact_match(prediction: str, answer: str) -> bool:
    return prediction.strip() == answer.strip()


def eval_sample(task: str, length: int, depth: float, seed: int, tokenizer: object) -> AnySample:
    if task == LONG_ANSWER:
        return make_eval_sample(tokenizer, length, depth, seed)
    if task == INFILLING:
        return make_infill_sample(tokenizer, length, depth, seed)
    return make_sample(task, length, depth, seed, tokenizer)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def run_grid(
    loaded: LoadedModel,
    methods: list[str],
    tasks: list[str],
    lengths: list[int],
    depths: list[float],
    samples: int,
    settings: EvalSettings,
    train_length: int,
    progress: bool = True,
    on_cell: Callable[[list[dict]], None] | None = None,
    agreement: bool = False,
    on_trace: Callable[[dict], None] | None = None,
    on_schedule: Callable[[dict], None] | None = None,
    eval_batch: int = 1,
) -> list[dict]:
    """Rows for every cell; ``on_cell(rows so far)`` runs after each cell so long runs keep partial results.
    ``agreement``: also decode with policy ``none`` and report the share of tokens both decodings share.
    ``on_trace``: called with each sample's record (cell, expected answer, response with its trace).
    Each row carries the settings' ``threshold`` and the cell's ``tpf`` (``shared/eval/tpf.py``): its
    samples' answer tokens (up to and including the first EOS) over their decodes' steps, both summed
    (``tokens``, ``forwards``); the agreement reference decodes are not counted. ``on_schedule``: called
    with each sample's unmask schedule record (``schedule.sample_record``). ``eval_batch``: a cell's decodes
    (agreement references included) denoised that many at a time in the same rounds (``eval_batch.py``;
    the rows do not depend on it)."""
    if eval_batch <= 0:
        raise ValueError(f"--eval-batch must be positive (got {eval_batch})")
    tok = loaded.tokenizer
    eos, mask = loaded.config.eos_token_id, loaded.config.mask_token_id
    worker = DecodeWorker(loaded.model)  # one pool and round forward for every method's decodes
    traced = on_trace is not None
    decoders = {m: BatchDecoder(loaded, m, settings, train_length, traced, worker) for m in methods}
    policy = settings.decode_policy
    twice = agreement and policy.name != "none"  # under none the reference is the decoding itself
    rows: list[dict] = []
    total = len(methods) * len(tasks) * len(lengths) * len(depths) * samples * (2 if twice else 1)
    with tqdm(total=total, disable=not progress, desc="eval", unit="decode", file=sys.stderr) as bar:
        for task in tasks:
            for length in lengths:
                for depth in depths:
                    cell = [eval_sample(task, length, depth, seed, tok) for seed in range(samples)]
                    for method in methods:
                        start = time.perf_counter()
                        exact: list[float] = []
                        token_acc: list[float] = []
                        agree: list[float] = []
                        tokens = forwards = 0
                        items: list[Item] = []
                        for seed, s in enumerate(cell):  # each sample's decode, then its reference
                            gen = generation(settings, tok, s)
                            label = f"{task} length={length} depth={depth} seed={seed}"
                            items.append(Item(s, gen, policy, f"{label} policy={policy.name}"))
                            if twice:
                                items.append(Item(s, gen, DecodePolicyConfig(), f"{label} policy=none"))
                        decoded: list[Decoded] = []
                        for i in range(0, len(items), eval_batch):
                            decoded += decoders[method].decode(items[i : i + eval_batch])
                            bar.update(len(items[i : i + eval_batch]))
                        per = 2 if twice else 1
                        for seed, s in enumerate(cell):
                            gen = items[seed * per].gen
                            out = decoded[seed * per]
                            result = out.result
                            ids = result.token_ids
                            produced = answer_tokens(result.raw_tokens, eos, mask)
                            tokens += produced
                            forwards += result.steps  # its own steps, however many shared its rounds
                            if on_schedule is not None:
                                where = {"method": method, "decode_policy": policy.name}
                                where |= {"threshold": settings.threshold, "task": task}
                                where |= {"context_length": length, "depth": depth, "seed": seed}
                                record = sample_record(
                                    where,
                                    result.unmasked,
                                    gen.gen_length,
                                    gen.block,
                                    produced,
                                    result.cache,
                                    loaded.config.num_layers,
                                )
                                on_schedule(record)
                            text = tok.decode(ids, skip_special_tokens=True)
                            if isinstance(s, LongAnswerSample):
                                score = score_passage(tok, text, s.answer)
                                exact.append(score.exact)
                                token_acc.append(score.token_accuracy)
                            elif isinstance(s, InfillSample):
                                score = score_infill(ids, s.answer_ids)
                                exact.append(score.exact)
                                token_acc.append(score.token_accuracy)
                            else:
                                exact.append(exact_match(text, s.answer))
                            if on_trace is not None and out.response is not None:
                                record = {
                                    "task": task,
                                    "context_length": length,
                                    "depth": depth,
                                    "seed": seed,
                                    "expected": s.answer,
                                    "exact": bool(exact[-1]),
                                    "response": message_json(out.response),
                                }
                                if settings.threshold is not None:  # one-token-per-step records: as ever
                                    record["threshold"] = settings.threshold
                                on_trace(record)
                            if twice:
                                ref = decoded[seed * per + 1].result.token_ids
                                agree.append(token_agreement(ids, ref))
                            elif agreement:
                                agree.append(1.0)
                        row = {
                            "method": method,
                            "decode_policy": policy.name,
                            "threshold": settings.threshold,
                            "task": task,
                            "context_length": length,
                            "depth": depth,
                            "accuracy": _mean(exact),
                            "tpf": None if (v := tpf(tokens, forwards)) is None else round(v, 4),
                            "tokens": tokens,
                            "forwards": forwards,
                            "samples": samples,
                            "seconds": round(time.perf_counter() - start, 3),
                        }
                        if token_acc:
                            row["token_accuracy"] = round(_mean(token_acc), 4)
                        if agree:
                            row["agreement"] = round(_mean(agree), 4)
                        rows.append(row)
                    bar.set_postfix_str(
                        " ".join(
                            f"{r['method']}={r['accuracy']:.2f} tpf={r['tpf'] or 0:.2f}"
                            for r in rows[-len(methods) :]
                        )
                    )
                    if on_cell is not None:
                        on_cell(rows)
    return rows


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
    schema.add_arguments(d, schema.DecodePolicySettings)
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
    schema.generation_config({k: v for k, v in gen.items() if v is not None}, label=schema.flag_label())
    given = schema.from_args(args, schema.DecodePolicySettings)
    policy = schema.decode_policy_config(given, label=schema.flag_label())
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
