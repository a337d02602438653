"""Polestar-Cache against Fast-dLLM's dual cache: what its speed claim rests on, measured two ways.

    python benchmarks/polestar_speed.py --out benchmarks/results          # GPU: step cost, Dream-7B shapes
    python benchmarks/polestar_speed.py --tpf --out benchmarks/results    # any device: tokens per forward

The paper's 1.7x over Fast-dLLM comes from parallelism: drift-aware refreshes keep predictions confident,
so a confidence threshold unmasks more tokens per forward (TPF), while each forward costs a little more.

* Default: tokens/s of the eager library loops (``generate_vanilla``, the loop the decode worker steps a
  Polestar request with) on Dream-7B shapes with random bf16 weights, a 1K-token prompt, gen 256, block 32,
  one token per step (the same forwards for every policy): ``none``, ``dual-cache``, ``polestar`` at the
  paper's knobs, with update threshold 0 and with exact (``none``) residuals.
* ``--tpf``: the shipped model (``shared/checkpoints/pdllm-needle``) under confidence threshold
  ``--threshold`` (0.9), the eval's needle (L and 16L; block 4, gen 8) and long-answer (L; block 32)
  samples at five depths: forwards, TPF, accuracy and token agreement with threshold decoding without a
  policy, for ``none``, ``dual-cache`` and ``polestar``.
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
from benchmarks.shapes import build_model, dream7b, sync  # noqa: E402
from pdllm.shared.generation.policies import DecodePolicyConfig  # noqa: E402
from pdllm.shared.generation.sampler import GenerationConfig  # noqa: E402
from pdllm.shared.generation.vanilla import generate_vanilla  # noqa: E402

SPEED_RUNS = (
    ("none", {}),
    ("dual-cache", {}),
    ("polestar", {}),
    ("polestar", {"polestar_update_threshold": 0}),
    ("polestar", {"polestar_residual_format": "none"}),
)
TPF_CELLS = (("needle", 1024, "vanilla"), ("needle", 1024, "pdllm"), ("needle", 16384, "pdllm"),
             ("long-answer", 1024, "vanilla"), ("long-answer", 1024, "pdllm"))  # fmt: skip


def speed(device: torch.device) -> list[dict]:
    model = build_model(dream7b(), device, torch.bfloat16)
    prompt = [151643, *random_ids(1024 + QUERY_TOKENS, 152064, torch.Generator().manual_seed(0))]
    rows = []
    for name, knobs in SPEED_RUNS:
        policy = DecodePolicyConfig(name, polestar=knobs) if knobs else DecodePolicyConfig(name)
        warm = GenerationConfig(gen_length=32, steps=32, block_length=32, stop_at_eos=False)
        generate_vanilla(model, prompt, warm, policy=policy)
        gen = GenerationConfig(gen_length=256, steps=256, block_length=32, stop_at_eos=False)
        sync(device)
        start = time.perf_counter()
        result = generate_vanilla(model, prompt, gen, policy=policy)
        sync(device)
        rows.append({"policy": name, "knobs": knobs, "tokens_per_s": 256 / (time.perf_counter() - start),
                     "cache": result.cache})  # fmt: skip
        print(f"[done] {json.dumps(rows[-1])}", flush=True)
    dual = next(r["tokens_per_s"] for r in rows if r["policy"] == "dual-cache")
    for r in rows:
        r["speedup_vs_dual_cache"] = r["tokens_per_s"] / dual
    return rows


def tpf(threshold: float) -> list[dict]:
    from pdllm.shared.app.engine import PrefillingEngine
    from pdllm.shared.app.eval import EvalSettings, eval_sample, exact_match
    from pdllm.shared.eval.long_answer import answer_gen_length
    from pdllm.shared.model.loader import load_model
    from pdllm.shared.prompt import encode_prompt

    loaded = load_model(str(ROOT / "shared/checkpoints/pdllm-needle"))
    tok, settings, engines, plain = loaded.tokenizer, EvalSettings(), {}, {}
    rows = []
    for task, length, method in TPF_CELLS:
        block = 4 if task == "needle" else 32
        for name in ("none", "dual-cache", "polestar"):
            forwards = tokens = correct = same = compared = 0
            for i, depth in enumerate((0.0, 0.25, 0.5, 0.75, 1.0)):
                sample = eval_sample(task, length, depth, 7000 + i, tok)
                n = 8 if task == "needle" else answer_gen_length(tok, sample, block)
                gen = GenerationConfig(gen_length=n, steps=n, block_length=block, threshold=threshold)
                ids, policy = encode_prompt(tok, sample.context, sample.question), DecodePolicyConfig(name)
                if method == "vanilla":
                    prompt = ids.vanilla(loaded.config.bos_token_id)
                    result = generate_vanilla(loaded.model, prompt, gen, policy=policy)
                else:
                    cfg = settings.engine_config(loaded, 1024, len(ids.query), n)
                    engine = engines.setdefault(cfg, PrefillingEngine(loaded.model, tok, cfg))
                    result, _ = engine.generate(ids.context, ids.query, gen, decode_policy=policy)
                forwards, tokens = forwards + result.steps, tokens + n
                text = tok.decode(result.token_ids, skip_special_tokens=True)
                correct += task == "needle" and exact_match(text, sample.answer)
                ref = plain.setdefault((task, length, method, i), result.raw_tokens)
                same += sum(a == b for a, b in zip(ref, result.raw_tokens, strict=True))
                compared += len(ref)
            rows.append({"task": task, "context_tokens": length, "method": method, "policy": name,
                         "threshold": threshold, "forwards": forwards, "tokens": tokens, "tpf": tokens / forwards,
                         "accuracy": correct / 5 if task == "needle" else None, "agreement": same / compared})  # fmt: skip
            print(f"[done] {json.dumps(rows[-1])}", flush=True)
    return rows


def markdown(report: dict) -> str:
    lines = ["# Polestar-Cache vs dual cache: step cost and tokens per forward", "",
             f"{report['device']}, {report['date']}, `{report['command']}`", ""]  # fmt: skip
    if report.get("speed"):
        lines += [
            "| policy | knobs | tokens/s | vs dual cache | updates | rows recomputed |",
            "|---|---|---|---|---|---|",
        ]
        for r in report["speed"]:
            c = r["cache"] or {}
            lines.append(f"| {r['policy']} | {r['knobs'] or '—'} | {r['tokens_per_s']:.1f} | "
                         f"{r['speedup_vs_dual_cache']:.2f}x | {c.get('updates', '—')} | {c.get('rows_recomputed', '—')} |")  # fmt: skip
    if report.get("tpf"):
        lines += [
            "| task | context | method | policy | forwards | TPF | accuracy | agreement |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in report["tpf"]:
            acc = "—" if r["accuracy"] is None else f"{100 * r['accuracy']:.0f}%"
            lines.append(f"| {r['task']} | {r['context_tokens']} | {r['method']} | {r['policy']} | {r['forwards']} | "
                         f"{r['tpf']:.2f} | {acc} | {100 * r['agreement']:.1f}% |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--tpf", action="store_true", help="tokens per forward on the shipped model instead")
    ap.add_argument("--threshold", type=float, default=0.9)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not args.tpf and not cuda:
        raise SystemExit("the step-cost run needs a CUDA device (7B shapes); --tpf runs anywhere")
    report = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python benchmarks/polestar_speed.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    if args.tpf:
        report["tpf"] = tpf(args.threshold)
    else:
        report["speed"] = speed(torch.device("cuda"))
    name = "polestar_tpf" if args.tpf else "polestar_speed"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / f"{name}.md").write_text(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
