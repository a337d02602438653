"""Compute-skipping decode policies (DyLLM, FOCUS) against plain decoding: tokens/s and rows computed.

    python benchmarks/decode_compute_skip.py --out benchmarks/results           # GPU: 7B/8B shapes, bf16
    python benchmarks/decode_compute_skip.py --smoke --out /tmp/compute_skip    # CPU: tiny, seconds

``generate --method vanilla`` on a 1K-token prompt (BOS + context + 24-token question) at batch 1, block
32, one token per step, greedy, no EOS stop, through the library loops the CLI and the worker run
(``policies/compute_skip.py``): Dream-7B shapes for ``none`` (the plain eager loop), ``dual-cache`` (its
eager reference loop), ``dyllm`` (its fast path) and ``focus`` (its reference request loop); SDAR-8B
shapes (Qwen3-8B layout, model block 4, generation block 32) for ``none`` (block-by-block decoding over
the exact cache) and ``focus``. Random weights make the policies' choices arbitrary (which rows are
salient, which tokens look decodable), so the rows each computes are reported beside the speed:
``rows_frac`` = rows the policy ran through its skipping layers / rows plain decoding would have. Each run
decodes ``--probe-blocks`` blocks after a one-block warm-up; tokens/s = tokens / seconds of those blocks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.e2e_speedup import QUERY_TOKENS, random_ids  # noqa: E402
from benchmarks.shapes import build_model, dream7b, sync, tiny  # noqa: E402
from pdllm.shared.generation.policies import DecodePolicyConfig  # noqa: E402
from pdllm.shared.generation.sampler import GenerationConfig  # noqa: E402
from pdllm.shared.generation.vanilla import generate_vanilla  # noqa: E402
from pdllm.shared.model.config import ModelConfig  # noqa: E402


def sdar8b(smoke: bool) -> ModelConfig:
    if smoke:
        return ModelConfig(
            family="sdar", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
            num_kv_heads=2, head_dim=16, max_position_embeddings=8192, mask_token_id=511, bos_token_id=1,
            eos_token_id=2, pad_token_id=0, block_size=4, model_id="tiny-sdar",
        )  # fmt: skip
    return ModelConfig(
        family="sdar", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6, max_position_embeddings=32768,
        mask_token_id=151669, bos_token_id=151643, eos_token_id=151643, pad_token_id=151643, block_size=4,
        model_id="sdar8b-shapes-random",
    )  # fmt: skip


def run(model, prompt: list[int], policy: str, block: int, blocks: int) -> dict:  # type: ignore[no-untyped-def]
    gen_len = block * blocks
    cfg = GenerationConfig(gen_length=gen_len, steps=gen_len, block_length=block, stop_at_eos=False)
    device = next(model.parameters()).device
    sync(device)
    start = time.perf_counter()
    result = generate_vanilla(model, prompt, cfg, policy=DecodePolicyConfig(policy))
    sync(device)
    return {"seconds": time.perf_counter() - start, "cache": result.cache}


def rows_frac(cache: dict) -> float | None:
    counters = {**cache, **cache.get("counters", {})} if cache else {}
    total = counters.get("rows_total") or counters.get("rows_plain")
    done = counters.get("rows_forwarded")
    return done / total if total and done is not None else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--probe-blocks", type=int, default=2)
    ap.add_argument("--context", type=int, default=None, help="prompt context tokens (default 1024)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    block = 32 if cuda else 8
    context = args.context or (1024 if cuda else 64)
    rows = []
    for shapes, policies in (
        (dream7b() if cuda else tiny(), ("none", "dual-cache", "dyllm", "focus")),
        (sdar8b(not cuda), ("none", "focus")),
    ):
        model = build_model(shapes, device, dtype)
        rng = torch.Generator().manual_seed(0)
        prompt = [shapes.bos_token_id, *random_ids(context + QUERY_TOKENS, shapes.vocab_size, rng)]
        for policy in policies:
            try:
                run(model, prompt, policy, block, 1)  # warm-up
                r = run(model, prompt, policy, block, args.probe_blocks)
            except Exception as exc:  # recorded; the rest still runs
                rows.append(
                    {
                        "model": shapes.model_id,
                        "policy": policy,
                        "error": f"{type(exc).__name__}: {exc}"[:300],
                    }
                )
                print(f"[error] {rows[-1]}", flush=True)
                continue
            tokens = block * args.probe_blocks
            row = {"model": shapes.model_id, "policy": policy, "method": "vanilla", "context_tokens": context,
                   "gen_length": tokens, "batch": 1, "tokens_per_s": tokens / r["seconds"],
                   "rows_frac": rows_frac(r["cache"]), "cache": r["cache"]}  # fmt: skip
            rows.append(row)
            print(f"[done] {json.dumps(row)}", flush=True)
        del model
        if cuda:
            torch.cuda.empty_cache()
    base = {r["model"]: r["tokens_per_s"] for r in rows if r.get("policy") == "none" and "tokens_per_s" in r}
    for r in rows:
        if "tokens_per_s" in r and r["model"] in base:
            r["speedup_vs_plain"] = r["tokens_per_s"] / base[r["model"]]
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python benchmarks/decode_compute_skip.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "torch": torch.__version__,
    }
    name = "decode_compute_skip" if cuda else "decode_compute_skip_smoke"
    (args.out / f"{name}.json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    lines = [
        "# Compute-skipping decode policies vs plain decoding (batch 1, eager library loops)",
        "",
        f"{meta['device']}, {meta['date']}, `{meta['command']}`",
        "",
        "| model | policy | tokens/s | vs plain | rows computed / plain |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['policy']} | error: {r['error'][:80]} | | |")
            continue
        frac = "—" if r["rows_frac"] is None else f"{r['rows_frac']:.2f}"
        lines.append(
            f"| {r['model']} | {r['policy']} | {r['tokens_per_s']:.1f} | {r.get('speedup_vs_plain', 0):.2f}x | {frac} |"
        )
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
