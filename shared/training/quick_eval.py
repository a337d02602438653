"""Post-training check of the shipped model: needle exact match, vanilla vs a torch reference of pdllm.

``python -m pdllm.shared.training.quick_eval --model DIR --out results.json``. This is the training run's
own validation, not the project's evaluation (``pdllm eval``): the pdllm path here is a plain reference
(chunk, score by causal self-information + pseudo-label likelihood, keep the top-K chunks in their
original order, decode over [BOS chunk]... with intra-chunk attention for chunk tokens), written to tell
whether the model was trained for the engine's three uses.

A block-diffusion (SDAR) model decodes block by block instead (:func:`generate_block_causal`: blocks of the
model's block size aligned to absolute positions, the prompt's last partial block finished by the answer,
as ``decode_service/block_diffusion.py`` decodes), both for vanilla and over the kept chunks, which it reads
block-causally as one contiguous prompt (as ``decode_service/sdar_decode.py`` does).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..eval.tasks import make_sample, prompt_ids
from ..generation.plain import generate_plain, vanilla_logits_fn
from ..generation.sampler import DenoiseState, GenerationConfig, GenerationResult, denoise
from ..model.attention import DenseAttention
from ..model.loader import load_model
from ..model.transformer import DiffusionLM


@dataclass(frozen=True)
class PdllmSim:
    chunk_size: int
    top_k: int
    gen: GenerationConfig


def _decode_answer(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


@torch.inference_mode()
def chunk_scores(
    model: DiffusionLM, chunks: list[torch.Tensor], query: torch.Tensor, label: torch.Tensor | None
):
    """Mean causal NLL of query (and pseudo-label) tokens after [BOS chunk], one value per chunk."""
    bos = model.config.bos_token_id
    device = query.device
    tail = query if label is None else torch.cat([query, label])
    width = max(c.numel() for c in chunks) + 1 + tail.numel()
    rows = torch.full((len(chunks), width), model.config.pad_token_id, dtype=torch.long, device=device)
    starts = []
    for i, c in enumerate(chunks):
        seq = torch.cat([torch.tensor([bos], device=device), c, tail])
        rows[i, : seq.numel()] = seq  # right padding is invisible to earlier positions under a causal mask
        starts.append(1 + c.numel())
    # Next-token logits (row j predicts token j + 1), as the prefill scorer reads every model.
    hidden = model.hidden_states(rows, None, DenseAttention(causal=True))
    logits = model.lm_head(hidden[:, :-1]).float()
    nll = []
    for i, s in enumerate(starts):
        n = tail.numel()
        nll.append(F.cross_entropy(logits[i, s - 1 : s - 1 + n], rows[i, s : s + n]).item())
    return torch.tensor(nll)


def block_spans(prompt_length: int, gen_length: int, block: int) -> list[tuple[int, int]]:
    """Response-relative generation blocks aligned to absolute multiples of ``block``."""
    spans, lo = [], 0
    while lo < gen_length:
        hi = min(gen_length, ((prompt_length + lo) // block + 1) * block - prompt_length)
        spans.append((lo, hi))
        lo = hi
    return spans


@torch.inference_mode()
def generate_block_causal(
    model: DiffusionLM, prompt: torch.Tensor, gen: GenerationConfig
) -> GenerationResult:
    """Block diffusion without a cache: every step re-encodes prompt + response under the model's own
    block-causal attention (a block never sees a later one, so this equals the cached decode)."""
    block = gen.block_length or model.config.block_size
    state = DenoiseState(
        gen,
        model.config.mask_token_id,
        model.config.eos_token_id,
        prompt.device,
        block_spans(prompt.numel(), gen.gen_length, block),
    )
    logits_fn = vanilla_logits_fn(model, prompt, gen.gen_length)
    while not state.done:
        state.update(logits_fn(state.tokens, state.positions()))
    return GenerationResult(state.result(), state.tokens.tolist(), state.steps_taken, 0.0)


@torch.inference_mode()
def generate_pdllm_sim(model: DiffusionLM, tokenizer, context: str, query: str, sim: PdllmSim):
    device = next(model.parameters()).device
    ctx = torch.tensor(tokenizer(context, add_special_tokens=False)["input_ids"], device=device)
    q = torch.tensor(tokenizer(query, add_special_tokens=False)["input_ids"], device=device)
    chunks = list(torch.split(ctx, sim.chunk_size - 1))
    info = chunk_scores(model, chunks, q, None)
    best = int(info.argmin())
    draft = _decode_chunks(model, [chunks[best]], q, sim.gen)
    label = torch.tensor(draft.token_ids[:4] or [model.config.eos_token_id], device=device)
    score = info + chunk_scores(model, chunks, q, label)
    keep = sorted(torch.topk(-score, min(sim.top_k, len(chunks))).indices.tolist())
    return _decode_chunks(model, [chunks[i] for i in keep], q, sim.gen), keep


def _decode_chunks(model: DiffusionLM, chunks: list[torch.Tensor], q: torch.Tensor, gen: GenerationConfig):
    device = q.device
    bos = torch.tensor([model.config.bos_token_id], device=device)
    if model.config.block_size is not None:
        return generate_block_causal(model, torch.cat([x for c in chunks for x in (bos, c)] + [q]), gen)
    parts, seg = [], []
    for j, c in enumerate(chunks):
        parts.append(torch.cat([bos, c]))
        seg.append(torch.full((c.numel() + 1,), j, device=device))
    p = sum(x.numel() for x in parts) + q.numel()
    seg.append(torch.full((q.numel() + gen.gen_length,), -1, device=device))
    seg_t = torch.cat(seg)
    mask = ((seg_t[:, None] == seg_t[None, :]) | (seg_t[:, None] < 0))[None, None]
    seq = torch.cat([*parts, q, torch.empty(gen.gen_length, dtype=torch.long, device=device)])
    attention = DenseAttention(mask=mask)

    def logits_fn(response: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        seq[p:] = response
        return model(seq[None], attention=attention, logits_at=(positions + p)[None])[0]

    return denoise(gen, model.config.mask_token_id, model.config.eos_token_id, logits_fn, device=device)


def run(args: argparse.Namespace) -> dict:
    loaded = load_model(args.model, dtype="float32", device=args.device)
    model, tok = loaded.model, loaded.tokenizer
    # SDAR: generation blocks of the model's block size (its training block).
    gen = GenerationConfig(
        gen_length=args.gen_length, steps=args.gen_length, block_length=model.config.block_size
    )
    sim = PdllmSim(chunk_size=args.chunk_size, top_k=args.top_k, gen=gen)
    rows = []
    for method, lengths, n in (
        ("vanilla", args.vanilla_lengths, args.samples),
        ("pdllm", args.pdllm_lengths, args.samples),
    ):
        for length in lengths:
            for depth in args.depths:
                correct = hit = 0
                t0 = time.perf_counter()
                for seed in range(n):
                    s = make_sample(args.task, length, depth, seed, tok)
                    if method == "vanilla" and model.config.block_size is not None:
                        ids = torch.tensor(prompt_ids(tok, s), device=args.device)
                        out = generate_block_causal(model, ids, gen)
                    elif method == "vanilla":
                        out = generate_plain(model, prompt_ids(tok, s), gen)
                    else:
                        out, keep = generate_pdllm_sim(model, tok, s.context, s.query, sim)
                        hit += _gold_kept(tok, s, keep, sim.chunk_size)
                    correct += _decode_answer(tok, out.token_ids) == s.answer
                row = {"method": method, "task": args.task, "context_length": length, "depth": depth}
                row.update(accuracy=correct / n, samples=n, seconds=round(time.perf_counter() - t0, 2))
                if method == "pdllm":
                    row["gold_chunk_kept"] = hit / n
                rows.append(row)
                print(json.dumps(row), flush=True)
    return {
        "model": str(loaded.path),
        "train_length": args.train_length,
        "chunk_size": args.chunk_size,
        "top_k": args.top_k,
        "rows": rows,
    }


def _gold_kept(tok, sample, keep: list[int], chunk_size: int) -> int:
    ids = tok(sample.context, add_special_tokens=False)["input_ids"]
    gold = tok(sample.gold_facts[0], add_special_tokens=False)["input_ids"]
    for i in range(len(ids) - len(gold) + 1):
        if ids[i : i + len(gold)] == gold:
            first, last = i // (chunk_size - 1), (i + len(gold) - 1) // (chunk_size - 1)
            return int(first in keep and last in keep)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Quick needle evaluation of a trained checkpoint")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--task", default="needle")
    ap.add_argument("--train-length", type=int, default=1024)
    ap.add_argument("--vanilla-lengths", type=int, nargs="+", default=[512, 1024, 4096])
    ap.add_argument("--pdllm-lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--gen-length", type=int, default=16)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=3)
    args = ap.parse_args(argv)
    try:
        result = run(args)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
