"""Train the shipped model: ``python -m pdllm.shared.training.train --config <json> [--out DIR]``.

Writes ``DIR/checkpoint/`` (loadable by ``load_model``), ``DIR/train_log.jsonl``, ``DIR/loss_curve.png`` and
``DIR/summary.json``. With ``--max-minutes`` the cosine schedule is fitted to the time budget (steps/s is
measured over the first steps) and the checkpoint is written before the budget runs out, and every
``save_every_minutes`` while training, so a killed run still leaves a model behind.

Under ``torchrun --nproc_per_node N`` the model trains data-parallel (DDP, ``distributed.py``): each rank
draws its own batches of ``tokens_per_batch`` (the global batch is N times it) at the config's lr; rank 0
decides when to stop, logs, saves and writes the summary (``tokens`` counts every rank's).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..cli_args import Parser
from ..eval.tasks import TaskFactory, split_train_eval_sentences
from ..model.transformer import DiffusionLM
from .checkpoint_io import init_from, save
from .config import (
    CONFIG_DIR,
    TrainConfig,
    TrainConfigError,
    build_model_config,
    load_config,
    prose_path,
    smoke_variant,
    to_dict,
)
from .corpus import tokenize_haystack
from .data import Batch, BatchBuilder, BatchStream
from .distributed import DistEnv, agree, data_seed, gather, global_sum, setup, shutdown, weight_digest
from .objective import LossOutput, compute_loss
from .prose import read_documents, tokenize_prose
from .tokenizer import load_tokenizer
from .train_log import Meter, plot_curve

SAVE_RESERVE_S = 15.0
RESCHEDULE_AT = (
    60,
    200,
    600,
    1500,
    3000,
)  # time kept back at the end of a --max-minutes budget for the final save


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def _to_device(batch: Batch, device: torch.device) -> Batch:
    def move(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.to(device, non_blocking=True)

    return Batch(
        mode=batch.mode,
        ids=move(batch.ids),
        loss_region=move(batch.loss_region),
        answer_region=move(batch.answer_region),
        segments=move(batch.segments),
        sees_query=move(batch.sees_query),
        block_bounds=move(batch.block_bounds),
    )


class LossModule(torch.nn.Module):
    """``compute_loss`` as a module's forward: DDP syncs the gradients of what runs inside ``forward()``,
    and the loss reaches the model through ``hidden_states`` / ``lm_head``, not through its forward."""

    def __init__(self, model: torch.nn.Module, mask_id: int, eps: float) -> None:
        super().__init__()
        self.model, self.mask_id, self.eps = model, mask_id, eps

    def forward(self, batch: Batch, generator: torch.Generator) -> LossOutput:
        return compute_loss(self.model, batch, self.mask_id, self.eps, generator)


def train(
    cfg: TrainConfig,
    out: Path,
    max_minutes: float | None,
    device_name: str,
    progress: bool = True,
    start_from: Path | None = None,
    env: DistEnv | None = None,
) -> dict:
    """Train ``cfg`` into ``out``; ``env`` (from ``distributed.setup``) makes this one rank of a DDP job.
    Returns the summary (on ranks other than 0 too, though only rank 0 writes it)."""
    start = time.perf_counter()
    env = env or DistEnv()
    is_main = env.is_main
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    device = torch.device(device_name)
    tokenizer = load_tokenizer()
    train_sentences, _ = split_train_eval_sentences()
    haystack = tokenize_haystack(tokenizer, train_sentences)
    prose = tokenize_prose(tokenizer, read_documents(prose_path(cfg))) if cfg.data.prose_file else None
    builder = BatchBuilder(
        cfg.data, TaskFactory(tokenizer, haystack), tokenizer.bos_token_id, tokenizer.eos_token_id, prose
    )
    loader = torch.utils.data.DataLoader(
        BatchStream(builder, data_seed(cfg.seed, env.rank)),
        batch_size=None,
        num_workers=cfg.num_workers,
        pin_memory=device.type == "cuda",
        prefetch_factor=4 if cfg.num_workers else None,
        persistent_workers=cfg.num_workers > 0,
    )
    model_cfg = build_model_config(cfg, tokenizer)
    model = DiffusionLM(model_cfg)
    model.init_weights(cfg.seed)
    if start_from is not None:
        init_from(model, start_from)
    model.to(device)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        fused=device.type == "cuda",
    )
    forward_model = torch.compile(model) if cfg.compile else model
    loss_fn: torch.nn.Module = LossModule(forward_model, model_cfg.mask_token_id, cfg.mask_eps)
    if env.enabled:
        loss_fn = torch.nn.parallel.DistributedDataParallel(
            loss_fn, device_ids=[env.local_rank] if device.type == "cuda" else None
        )
    # Each rank's own masking noise too (rank 0: the single-process stream).
    gen = torch.Generator(device=device).manual_seed(data_seed(cfg.seed, env.rank))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    log_path = out / "train_log.jsonl"
    if is_main:
        log_path.write_text("")
    meter = Meter()
    total = cfg.max_steps
    budget = max_minutes * 60.0 - SAVE_RESERVE_S if max_minutes else None
    tokens_seen = 0
    last_save = time.perf_counter()
    t_probe: tuple[int, float] | None = None
    stats = {
        "world_size": env.world_size,
        "params": model.num_parameters(),
        "model_config": model_cfg.to_hf_dict(),
        "train_config": to_dict(cfg),
    }
    if start_from is not None:
        stats["init_from"] = str(start_from)
    if prose is not None:
        stats["prose"] = {"file": str(prose_path(cfg)), "tokens": prose.hay.num_tokens}
    bar = tqdm(
        total=total,
        disable=not (progress and is_main),
        desc="train",
        unit="step",
        mininterval=20,
        file=sys.stdout,
    )
    step = 0
    for step, batch in enumerate(loader):
        elapsed = time.perf_counter() - start
        stop = step >= total or (budget is not None and elapsed >= budget)
        if budget is not None and step == 10:
            t_probe = (step, elapsed)
        if not stop and budget is not None and t_probe is not None and step in RESCHEDULE_AT:
            # Fit the cosine schedule to the time budget; re-fitted as the data workers warm up.
            rate = (step - t_probe[0]) / max(elapsed - t_probe[1], 1e-6)
            total = min(cfg.max_steps, int(step + rate * (budget - elapsed) * 0.98))
            bar.total = total
        # Rank 0's clock decides for all: every rank takes the same number of steps.
        stop, total = agree(env, [int(stop), total])
        if stop:
            break
        lr = lr_at(step, total, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = _to_device(batch, device)
        with autocast:
            res = loss_fn(batch, gen)
        opt.zero_grad(set_to_none=True)
        res.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        tokens_seen += batch.ids.numel()
        if is_main:
            meter.add(batch.mode, res)
        if step % cfg.log_every == 0 or step == total - 1:
            tokens = global_sum(env, tokens_seen)  # every rank joins: `total` is agreed
            if is_main:
                rec = {
                    "step": step,
                    "lr": lr,
                    "elapsed_s": round(time.perf_counter() - start, 2),
                    "tokens": tokens,
                    "grad_norm": float(grad_norm),
                    "modes": meter.flush(),
                }
                with log_path.open("a") as fh:
                    fh.write(json.dumps(rec) + "\n")
                acc = {k: round(v["answer_acc"], 3) for k, v in rec["modes"].items() if "answer_acc" in v}
                bar.set_postfix(acc=acc, lr=f"{lr:.1e}")
        bar.update(1)
        # Only rank 0 saves; the others wait for it in the next step's collectives.
        if is_main and time.perf_counter() - last_save > cfg.save_every_minutes * 60:
            save(model, out, tokenizer, cfg.save_dtype)
            last_save = time.perf_counter()
    bar.close()
    tokens = global_sum(env, tokens_seen)
    if env.enabled:
        stats["rank_weight_digests"] = gather(env, weight_digest(model))
    path = save(model, out, tokenizer, cfg.save_dtype) if is_main else None
    stats.update(
        steps=step,
        planned_steps=total,
        tokens=tokens,
        seconds=round(time.perf_counter() - start, 1),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        checkpoint=str(path) if path else None,
    )
    if not is_main:
        return stats
    (out / "summary.json").write_text(json.dumps(stats, indent=2) + "\n")
    try:
        plot_curve(log_path, out / "loss_curve.png")
    except ImportError:
        print("matplotlib is not installed: no loss curve written", file=sys.stderr)
    return stats


def build_parser() -> Parser:
    parser = Parser(prog="pdllm train", description="pdllm train: train the small dLLM the project ships.")
    parser.add_argument("--config", type=Path, help="training config JSON (see shared/training/configs/)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny CPU run (configs/smoke.json), < 60 s; with --config: that config's data mix at smoke scale",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/train"), help="output directory")
    parser.add_argument("--max-minutes", type=float, default=None, help="wall-clock budget for training")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: the config's)")
    parser.add_argument(
        "--init-from",
        type=Path,
        default=None,
        metavar="DIR",
        help="start from this checkpoint's weights (same model shape) instead of a fresh init: a later stage",
    )
    parser.add_argument(
        "--max-steps", type=int, default=None, help="override the config's max_steps (short test runs)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config is None and not args.smoke:
        parser.error("give --config FILE or --smoke")
    try:
        cfg = load_config(args.config or CONFIG_DIR / "smoke.json")
        if args.smoke and args.config is not None:
            cfg = smoke_variant(cfg)
        if args.max_steps is not None:
            cfg = dataclasses.replace(cfg, max_steps=args.max_steps)
    except TrainConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    device = args.device or cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"error: device {device!r} requested but CUDA is not available", file=sys.stderr)
        return 2
    env, device = setup(device)
    try:
        stats = train(
            cfg,
            args.out,
            args.max_minutes,
            device,
            progress=not args.no_progress,
            start_from=args.init_from,
            env=env,
        )
    except TrainConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    shutdown(env)
    if env.is_main:
        print(json.dumps({k: stats[k] for k in ("params", "steps", "tokens", "seconds", "checkpoint")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
