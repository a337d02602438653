"""``pdllm eval``: exact-match accuracy over context length x needle depth, vanilla vs pdllm.

Reproduces the paper's lost-in-the-middle experiment (§6.4, Figure 6) on the shipped model: for each
task, length (multiples of the training length) and gold-fact depth, ``--samples`` seeded samples are
answered by each method and scored by exact match. Writes ``<out>/<name>.json`` (top-level
``train_length``; one row per method/task/length/depth), a Markdown table and one heatmap PNG per task
with the methods side by side. ``--decode-policy`` (and its knobs, from the settings schema) runs every
method's decode under that policy (``shared/generation/policies``), named in the header and the rows.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from pdllm.shared import settings as schema
from pdllm.shared.config import EngineConfig
from pdllm.shared.eval.report import METHODS, write_heatmaps, write_tables
from pdllm.shared.eval.tasks import TASKS, Sample, make_sample
from pdllm.shared.generation.policies import DecodePolicyConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.generation.vanilla import generate_vanilla
from pdllm.shared.model.loader import LoadedModel, load_model
from pdllm.shared.model.sdar import check_runnable
from pdllm.shared.prompt import encode_prompt


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
    decode_policy: DecodePolicyConfig = DecodePolicyConfig()  # both methods' decode (none: the plain loops)

    def engine_config(self, loaded: LoadedModel, train_length: int, query_tokens: int) -> EngineConfig:
        model = loaded.serving.engine
        c = self.chunk_size or model.get("chunk_size") or max(train_length // 4, 16)
        k = (
            self.top_k
            or model.get("top_k")
            or max(1, (train_length - query_tokens - self.gen_length) // (c + 1))
        )
        return EngineConfig.from_settings(
            model,
            chunk_size=c,
            top_k=k,
            score_mode=self.score_mode,
            kv_mode=self.kv_mode,
            chunk_boundary=self.chunk_boundary,
        )


Answerer = Callable[[Sample], str]


def make_answerer(loaded: LoadedModel, method: str, settings: EvalSettings, train_length: int) -> Answerer:
    """A function sample -> decoded answer text for ``method`` on ``loaded``."""
    tok = loaded.tokenizer
    gen = GenerationConfig(
        gen_length=settings.gen_length, steps=settings.gen_length, block_length=settings.block_length
    )
    gen.validate()
    policy = settings.decode_policy
    if method == "vanilla":

        def vanilla(sample: Sample) -> str:
            ids = encode_prompt(tok, sample.context, sample.question)
            out = generate_vanilla(loaded.model, ids.vanilla(loaded.config.bos_token_id), gen, policy=policy)
            return tok.decode(out.token_ids, skip_special_tokens=True)

        return vanilla
    if method != "pdllm":
        raise ValueError(f"unknown method {method!r} (expected one of {', '.join(METHODS)})")
    from pdllm.shared.app.engine import PrefillingEngine

    engines: dict[EngineConfig, PrefillingEngine] = {}

    def pdllm(sample: Sample) -> str:
        ids = encode_prompt(tok, sample.context, sample.question)
        cfg = settings.engine_config(loaded, train_length, len(ids.query))
        if cfg not in engines:
            engines[cfg] = PrefillingEngine(loaded.model, tok, cfg)
        out, _ = engines[cfg].generate(ids.context, ids.query, gen, decode_policy=policy)
        return tok.decode(out.token_ids, skip_special_tokens=True)

    return pdllm


def exact_match(prediction: str, answer: str) -> bool:
    return prediction.strip() == answer.strip()


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
) -> list[dict]:
    """Rows for every cell; ``on_cell(rows so far)`` runs after each cell so long runs keep partial results."""
    answerers = {m: make_answerer(loaded, m, settings, train_length) for m in methods}
    rows: list[dict] = []
    total = len(methods) * len(tasks) * len(lengths) * len(depths) * samples
    with tqdm(total=total, disable=not progress, desc="eval", unit="sample", file=sys.stderr) as bar:
        for task in tasks:
            for length in lengths:
                for depth in depths:
                    cell = [
                        make_sample(task, length, depth, seed, loaded.tokenizer) for seed in range(samples)
                    ]
                    for method in methods:
                        start = time.perf_counter()
                        hits = 0
                        for s in cell:
                            hits += exact_match(answerers[method](s), s.answer)
                            bar.update(1)
                        rows.append(
                            {
                                "method": method,
                                "decode_policy": settings.decode_policy.name,
                                "task": task,
                                "context_length": length,
                                "depth": depth,
                                "accuracy": hits / samples,
                                "samples": samples,
                                "seconds": round(time.perf_counter() - start, 3),
                            }
                        )
                    bar.set_postfix_str(
                        " ".join(f"{r['method']}={r['accuracy']:.2f}" for r in rows[-len(methods) :])
                    )
                    if on_cell is not None:
                        on_cell(rows)
    return rows


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _describe(policy: DecodePolicyConfig) -> str:
    """The policy and the knobs set, e.g. ``sparse-dllm retention=0.25``."""
    knobs = ("refresh_steps", "retention", "pool_kernel", "delay_steps")
    return " ".join([policy.name, *(f"{k}={v}" for k in knobs if (v := getattr(policy, k)) is not None)])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdllm eval", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--methods", default="vanilla,pdllm")
    p.add_argument("--tasks", default="needle,multidoc")
    p.add_argument(
        "--train-length",
        type=int,
        default=None,
        help="default: the checkpoint's pdllm.json, else its max positions",
    )
    p.add_argument("--length-multiples", default="0.5,1,2,4,8,16", help="context lengths / train length")
    p.add_argument("--depths", default="0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0")
    p.add_argument("--samples", type=int, default=20, help="samples per (length, depth) cell")
    p.add_argument("--gen-length", type=int, default=8)
    p.add_argument("--block-length", type=int, default=None, help="default: one block of --gen-length")
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--score-mode", default=None, choices=["pseudo-label", "self-info", "query-only"])
    p.add_argument("--kv-mode", default=None, choices=["full-mask", "chunk-query", "chunk-only"])
    p.add_argument(
        "--chunk-boundary", default=None, choices=["fixed", "sentence"], help="default: the model's"
    )
    # --decode-policy and its knobs: flag, choices, help and PDLLM_<FLAG> from the settings schema.
    schema.add_arguments(p.add_argument_group("decode policy (both methods)"), schema.DecodePolicySettings)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="longctx_eval")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    tasks = [t for t in args.tasks.split(",") if t]
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r} (expected one of {', '.join(METHODS)})")
    for t in tasks:
        if t not in TASKS:
            raise ValueError(f"unknown task {t!r} (expected one of {', '.join(TASKS)})")
    if args.samples <= 0:
        raise ValueError("--samples must be positive")
    # Checked before a long model load, named as the flags that set them.
    gen = {"gen_length": args.gen_length, "steps": args.gen_length, "block_length": args.block_length}
    schema.generation_config({k: v for k, v in gen.items() if v is not None}, label=schema.flag_label())
    given = schema.from_args(args, schema.DecodePolicySettings)
    policy = schema.decode_policy_config(given, label=schema.flag_label())
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    check_runnable(loaded.config.family, "eval")
    if loaded.tokenizer is None:
        raise ValueError(f"{loaded.path}: evaluation needs a tokenizer")
    train_length = args.train_length or loaded.serving.train_length or loaded.config.max_position_embeddings
    lengths = [int(round(m * train_length)) for m in _floats(args.length_multiples)]
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
    }

    def save(rows: list[dict]) -> Path:
        return write_tables(
            rows, {**header, "seconds": round(time.perf_counter() - start, 1)}, args.out, args.name
        )

    rows = run_grid(
        loaded,
        methods,
        tasks,
        lengths,
        _floats(args.depths),
        args.samples,
        settings,
        train_length,
        on_cell=save,
    )
    table = save(rows)
    for path in write_heatmaps(rows, args.out, args.name):
        print(f"wrote {path}", file=sys.stderr)
    print(table.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
